"""docs/extending.md, followed to the letter: its files are copied out of the page into a fresh
directory, named by the page's own config keys (relative paths, as its commands give them), and
trained with for a step or two on the built-in tiny model, each run checking that the extension
did the work, not only that the run finished:

- a policy loss, an advantage estimator, a DAG role in a YAML graph and a reward scorer, all
  from `dag.modules`, in one run;
- a tool (`file.py:function`) with a reward function (`reward.custom_fn`) in a multi-turn run;
- an environment (`file.py:Class`) in a multi-turn run;
- a rollout backend (a class registered from `dag.modules`), which must draw the same samples as
  the backend it chunks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import pytest

from dagrl.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from dagrl.envs import ENVIRONMENTS
from dagrl.rewards.scorers import SCORERS
from dagrl.roles.registry import ROLES
from dagrl.rollout import ROLLOUT_BACKENDS
from dagrl.runtime.launch import launch
from dagrl.tools import TOOLS
from dagrl.train import load_cli_config

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "extending.md").read_text()
FAST = ["logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1"]
AGENT_BATCH = ["trainer.total_steps=1", "data.train_batch_size=8", "actor.mini_batch_size=8",
               "rollout.n=4"]
# A fenced block whose first line names its file: ```python\n# my_loss.py\n...```
_FILE_BLOCK = re.compile(r"```(?:python|yaml)\n# ([\w.]+\.(?:py|yaml))\n(.*?)```", re.DOTALL)


def page_files() -> dict[str, str]:
    """File name -> contents, for every file the page writes out."""
    return dict(_FILE_BLOCK.findall(PAGE))


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The page's files in a fresh current directory. Registries are process-wide: each gets a
    copy for the test, so the names the page registers are gone afterwards (other tests list
    the built-in names)."""
    for registry in (POLICY_LOSSES, ADVANTAGE_ESTIMATORS, ROLES, SCORERS, TOOLS, ENVIRONMENTS,
                     ROLLOUT_BACKENDS):
        monkeypatch.setattr(registry, "_items", dict(registry._items))
    for name, text in page_files().items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def train(run_dir: Path, *args: str, small: Sequence[str] = ()) -> list[dict]:
    """`dagrl train ARGS` in this process: the CLI's config loading (which imports dag.modules
    and checks the names they register), then the launch; the metrics of every step. Each of
    ARGS is on the page (`dag.modules` may join the page's modules in one list); `small` sizes
    the run for a test."""
    for arg in args:
        if arg.startswith("dag.modules="):
            assert set(arg.removeprefix("dag.modules=").strip("[]").split(",")) <= set(
                page_files()), arg
        else:
            assert arg.removeprefix(str(ROOT) + "/") in PAGE, f"not on docs/extending.md: {arg}"
    return launch(load_cli_config([*args, f"trainer.run_dir={run_dir}", *FAST, *small]))


def test_the_page_writes_the_files_these_runs_use():
    assert {"length_penalty.yaml", "my_advantage.py", "my_backend.py", "my_env.py", "my_loss.py",
            "my_reward.py", "my_roles.py", "my_scorers.py", "my_tools.py"} <= set(page_files())


def test_loss_estimator_role_and_scorer_from_user_modules(user_dir: Path):
    history = train(user_dir / "run",
                    "dag.modules=[my_loss.py,my_advantage.py,my_roles.py,my_scorers.py]",
                    "dag.graph=length_penalty.yaml", "algorithm.policy_loss=tis_reinforce",
                    "algorithm.adv_estimator=above_worst", "reward.scorer=digit_share",
                    small=["trainer.total_steps=2"])
    assert len(history) == 2
    for m in history:
        # the scorer: its extra key is logged; scores are shares of digits, or 1
        assert 0.0 <= m["reward/exact"] <= 1.0 and 0.0 <= m["reward/min"] <= m["reward/max"] <= 1
        # the role: each response token cost 0.01 (the graph's option)
        assert m["length_penalty/mean"] == pytest.approx(0.01 * m["response/length/mean"])
        # the estimator: A_i = r_i - min_g r >= 0 everywhere, so mean = |mean| > 0 (GRPO's
        # advantages have mean ~0)
        assert m["advantage/mean"] > 0
        assert m["advantage/mean"] == pytest.approx(m["advantage/abs_mean"])
        # the loss: its stats; one update per batch, so pi = pi_old and w = 1, and
        # l = -A log pi >= 0 (PPO's clipped loss would be -A < 0 here)
        assert m["actor/is_weight"] == pytest.approx(1.0, abs=1e-4)
        assert m["actor/truncated_frac"] == 0.0
        assert m["actor/pg_loss"] > 0


def test_tool_and_reward_function_by_path(user_dir: Path):
    history = train(user_dir / "run", str(ROOT / "examples" / "tool_calc.yaml"),
                    "rollout.multi_turn.tools=[my_tools.py:multiply]",
                    "reward.custom_fn=my_reward.py:compute_score", small=AGENT_BATCH)
    m = history[0]
    # the random policy ends turns with `=`: calls of the page's tool, by its name ...
    assert m["tools/calls/multiply"] > 0
    # ... some of them well formed but not `a*b`: the tool's own ToolError
    assert m["tools/errors"] > m["tools/format_errors"]
    # the reward function: its extra key, and a 0/1 score
    assert 0.0 <= m["reward/answered"] <= 1.0 and m["reward/max"] <= 1.0
    assert math.isfinite(m["actor/pg_loss"])


def test_environment_by_path(user_dir: Path):
    history = train(user_dir / "run", "data.train_files=[builtin:guess-number]",
                    "rollout.multi_turn.enable=true",
                    "rollout.multi_turn.environment=my_env.py:CountUp",
                    "rollout.multi_turn.max_turns=4", "rollout.multi_turn.max_tokens_per_turn=4",
                    "data.max_prompt_length=40", "rollout.max_new_tokens=40", small=AGENT_BATCH)
    m = history[0]
    assert m["multi_turn/turns_mean"] >= 1
    # the environment's own rewards: -0.25 ends an episode at its first wrong number (no
    # built-in scores -0.25), +1 per right one
    assert m["reward/min"] == pytest.approx(-0.25)
    assert m["reward/max"] <= 4.0


def test_rollout_backend_from_a_user_module(user_dir: Path):
    small = ["trainer.total_steps=1", "rollout.max_new_tokens=8"]
    chunked = train(user_dir / "chunked", "dag.modules=[my_backend.py]",
                    "rollout.backend=chunked_hf", small=small)
    assert "chunked_hf" in ROLLOUT_BACKENDS
    # Each sample draws with its own seed, so a few rows at a time are hf's samples exactly.
    whole = launch(load_cli_config(["rollout.backend=hf", f"trainer.run_dir={user_dir / 'hf'}",
                                    *FAST, *small]))
    for key in ("reward/mean", "response/length/mean", "actor/pg_loss", "actor/grad_norm"):
        assert chunked[0][key] == pytest.approx(whole[0][key], rel=1e-6), key
