"""Chaos in the composed recipes (issue 38): start a 2-worker run, kill one of its processes
(the launcher, a trainer or rollout rank, a reward-pool worker, a sandbox; the vLLM engine lives
in the rollout rank) with
SIGKILL at a random moment, run the same command again, and check that nothing was lost.

"Nothing lost" is checked three ways. Every step is in metrics.jsonl exactly once. Every step
trained on exactly its global batch's prompts, as recorded by a node the graph gains for the
purpose (`record_rows`, in the recipes on the GRPO graph). Where the run is deterministic (sync
recipes: the kill only replays steps from a checkpoint) its metrics equal those of the same
recipe run without a kill. And no process the killed run started outlives it.

One trial is `run_trial(seed, ...)`: the seed picks the recipe (unless given), the process, the
step after which it dies and the delay into that step. `tests/reliability/test_chaos.py` runs
DAGRL_CHAOS_KILLS trials (CI: a few; docs/reliability.md: 30, with their seeds).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import textwrap
import time
from pathlib import Path

from dagrl.observe.run_files import read_jsonl
from tests.reliability.helpers import ProcessTree, alive, dagrl_torchrun_cmd, env, worker_pids

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
COMPARED = ["reward/mean", "reward/std", "response/length/mean", "actor/pg_loss",
            "actor/grad_norm"]
FAST = ["logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1"]
SMALL = ["data.train_batch_size=8", "actor.mini_batch_size=8", "rollout.n=4",
         f"trainer.total_steps={STEPS}", "trainer.save_every=2"]

RECORDER = textwrap.dedent('''
    """Records which prompts (row indices) each rank holds in each step."""
    import json
    import os

    from dagrl import register_role


    @register_role("record_rows")
    def record_rows(ctx, batch):
        path = os.path.join(ctx.config.trainer.run_dir, f"rows-rank{ctx.rank}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps({"step": ctx.step,
                                "rows": sorted(set(batch["row_index"].tolist()))}) + "\\n")
        return batch
''')
GRAPH = textwrap.dedent("""
    name: grpo_recorded
    nodes:
      - {id: rollout, role: rollout}
      - {id: reward, use: reward, deps: [rollout]}
      - {id: record, role: record_rows, deps: [reward]}
      - {id: train, use: algorithm, deps: [record]}
""")


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    overrides: tuple[str, ...]
    targets: tuple[str, ...]     # the kinds of process a trial may kill
    deterministic: bool          # a resumed run's metrics equal an uninterrupted run's
    recorded: bool = True        # on the GRPO graph with the recording node
    vllm: bool = False           # needs the vLLM venv
    config: str | None = None    # an example's YAML the overrides refine


RANKS = ("launcher", "rank0", "rank1")
RECIPES = {r.name: r for r in [
    # Async agentic RL: the trainer on rank 0, rollout on rank 1 one version ahead; multi-turn
    # episodes whose tool runs the policy's text as Python in the sandbox; scorers in a pool.
    Recipe("async_tools", ("trainer.mode=async", "rollout.max_staleness=1",
                           "data.max_prompt_length=16", "rollout.max_new_tokens=24",
                           "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[python]",
                           "rollout.multi_turn.format=tiny", "rollout.multi_turn.max_turns=2",
                           "rollout.multi_turn.max_tokens_per_turn=12", "reward.num_workers=1"),
           (*RANKS, "reward_worker", "sandbox"), deterministic=False),
    # The same on vLLM. Its engine runs inside the rollout rank (VLLM_ENABLE_V1_MULTIPROCESSING
    # =0, rollout/vllm.py): killing the engine is killing rank 1.
    Recipe("async_tools_vllm", ("trainer.mode=async", "rollout.max_staleness=1",
                                "rollout.backend=vllm", "data.max_prompt_length=16",
                                "rollout.max_new_tokens=24", "rollout.multi_turn.enable=true",
                                "rollout.multi_turn.tools=[python]",
                                "rollout.multi_turn.format=tiny",
                                "rollout.multi_turn.max_turns=2",
                                "rollout.multi_turn.max_tokens_per_turn=12"),
           (*RANKS, "sandbox"), deterministic=False, vllm=True),   # the engine: in rank 1
    # Tensor parallelism over both ranks, scorers in a pool.
    Recipe("tp2", ("actor.tensor_parallel_size=2", "model.tiny_hidden_size=128",
                   "model.tiny_heads=4", "reward.num_workers=1"),
           (*RANKS, "reward_worker"), deterministic=True),
    # LoRA adapters on the data-parallel actor.
    Recipe("lora", ("actor.lora.rank=4", "actor.lr=1e-3"), RANKS, deterministic=True),
    # Two policies (examples/two_policies.yaml): the solver drafts, the refiner answers.
    Recipe("two_policies", (), RANKS, deterministic=True, recorded=False,
           config=str(ROOT / "examples" / "two_policies.yaml")),
]}


@dataclasses.dataclass
class Trial:
    """What one trial did and found (a row of docs/reliability.md's table)."""
    seed: int
    recipe: str
    target: str
    kill_after_step: int
    delay_s: float
    killed: str = ""             # "pid 123 (rank1)", or why nothing was
    first_exit: int | None = None
    resumed_from: str = ""       # the step the second launch resumed from ("" if not needed)
    seconds: float = 0.0
    problems: list[str] = dataclasses.field(default_factory=list)

    def row(self) -> dict:
        return dataclasses.asdict(self)


def plan_trial(seed: int, recipes: list[Recipe]) -> Trial:
    rng = random.Random(seed)
    recipe = rng.choice(recipes)
    return Trial(seed, recipe.name, rng.choice(recipe.targets),
                 kill_after_step=rng.randint(1, STEPS - 2),
                 delay_s=round(rng.uniform(0, 0.5), 2))   # a tiny step takes ~0.3-1 s


def command(recipe: Recipe, run_dir: Path, work: Path) -> list[str]:
    args = [recipe.config] if recipe.config else []
    extra = []
    if recipe.recorded:
        (work / "record.py").write_text(RECORDER)
        (work / "graph.yaml").write_text(GRAPH)
        extra = [f"dag.modules=[{work / 'record.py'}]", f"dag.graph={work / 'graph.yaml'}"]
    return dagrl_torchrun_cmd(*args, f"trainer.run_dir={run_dir}", *FAST, *SMALL,
                              *recipe.overrides, *extra)


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [r["step"] for r in read_jsonl(path).records] if path.is_file() else []


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def classify(pid: int, run_dir: Path, root: int) -> str | None:
    """The kind of a process of the run: the launcher, rank0/1 (their pid files), a reward
    pool worker or a sandbox (children of a rank, by command line)."""
    if pid == root:
        return "launcher"
    ranks = worker_pids(run_dir, 2) or []
    if pid in ranks:
        return f"rank{ranks.index(pid)}"
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return None
    if "sandbox_child" in cmdline:
        return "sandbox"
    if "multiprocessing" in cmdline and "spawn_main" in cmdline:
        return "reward_worker"
    return None


def find_victim(tree: ProcessTree, run_dir: Path, root: int, kind: str,
                timeout_s: float) -> int | None:
    """A live process of `kind` (short-lived ones, sandboxes, are waited for)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in [root, *sorted(tree.seen)]:
            if alive(pid) and classify(pid, run_dir, root) == kind:
                return pid
        time.sleep(0.02)
    return None


def run_trial(trial: Trial, recipe: Recipe, work: Path, reference: list[dict] | None) -> Trial:
    """Run `trial` in `work`; its problems list what was lost (empty: nothing)."""
    began = time.monotonic()
    run_dir, victim, err = work / "run", None, ""
    cmd = command(recipe, run_dir, work)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(), start_new_session=True)
    tree = ProcessTree(proc.pid, poll_s=0.02)
    try:
        while proc.poll() is None and max(logged_steps(run_dir), default=0) < \
                trial.kill_after_step:
            time.sleep(0.05)
        time.sleep(trial.delay_s)
        victim = find_victim(tree, run_dir, proc.pid, trial.target, timeout_s=20)
        if victim is None:
            trial.killed = f"no {trial.target} process alive (the run was at step " \
                           f"{max(logged_steps(run_dir), default=0)})"
        else:
            os.kill(victim, signal.SIGKILL)
            trial.killed = f"pid {victim} ({trial.target}) after step " \
                           f"{max(logged_steps(run_dir), default=0)}"
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            trial.problems.append("the killed run did not end within 300 s")
    trial.first_exit = proc.returncode
    if victim is None:   # a trial that killed nothing proves nothing
        trial.problems.append(f"nothing was killed; the run ended with {proc.returncode}: "
                              f"{err[-1500:]}")
    time.sleep(2.0)   # a worker notices its launcher's death within 0.1 s; sandboxes, 1 s
    seen = tree.stop()
    left = [p for p in seen if alive(p)]
    if left:
        trial.problems.append(f"processes left behind: {left}")
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    if proc.returncode != 0:
        again = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=600,
                               check=False)
        if again.returncode != 0:
            trial.problems.append(f"the second launch failed: {again.stderr[-1500:]}")
        resumed = re.search(r"resumed from \S+ \(step (\d+)", again.stdout)
        trial.resumed_from = f"step {resumed.group(1)}" if resumed else "the start"
    check_nothing_lost(trial, recipe, run_dir, reference)
    trial.seconds = round(time.monotonic() - began, 1)
    return trial


def check_nothing_lost(trial: Trial, recipe: Recipe, run_dir: Path,
                       reference: list[dict] | None) -> None:
    steps = logged_steps(run_dir)
    if steps != list(range(1, STEPS + 1)):
        trial.problems.append(f"metrics.jsonl steps {steps}")
        return
    if recipe.recorded and trained_rows(run_dir) != expected_rows(run_dir):
        trial.problems.append("the prompts trained per step differ from the data order")
    if recipe.deterministic and reference is not None:
        for ours, ref in zip(metrics(run_dir), reference, strict=True):
            for key in COMPARED:
                a, b = ours[key], ref[key]
                if abs(a - b) > 1e-4 * max(abs(b), 1e-2):
                    trial.problems.append(f"step {ours['step']} {key}: {a} != {b} "
                                          "(uninterrupted)")


def trained_rows(run_dir: Path) -> dict[int, list[int]]:
    """Each step's prompts, over the ranks that recorded a part of the batch (a step run again
    after a resume replaces the rank's earlier record)."""
    per_rank: dict[str, dict[int, list[int]]] = {}
    for path in run_dir.glob("rows-rank*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            per_rank.setdefault(path.name, {})[rec["step"]] = rec["rows"]
    steps = sorted({s for rows in per_rank.values() for s in rows})
    return {s: sorted({r for rows in per_rank.values() for r in rows.get(s, [])})
            for s in steps}


def expected_rows(run_dir: Path) -> dict[int, list[int]]:
    """Each step's global batch in the data order (seed 0), read from the run's own data."""
    from dagrl.config.presets import load_run_config
    from dagrl.data.dataset import PromptLoader
    from dagrl.data.parquet import ParquetPrompts
    from dagrl.engines.models import build_char_tokenizer

    cfg = load_run_config(str(run_dir / "config.resolved.yaml"), [])
    source = ParquetPrompts(list(cfg.data.train_files))
    loader = PromptLoader(source, build_char_tokenizer(), batch_size=cfg.data.train_batch_size,
                          seed=cfg.trainer.seed, max_prompt_length=cfg.data.max_prompt_length)
    return {s: sorted(loader.next_batch()["row_index"].tolist()) for s in range(1, STEPS + 1)}


def reference_run(recipe: Recipe, work: Path) -> list[dict]:
    """The recipe run without a kill."""
    run_dir = work / "run"
    proc = subprocess.run(command(recipe, run_dir, work), capture_output=True, text=True,
                          env=env(), timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics(run_dir)
