"""`rollout.backend=vllm` on an image-text model (issue 36): vLLM's multimodal processor takes
each prompt's pictures, and its log-probs on the sampled tokens equal the training forward's
(which reads the same pixels at the same M-RoPE positions); weight updates reach the vision
tower; GRPO trains through it. Real vLLM engines (CPU build), in the vLLM venv."""

from __future__ import annotations

import math

import pytest
import torch

from dagrl.config.loader import load_config
from dagrl.config.schema import Config
from dagrl.data.vision import IMAGE_BLOCK, ImageEncoder
from dagrl.engines.forward import response_logprobs
from dagrl.engines.models import load_model, load_tokenizer, write_tiny_model
from dagrl.rollout.hf import HFRollout
from dagrl.rollout.sampling import SamplingParams, mix_seed
from tests.prompts import image_prompts, picture
from tests.vllm_helpers import SMALL_ENGINE

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("vlm") / "m", "tiny-qwen2.5-vl")


@pytest.fixture(scope="module")
def engine(vlm_dir):
    pytest.importorskip("vllm")
    from dagrl.rollout.vllm import VLLMRollout, VLLMSettings

    # max_new_tokens sets the engine's context: room for a multi-turn episode's 24 tokens
    cfg = load_config(Config, None, [f"model.path={vlm_dir}", "data.max_prompt_length=96",
                                     "rollout.max_new_tokens=24", *SMALL_ENGINE])
    tok = load_tokenizer(str(vlm_dir))
    return VLLMRollout(VLLMSettings.from_config(cfg), torch.device("cpu"),
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


@pytest.fixture(scope="module")
def prompts(vlm_dir):
    """Left-padded rows with one image, two images of other sizes, and none."""
    tok = load_tokenizer(str(vlm_dir))
    red = picture((112, 112), "red", (10, 10, 50, 50))
    blue = picture((84, 56), "blue", (30, 5, 80, 40))
    green = picture((56, 56), "green", (5, 5, 30, 50))
    rows = [(f"HOW MANY?{IMAGE_BLOCK}", [red]),
            (f"TWO:{IMAGE_BLOCK} AND {IMAGE_BLOCK}?", [blue, green]),
            ("no image here?", []),
            (f"{IMAGE_BLOCK}WHAT COLOUR?", [green])]
    return image_prompts(tok, ImageEncoder.of_model(vlm_dir, tok), rows)


def _sampled_equal_the_training_forward(engine, model, prompts):
    ids, mask, images = prompts
    seeds = mix_seed(5, 1, torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long))
    out = engine.generate(ids, mask, seeds, SamplingParams(temperature=1.0),
                          max_new_tokens=12, images=images)
    used = out.response_mask.bool()
    assert used.sum() > 2 * len(ids)
    teacher = response_logprobs(model, ids, mask, out.responses, out.response_mask,
                                images=images).logprobs
    torch.testing.assert_close(out.logprobs[used], teacher[used], atol=1e-4, rtol=0)
    return out


def test_vllm_logprobs_on_images_equal_the_training_forward(engine, vlm_dir, prompts):
    """Done-when 2 (vLLM): sampled tokens' log-probs within 1e-4 of the training forward's,
    and greedy decoding equal to the hf backend's, on rows with 0, 1 and 2 images."""
    model = load_model(str(vlm_dir))
    _sampled_equal_the_training_forward(engine, model, prompts)
    ids, mask, images = prompts
    tok = load_tokenizer(str(vlm_dir))
    hf = HFRollout(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    greedy, seeds = SamplingParams(temperature=0.0), torch.arange(len(ids))
    ours = engine.generate(ids, mask, seeds, greedy, max_new_tokens=12, images=images)
    ref = hf.generate(ids, mask, seeds, greedy, max_new_tokens=12, images=images)
    assert torch.equal(ours.responses, ref.responses)
    torch.testing.assert_close(ours.logprobs, ref.logprobs, atol=1e-4, rtol=0)


def test_multi_turn_episodes_read_the_first_turns_image_through_vllm(engine, vlm_dir):
    """The agent loop over vLLM: every turn's context goes with the episode's pictures, and
    the training forward over the whole episode scores the policy's tokens as vLLM did."""
    from dagrl.data.vision import ImageInputs
    from tests.test_vision_multi_turn import agent_loop, rows

    tok = load_tokenizer(str(vlm_dir))
    encoder = ImageEncoder.of_model(vlm_dir, tok)
    episodes = rows(encoder, [picture((112, 112), "red", (10, 10, 50, 50)),
                              picture((84, 56), "blue", (30, 5, 80, 40))])
    out = agent_loop(engine, tok, encoder).generate(
        episodes, torch.tensor([1, 2, 3]), SamplingParams(1.0, 0, 1.0), torch.device("cpu"))
    assert out.turns.min() >= 2
    teacher = response_logprobs(load_model(str(vlm_dir)), out.prompt_ids, out.prompt_mask,
                                out.responses, out.response_mask,
                                attention_mask=out.attention_mask,
                                images=ImageInputs.concat([e["images"] for e in episodes]))
    policy = out.response_mask.bool()
    torch.testing.assert_close(out.logprobs[policy], teacher.logprobs[policy], atol=1e-4,
                               rtol=0)


def test_a_weight_update_reaches_the_vision_tower(engine, vlm_dir, prompts):
    """Changing only the vision tower's weights changes what vLLM computes for the rows with
    images, and after the update vLLM still equals the training forward."""
    model = load_model(str(vlm_dir))
    ids, mask, images = prompts
    greedy = SamplingParams(temperature=0.0)
    before = engine.generate(ids, mask, torch.arange(len(ids)), greedy, max_new_tokens=12,
                             images=images)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if ".visual." in f".{name}":
                p.add_(0.5 * torch.randn(p.shape, generator=generator))
    engine.update_weights(model.named_parameters(), version=1)
    after = engine.generate(ids, mask, torch.arange(len(ids)), greedy, max_new_tokens=12,
                            images=images)
    changed = (after.logprobs - before.logprobs).abs().amax(-1)
    assert (changed[[0, 1, 3]] > 1e-3).all(), changed   # the rows that hold images moved
    assert changed[2] < 1e-5, changed                    # the text-only row did not
    _sampled_equal_the_training_forward(engine, model, prompts)


def _grpo_through_vllm(run_dir, *overrides: str) -> list[dict]:
    """3 steps of the built-in picture task through vLLM; checks the engine followed them."""
    from dagrl.runtime.run_dir import prepare_run
    from dagrl.runtime.worker import Worker

    cfg = load_config(Config, None, [
        f"trainer.run_dir={run_dir}", "model.path=builtin:tiny-qwen2.5-vl",
        "data.train_files=[builtin:shapes]", "data.max_prompt_length=128",
        "rollout.backend=vllm", "rollout.max_new_tokens=4", "data.train_batch_size=8",
        "rollout.n=4", "actor.mini_batch_size=8", "trainer.total_steps=3",
        "trainer.torch_threads=2", "trainer.save_final=false", "logging.progress_bar=false",
        "logging.console_every=1000", *SMALL_ENGINE, *overrides])
    worker = Worker(prepare_run(cfg))
    history = worker.train()
    assert type(worker.engines.rollout).__name__ == "VLLMRollout"
    assert len(history) == 3 and worker.engines.rollout.weights_version == 3
    return history


def test_grpo_trains_an_image_text_model_through_vllm(engine, tmp_path):
    """The trainer's recomputed log-probs stay next to vLLM's at every step (the old_logprob
    pass measures the gap), so vLLM follows the updated vision tower and decoder."""
    del engine   # (module order: that engine exists; this run builds its own)
    for step in _grpo_through_vllm(tmp_path / "run"):
        assert step["actor/rollout_logprob_gap"] <= 1e-3, step["actor/rollout_logprob_gap"]
        assert math.isfinite(step["actor/pg_loss"])


def test_a_lora_actor_of_an_image_text_model_syncs_its_adapters_to_vllm(engine, tmp_path):
    """LoRA on the language model (the vision tower frozen): vLLM applies the adapters itself
    and its log-probs stay next to the actor's as the adapters grow (a large lr, so that they
    matter by step 3)."""
    del engine
    history = _grpo_through_vllm(tmp_path / "run", "actor.lora.rank=8", "actor.lr=0.05")
    # the adapters alone go over (measured: 90 KB of the model's 850 KB)
    model = load_model(str(write_tiny_model(tmp_path / "m", "tiny-qwen2.5-vl")))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(m["weight_sync/bytes"] < 0.2 * model_bytes for m in history)
    assert history[-1]["actor/kl"] > 0.01   # the adapters moved the policy off the base
    for step in history:
        assert step["actor/rollout_logprob_gap"] <= 1e-3, step["actor/rollout_logprob_gap"]
