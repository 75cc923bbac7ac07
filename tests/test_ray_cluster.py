"""dagrl on a real multi-node Ray cluster, on one machine (issue 20).

One cluster for the module, started the way a user starts one: `ray start --head` and
`ray start --address` (tests/ray_cluster.py), two nodes with their own resources. "GPU" and
"NPU" are stand-ins there: a CPU node may declare accelerators, and Ray then assigns their ids
and sets the visible-devices variables exactly as on real ones, which is what the launch code
reads. Nothing here runs on an accelerator.

- a 2-worker run spread over the two nodes equals the 1-worker run;
- the environment each worker receives (RANK, LOCAL_RANK per node, visible devices) for
  stand-in GPUs on two nodes and NPUs on one;
- a run asking for more NPUs than the cluster has (4 of 2) stops within its placement timeout,
  in one line naming the missing resource.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from dagrl.config.loader import load_config
from dagrl.config.schema import Config
from dagrl.device import ray_device_type, ray_worker_envs
from dagrl.runtime.launch import launch
from tests.ray_cluster import env, two_node_cluster

# Each test starts Ray clusters of its own (slow marker: `pytest -m slow`).
pytestmark = pytest.mark.slow

HEAD = {"num_cpus": 2, "num_gpus": 2, "resources": {"node_head": 1}}
WORKER = {"num_cpus": 2, "num_gpus": 2, "resources": {"NPU": 2, "node_second": 1}}
# One quick step per run: 4 prompts x 2 samples, 4 new tokens.
SMALL = ["logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1",
         "data.train_batch_size=4", "actor.mini_batch_size=4", "rollout.n=2",
         "rollout.max_new_tokens=4", "trainer.total_steps=2", "trainer.device=cpu"]
COMPARED = ["reward/mean", "response/length/mean", "actor/pg_loss", "actor/entropy",
            "actor/grad_norm"]


@pytest.fixture(scope="module")
def cluster():
    with two_node_cluster(HEAD, WORKER) as c:
        yield c


@pytest.fixture()
def driver(cluster):
    """This test process as a driver of the cluster."""
    import ray

    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _dagrl_train(args: list[str], address: str, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "dagrl.cli", "train", *args],
                          env={**env(), "RAY_ADDRESS": address}, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_two_node_run_equals_the_one_worker_run(cluster, tmp_path):
    one = tmp_path / "one"
    launch(load_config(Config, None, [f"trainer.run_dir={one}", *SMALL]))
    two = tmp_path / "two"
    # STRICT_SPREAD: one worker per node, whatever the nodes' sizes.
    proc = _dagrl_train([f"trainer.run_dir={two}", "trainer.n_workers=2",
                         "trainer.placement_strategy=STRICT_SPREAD", *SMALL], cluster.address)
    assert proc.returncode == 0, proc.stderr[-3000:]
    placed = [line for line in proc.stdout.splitlines() if "worker(s) on" in line]
    assert placed and "2 worker(s) on 2 node(s)" in placed[0], proc.stdout[-2000:]
    ours, reference = _metrics(two), _metrics(one)
    assert [m["step"] for m in ours] == [m["step"] for m in reference] == [1, 2]
    for a, b in zip(ours, reference, strict=True):
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert ours[0]["batch/max_samples_per_rank"] == 4   # half the batch on each node's worker


def _check_world(envs, n):
    assert [e["RANK"] for e in envs] == [str(r) for r in range(n)]
    assert {e["WORLD_SIZE"] for e in envs} == {str(n)}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1


def test_stand_in_gpus_on_two_nodes_get_local_ranks_and_visible_devices(driver):
    from dagrl.runtime.ray_worker import start_workers

    workers = start_workers("cuda", 4, "PACK", timeout_s=120)
    try:
        envs, placements = workers.envs, workers.placements
        _check_world(envs, 4)
        nodes = workers.nodes()
        assert sorted(len(r) for r in nodes.values()) == [2, 2]   # 2 GPUs per node
        for ranks in nodes.values():
            node_envs = [envs[r] for r in ranks]
            assert [e["LOCAL_RANK"] for e in node_envs] == ["0", "1"]
            assert {e["LOCAL_WORLD_SIZE"] for e in node_envs} == {"2"}
            visible = {e["CUDA_VISIBLE_DEVICES"] for e in node_envs}
            assert len(visible) == 1   # the node's workers see the same devices, in one order
            ids = visible.pop().split(",")
            for r in ranks:   # device index LOCAL_RANK is the GPU Ray gave this rank
                (mine,) = placements[r]["accelerator_ids"]
                assert ids[int(envs[r]["LOCAL_RANK"])] == mine
            assert sorted(ids) == ["0", "1"]
        # Ray itself set each actor's variable to its own GPU before dagrl widened it.
        assert all(p["ray_visible"] == p["accelerator_ids"][0] for p in placements)
    finally:
        workers.stop()


def test_stand_in_npus_get_ascend_visible_devices(driver):
    from dagrl.runtime.ray_worker import start_workers

    workers = start_workers("npu", 2, "PACK", timeout_s=120)
    try:
        envs, placements = workers.envs, workers.placements
        _check_world(envs, 2)
        assert len(workers.nodes()) == 1   # only the second node registers NPUs
        assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
        assert {e["ASCEND_RT_VISIBLE_DEVICES"] for e in envs} == {
            ",".join(p["accelerator_ids"][0] for p in placements)}
        assert sorted(p["ray_visible"] for p in placements) == ["0", "1"]
        assert all("CUDA_VISIBLE_DEVICES" not in e for e in envs)
    finally:
        workers.stop()


def test_missing_npus_fail_within_the_timeout_naming_the_resource(cluster, tmp_path):
    start = time.monotonic()
    proc = _dagrl_train([f"trainer.run_dir={tmp_path / 'run'}", "trainer.n_workers=4",
                         "trainer.device=npu", "trainer.placement_timeout_s=5",
                         *SMALL[:-1]], cluster.address, timeout=120)
    elapsed = time.monotonic() - start
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert "Ray could not place" in errors[0] and "within 5 s" in errors[0]
    assert "NPU: needs 4, the cluster has 2" in errors[0], errors[0]
    assert elapsed < 90, elapsed   # the wait ended (a driver start is ~10-30 s here)


def test_auto_device_follows_the_cluster_and_envs_need_one_device_each():
    assert ray_device_type("auto", {"CPU": 8.0, "GPU": 8.0}) == "cuda"
    assert ray_device_type("auto", {"CPU": 8.0, "NPU": 16.0}) == "npu"
    assert ray_device_type("auto", {"CPU": 8.0}) == "cpu"
    assert ray_device_type("npu", {"CPU": 8.0}) == "npu"   # configured: the workers check it
    envs = ray_worker_envs("cuda", [("a", ["3"]), ("b", ["0"]), ("a", ["1"])])
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0", "1"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,1", "0", "3,1"]
    assert ray_worker_envs("cpu", [("a", []), ("a", [])]) == [
        {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}]
    with pytest.raises(RuntimeError, match="exactly one"):
        ray_worker_envs("cuda", [("a", [])])

