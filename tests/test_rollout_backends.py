"""`rollout.backend=native` and `hf` train the default task to the same curve, and their greedy
outputs on the trained weights are equal token for token.

In float64 the two backends' logits differ by rounding only (~1e-16), which never moves a
float32-cast sampling decision here, so whole runs can be compared exactly (see
test_golden_curve.py for the same argument).
"""

from __future__ import annotations

import pytest
import torch

from dagrl.config.loader import load_config
from dagrl.config.schema import Config
from dagrl.rollout.hf import HFRollout
from dagrl.rollout.native import NativeRollout
from dagrl.rollout.sampling import SamplingParams
from dagrl.runtime.run_dir import prepare_run
from dagrl.runtime.worker import Worker

OVERRIDES = ["trainer.total_steps=3", "trainer.seed=0", "trainer.torch_threads=1",
             "model.dtype=float64", "data.val_files=[builtin:arith]", "trainer.val_every=3",
             "logging.progress_bar=false", "logging.console_every=1000"]
EXACT = ("reward/mean", "response/length/mean", "val/arith/score")
CLOSE = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl")
ENGINE = {"native": NativeRollout, "hf": HFRollout}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = {}
    for backend in ENGINE:
        run_dir = tmp_path_factory.mktemp(backend)
        cfg = prepare_run(load_config(Config, None, [f"trainer.run_dir={run_dir}", *OVERRIDES,
                                                     f"rollout.backend={backend}"]))
        worker = Worker(cfg)
        out[backend] = (worker, worker.train())
    return out


def test_both_backends_train_the_default_task_alike(trained):
    for backend, cls in ENGINE.items():
        assert type(trained[backend][0].engines.rollout) is cls
    native, hf = trained["native"][1], trained["hf"][1]
    assert len(native) == len(hf) == 3
    for step, (a, b) in enumerate(zip(native, hf, strict=True), start=1):
        for key in EXACT:
            if key in a or key in b:
                assert a[key] == b[key], f"step {step} {key}: native {a[key]} != hf {b[key]}"
        for key in CLOSE:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (step, key)
    assert "val/arith/score" in native[-1]


def test_greedy_outputs_are_equal_on_trained_weights(trained):
    worker = trained["hf"][0]
    hf = worker.engines.rollout
    native = NativeRollout(hf.model, eos_token_id=worker.engines.tokenizer.eos_token_id,
                           pad_token_id=worker.engines.tokenizer.pad_token_id)
    batch = worker.validator.loader.batch_of_rows(worker.validator.rows)   # the test split
    seeds = torch.zeros(len(batch), dtype=torch.long)
    outs = [engine.generate(batch["prompt_ids"], batch["prompt_mask"], seeds,
                            SamplingParams(temperature=0.0), max_new_tokens=8)
            for engine in (native, hf)]
    assert torch.equal(outs[0].response_mask, outs[1].response_mask)
    assert torch.equal(outs[0].responses, outs[1].responses)
    assert outs[0].response_mask.sum() > len(batch)   # not all stopped at the first token
    # Log-probs are stored in float32 by both backends: equal up to that rounding.
    torch.testing.assert_close(outs[0].logprobs, outs[1].logprobs, rtol=1e-6, atol=1e-6)


def test_vllm_over_several_workers_needs_the_rollout_node_on_every_rank(tmp_path):
    # vLLM's engines join the process group together: a rank without one would hang the rest.
    from dagrl.roles.plan import plan_for
    from dagrl.runtime.worker_build import check_rollout_on_every_rank

    graph = tmp_path / "g.yaml"
    graph.write_text("name: g\nnodes:\n"
                     "  - {id: rollout, role: rollout, options: {ranks: [0]}}\n"
                     "  - {id: reward, role: reward, deps: [rollout]}\n"
                     "  - {id: advantage, role: advantage, deps: [reward]}\n"
                     "  - {id: actor_update, role: actor_update, deps: [advantage]}\n")
    cfg = load_config(Config, None, ["rollout.backend=vllm", "trainer.n_workers=2",
                                     f"dag.graph={graph}", "algorithm.kl_loss_coef=0"])
    with pytest.raises(ValueError, match=r"rollout node on every rank .*; ranks \[1\]"):
        check_rollout_on_every_rank(plan_for(cfg, 2)[2], "vllm")
    everywhere = load_config(Config, None, ["rollout.backend=vllm", "trainer.n_workers=2"])
    check_rollout_on_every_rank(plan_for(everywhere, 2)[2], "vllm")   # the built-in graph: fine
