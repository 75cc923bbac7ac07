"""Multi-turn rollouts on an image-text model (rollout/multi_turn.py): the image of the first
turn is read again by every later turn, and the training forward over the whole episode
(prompt with its image tokens, the policy's turns, the environment's answers) scores the
policy's tokens as the rollout sampled them."""

from __future__ import annotations

import pytest
import torch

from dagrl.config.multi_turn import MultiTurnConfig
from dagrl.data.images import IMAGE_PLACEHOLDER
from dagrl.data.vision import ImageEncoder, ImageInputs
from dagrl.engines.forward import response_logprobs
from dagrl.engines.models import load_model, load_tokenizer, write_tiny_model
from dagrl.envs import load_environment
from dagrl.rollout.hf import HFRollout
from dagrl.rollout.multi_turn import MultiTurnRollout
from dagrl.rollout.sampling import SamplingParams
from tests.prompts import picture
from tests.test_vision import VLM_RUN


def agent_loop(engine, tokenizer, encoder: ImageEncoder) -> MultiTurnRollout:
    """The agent loop with `guess_number` over `engine`: up to 3 turns of 3 tokens."""
    cfg = MultiTurnConfig(enable=True, environment="guess_number", max_turns=3,
                          max_tokens_per_turn=3, format="tiny")
    return MultiTurnRollout(engine, tokenizer, cfg, tools={},
                            env_factory=load_environment("guess_number"), prompt_width=96,
                            response_width=24, pad_token_id=tokenizer.pad_token_id,
                            images=encoder)


def rows(encoder: ImageEncoder, pictures: list) -> list[dict]:
    question = f"HOW MANY RED SHAPES?{IMAGE_PLACEHOLDER}"
    out = [{"prompt": [{"role": "user", "content": question}], "data_source": "shapes",
            "ground_truth": "9", "extra_info": {}, "images": encoder.encode([p])}
           for p in pictures]
    out.append({"prompt": [{"role": "user", "content": "GUESS A NUMBER: "}],
                "data_source": "shapes", "ground_truth": "9", "extra_info": {}, "images": None})
    return out


def test_every_turn_reads_the_first_turns_image_and_the_training_forward_agrees(tmp_path):
    path = write_tiny_model(tmp_path / "m", "tiny-qwen2.5-vl")
    tokenizer = load_tokenizer(str(path))
    model, encoder = load_model(str(path)), ImageEncoder.of_model(path, tokenizer)
    loop = agent_loop(HFRollout(model, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id), tokenizer, encoder)
    red = picture((112, 112), "red", (10, 10, 50, 50))
    blue = picture((84, 56), "blue", (30, 5, 80, 40))
    episodes = rows(encoder, [red, blue])
    out = loop.generate(episodes, torch.tensor([1, 2, 3]), SamplingParams(1.0, 0, 1.0),
                        torch.device("cpu"))
    # the secret (9) is not among these samples' answers: every episode goes on after the
    # environment's first answer, until its 24-token budget runs out
    assert out.turns.min() >= 2
    observed = out.attention_mask.bool() & ~out.response_mask.bool()
    assert observed.sum(-1).min() > 0
    assert (out.prompt_ids == encoder.pad_id).sum(-1).tolist() == [16, 6, 0]
    images = ImageInputs.concat([e["images"] for e in episodes])
    teacher = response_logprobs(model, out.prompt_ids, out.prompt_mask, out.responses,
                                out.response_mask, attention_mask=out.attention_mask,
                                images=images).logprobs
    policy = out.response_mask.bool()
    torch.testing.assert_close(teacher[policy], out.logprobs[policy], atol=1e-5, rtol=0)
    # the turns after the first read the picture: other pixels change their log-probs
    other = ImageInputs(images.pixel_values.flip(0), images.image_grid_thw)
    moved = response_logprobs(model, out.prompt_ids, out.prompt_mask, out.responses,
                              out.response_mask, attention_mask=out.attention_mask,
                              images=other).logprobs
    later = policy & (torch.arange(policy.shape[1]) > observed.float().argmax(-1, keepdim=True))
    assert (moved[0][later[0]] - teacher[0][later[0]]).abs().max() > 1e-4


def test_the_agent_loop_refuses_an_image_row_on_a_text_model_setup(tmp_path):
    """Rows with images need the model's image encoder: without it the loop says so."""
    path = write_tiny_model(tmp_path / "m", "tiny-qwen2.5-vl")
    tokenizer = load_tokenizer(str(path))
    encoder = ImageEncoder.of_model(path, tokenizer)
    loop = agent_loop(HFRollout(load_model(str(path)), eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id), tokenizer, None)
    with pytest.raises(ValueError, match="images but the agent loop has no image encoder"):
        loop.generate(rows(encoder, [picture((56, 56), "red", (5, 5, 20, 20))]),
                      torch.tensor([1, 2]), SamplingParams(1.0, 0, 1.0), torch.device("cpu"))


def test_grpo_trains_an_image_text_model_over_several_turns(tmp_path):
    """The trainer with an environment on the picture task: episodes of several turns whose
    prompt is the picture, trained with the rollout's log-probs equal to the actor's."""
    from dagrl.config.presets import load_run_config
    from dagrl.runtime.launch import launch
    from tests.dist_helpers import step_metrics

    run_dir = tmp_path / "run"
    args = [a for a in VLM_RUN if not a.startswith(("rollout.max_new_tokens", "trainer.total",
                                                    "data.val_files"))]
    launch(load_run_config(None, [
        f"trainer.run_dir={run_dir}", *args, "trainer.total_steps=2",
        "data.val_files=[builtin:shapes]", "trainer.val_every=2",
        "rollout.max_new_tokens=32", "rollout.multi_turn.enable=true",
        "rollout.multi_turn.environment=guess_number", "rollout.multi_turn.max_turns=3",
        "rollout.multi_turn.max_tokens_per_turn=2", "rollout.multi_turn.format=tiny"]))
    steps = step_metrics(run_dir)
    assert len(steps) == 2
    assert all(m["multi_turn/turns_mean"] > 1.5 for m in steps)
    assert all(m["actor/rollout_logprob_gap"] < 1e-4 for m in steps)
    assert all(m["actor/grad_norm"] > 0 for m in steps)
    assert steps[-1]["val/multi_turn/turns_mean"] > 1.5   # validation episodes too
