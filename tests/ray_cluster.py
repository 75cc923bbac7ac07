"""A two-node Ray cluster on this machine, started as a user would: `ray start --head`, then
`ray start --address` for a second node (tests only).

Each node is a `ray start --block` process of ours, so everything the cluster runs (GCS, raylets,
agents, workers) is a descendant of one of two known pids; stopping the cluster ends exactly
those processes (never `ray stop`, which would stop every Ray instance on the machine, other
people's included). Every port a node would otherwise take from a fixed default (client server,
dashboard agent, metrics, ...) is a free one, and the session lives in its own temp dir, so
this cluster neither joins nor disturbs any other Ray instance running here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dagrl.runtime.reaper import descendants, proc_stat
from tests.dist_helpers import free_port

# A node start takes ~5-20 s here (more while the 2 cores are busy).
START_TIMEOUT_S = 180.0


def env() -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONUNBUFFERED": "1"}


def _ray_cli() -> list[str]:
    return [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; "
            "sys.argv[0] = 'ray'; sys.exit(main())"]


def _node_args(num_cpus: int, num_gpus: int, resources: dict[str, float]) -> list[str]:
    return ["--block", "--num-cpus", str(num_cpus), "--num-gpus", str(num_gpus),
            "--resources", json.dumps(resources), "--object-store-memory", str(100 << 20),
            "--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
            "--dashboard-agent-listen-port", str(free_port()),
            "--dashboard-agent-grpc-port", str(free_port()),
            "--runtime-env-agent-port", str(free_port()),
            "--metrics-export-port", str(free_port()), "--disable-usage-stats"]


def _descendants(roots: list[int]) -> list[int]:
    """Every live descendant of the processes `roots` (the reaper's own walk of /proc)."""
    alive = {pid: found[1] for pid in roots if (found := proc_stat(pid)) is not None}
    return [pid for pid in descendants(alive) if pid not in alive]


@dataclass
class Cluster:
    address: str
    temp_dir: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def stop(self) -> None:
        """SIGTERM our nodes (ray start --block then stops what it started), SIGKILL whatever
        of their process trees is left after a grace period."""
        tree = _descendants([p.pid for p in self.procs])
        for p in reversed(self.procs):   # the worker node first, then the head
            with contextlib.suppress(OSError):
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        for pid in [*(p.pid for p in self.procs), *tree, *_descendants(tree)]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()


def _wait_nodes(address: str, n: int, procs: list[subprocess.Popen], log: Path) -> None:
    """Until the cluster reports `n` alive nodes (a short-lived driver asks it)."""
    probe = ("import ray, sys, time\n"
             f"ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False)\n"
             f"deadline = time.monotonic() + {START_TIMEOUT_S}\n"
             f"while sum(n['Alive'] for n in ray.nodes()) < {n}:\n"
             "    if time.monotonic() > deadline: sys.exit('nodes did not join')\n"
             "    time.sleep(0.5)\n")
    proc = subprocess.run([sys.executable, "-c", probe], env=env(), capture_output=True,
                          text=True, timeout=START_TIMEOUT_S + 60, check=False)
    dead = [p.args for p in procs if p.poll() is not None]
    if proc.returncode != 0 or dead:
        raise RuntimeError(f"Ray cluster did not start (dead: {dead}); {proc.stderr[-2000:]}\n"
                           f"node logs: {log.read_text()[-3000:] if log.exists() else ''}")


@contextlib.contextmanager
def two_node_cluster(head: dict, worker: dict) -> Iterator[Cluster]:
    """head / worker: {"num_cpus", "num_gpus", "resources"} of each node."""
    # Short: Ray's unix socket paths must stay under ~107 characters.
    temp_dir = tempfile.mkdtemp(prefix="dagrl-ray-", dir="/tmp")
    log = Path(temp_dir) / "nodes.log"
    port = free_port()
    address = f"127.0.0.1:{port}"
    cluster = Cluster(address, temp_dir)
    try:
        with open(log, "w") as out:
            cluster.procs.append(subprocess.Popen(
                [*_ray_cli(), "start", "--head", "--node-ip-address", "127.0.0.1",
                 "--port", str(port), "--ray-client-server-port", str(free_port()),
                 "--include-dashboard", "false", "--temp-dir", temp_dir,
                 *_node_args(head["num_cpus"], head["num_gpus"], head["resources"])],
                stdout=out, stderr=subprocess.STDOUT, env=env()))
            _wait_nodes(address, 1, cluster.procs, log)
            cluster.procs.append(subprocess.Popen(
                [*_ray_cli(), "start", "--address", address, "--node-ip-address", "127.0.0.1",
                 *_node_args(worker["num_cpus"], worker["num_gpus"], worker["resources"])],
                stdout=out, stderr=subprocess.STDOUT, env=env()))
            _wait_nodes(address, 2, cluster.procs, log)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)
