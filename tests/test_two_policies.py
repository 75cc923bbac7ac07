"""Several trained policies in one graph (config `models`, roles/multi_model.py):
examples/two_policies.yaml trains a solver and a refiner together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dagrl.config.loader import ConfigError
from dagrl.dag.draw import to_dot, to_svg
from dagrl.dag.planner import format_plan
from dagrl.dag.spec import GraphError
from dagrl.data.batch import Batch
from dagrl.roles.generate import index_within_group
from dagrl.roles.multi_model import merge_view, model_view
from dagrl.roles.plan import plan_for
from dagrl.runtime.launch import launch
from dagrl.train import load_cli_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "two_policies.yaml"
GRAPH = ROOT / "examples" / "two_policies.graph.yaml"
FAST = ["logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1",
        f"dag.graph={GRAPH}"]
COMPARED = ("reward/mean", "refiner/reward/mean", "reward_mixed/mean", "actor/pg_loss",
            "refiner/actor/pg_loss", "actor/grad_norm", "refiner/actor/grad_norm",
            "refiner/response/length/mean")


def config(run_dir: Path, *overrides: str):
    return load_cli_config([str(EXAMPLE), f"trainer.run_dir={run_dir}", *FAST, *overrides])


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_both_policies_learn_and_each_logs_its_own_loss(tmp_path):
    history = launch(config(tmp_path / "run", "trainer.total_steps=40"))
    assert len(history) == 40
    for prefix in ("", "refiner/"):
        assert all(f"{prefix}actor/pg_loss" in step for step in history), prefix
        rewards = [step[f"{prefix}reward/mean"] for step in history]
        assert sum(rewards[-10:]) / 10 >= sum(rewards[:10]) / 10 + 0.1, (prefix, rewards)
    # Two models, two sets of weights: their losses and gradients differ.
    assert any(s["actor/grad_norm"] != s["refiner/actor/grad_norm"] for s in history)


def test_both_checkpoints_resume_exactly(tmp_path):
    uninterrupted = launch(config(tmp_path / "whole", "trainer.total_steps=4"))
    run_dir = tmp_path / "resumed"
    launch(config(run_dir, "trainer.total_steps=2", "trainer.save_every=2"))
    (checkpoint,) = (run_dir / "checkpoints").glob("step_*")
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert set(state["versions"]) == {"actor", "refiner:actor"}, state
    launch(config(run_dir, "trainer.total_steps=4", "trainer.save_every=2"))
    resumed = metrics(run_dir)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for ours, ref in zip(resumed[2:], uninterrupted[2:], strict=True):
        for key in COMPARED:
            assert ours[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-9), (ours["step"], key)


def test_plan_shows_each_models_nodes_and_the_data_between_them():
    cfg = load_cli_config([str(EXAMPLE), f"dag.graph={GRAPH}", "trainer.n_workers=2"])
    graph, order, plans = plan_for(cfg, 2)
    text = format_plan(graph, order, plans)
    assert "run refiner_update [actor_update @refiner]" in text
    assert "run actor_update [actor_update]" in text
    svg = to_svg(graph, order, plans)
    # handoff -> refiner_rollout and refiner_reward -> team_reward cross between the models.
    assert svg.count('class="cross-model"') == 2
    assert "model refiner" in svg and "model main policy" in svg
    assert to_dot(graph, order, plans).count("data between models") == 2


def test_a_model_view_shows_shared_and_own_fields_and_merges_back():
    batch = Batch({"responses": torch.zeros(2, 3), "refiner/responses": torch.ones(2, 4),
                   "refiner/old": torch.ones(2)},
                  {"uid": ["a", "a"], "data_source": ["arith", "arith"]})
    view = model_view(batch, "refiner")
    assert sorted(view.keys()) == ["data_source", "old", "responses", "uid"]
    assert view["responses"].shape == (2, 4)          # the refiner's, not the main policy's
    view["scores"] = torch.tensor([1.0, 2.0])
    merged = merge_view(batch, view.drop_keys(["old"]), "refiner", "n")
    assert merged["refiner/scores"].tolist() == [1.0, 2.0]
    assert "refiner/old" not in merged and merged["responses"].shape == (2, 3)
    with pytest.raises(GraphError, match="keep the batch's rows"):
        merge_view(batch, view.select([0]), "refiner", "n")


def test_the_extra_models_samples_get_their_own_seeds_per_group():
    assert index_within_group(["a", "a", "a", "b", "b", "c"]).tolist() == [0, 1, 2, 0, 1, 0]


@pytest.mark.parametrize("overrides, error, message", [
    (["models.refiner.rollout.n=2"], ConfigError, "models.refiner.rollout.n must equal"),
    (["models.refiner.trainer.seed=1"], ConfigError, "cannot be set per model"),
    (["models.Refiner.actor.lr=0.1"], ConfigError, "lowercase"),
])
def test_bad_multi_model_configs_are_refused_naming_the_key(overrides, error, message):
    with pytest.raises(error, match=message):
        cfg = load_cli_config([str(EXAMPLE), f"dag.graph={GRAPH}", *overrides])
        plan_for(cfg, 1)


@pytest.mark.parametrize("replacement, message", [
    ("{id: refiner_rollout, role: rollout, model: refiner, deps: [handoff], "
     "options: {ranks: [1]}}", "not supported yet"),
    ("{id: refiner_rollout, role: rollout, model: critic2, deps: [handoff]}",
     "'critic2', which the config's `models` does not define"),
])
def test_bad_model_placement_in_a_graph_is_refused_naming_the_node(tmp_path, replacement,
                                                                   message):
    graph = tmp_path / "g.yaml"
    original = "{id: refiner_rollout, role: rollout, model: refiner, deps: [handoff]}"
    assert original in GRAPH.read_text()
    graph.write_text(GRAPH.read_text().replace(original, replacement))
    cfg = load_cli_config([str(EXAMPLE), f"dag.graph={graph}", "trainer.n_workers=2"])
    with pytest.raises(GraphError, match=message):
        plan_for(cfg, 2)
