"""Several trained policies in one graph (config `models`, roles/multi_model.py):
examples/two_policies.yaml trains a solver and a refiner together."""

from __future__ import annotations

import json
import math
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


@pytest.mark.slow
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
    assert "run refiner_actor_update [actor_update @refiner]" in text
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
    (["trainer.n_workers=2", "models.refiner.actor.tensor_parallel_size=2"], ConfigError,
     r"models.refiner.actor: tensor_parallel_size x sequence_parallel_size \(2 x 1\) must be "
     r"the main policy's \(1 x 1\)"),
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


def _plan_roles(*overrides: str) -> list[tuple[str, str, tuple[str, ...]]]:
    cfg = load_cli_config([str(EXAMPLE), f"dag.graph={GRAPH}", *overrides])
    graph, order, _ = plan_for(cfg, 1)
    return [(graph.node(i).model, graph.node(i).role, graph.node(i).deps) for i in order]


def test_use_algorithm_gives_each_policy_its_algorithms_training_nodes():
    ppo = _plan_roles("algorithm.name=ppo")
    for model in ("", "refiner"):   # PPO: critic, KL in the reward (old and reference passes)
        roles = [role for m, role, _ in ppo if m == model]
        assert {"values", "critic_update", "kl_penalty", "old_logprob", "ref_logprob"} <= set(roles)
    # The refiner may run another algorithm than the main policy.
    mixed = _plan_roles("models.refiner.algorithm.name=ppo")
    assert [r for m, r, _ in mixed if m == ""].count("values") == 0
    assert [r for m, r, _ in mixed if m == "refiner"].count("values") == 1
    # DAPO: one filter, the main policy's; the refiner's nodes train on the groups it kept.
    dapo = _plan_roles("algorithm.name=dapo")
    assert [(m, r) for m, r, _ in dapo if r == "filter"] == [("", "filter")]
    ((_, _, deps),) = [n for n in dapo if n[:2] == ("refiner", "advantage")]
    assert "filter" in deps


@pytest.mark.parametrize("overrides, message", [
    (["models.refiner.algorithm.name=dapo"], "the main policy runs no filter"),
    (["algorithm.name=remax"], "greedy baseline is a second rollout"),
])
def test_use_algorithm_refuses_what_the_shared_batch_cannot_do(overrides, message):
    with pytest.raises(GraphError, match=message):
        _plan_roles(*overrides)


MULTI_TURN = ("rollout.multi_turn.enable=true", "rollout.multi_turn.format=tiny",
              "rollout.multi_turn.tools=[calculator]", "rollout.max_new_tokens=16",
              "rollout.multi_turn.max_turns=3", "rollout.multi_turn.max_tokens_per_turn=6",
              "data.max_prompt_length=12")


# PPO and DAPO through `use: algorithm`; both policies calling tools over several turns, where
# the refiner's prompts (the solver's whole episodes) are longer than data.max_prompt_length.
@pytest.mark.parametrize("overrides, signature", [
    (("algorithm.name=ppo",), "refiner/critic/vf_loss"),
    (("algorithm.name=dapo",), "filter/rounds"),
    (MULTI_TURN, "refiner/tools/calls_mean"),
], ids=["ppo", "dapo", "multi-turn"])
def test_two_policies_train_with_ppo_dapo_and_tools(tmp_path, overrides, signature):
    history = launch(config(tmp_path / "run", *overrides, "trainer.total_steps=2",
                            "data.train_batch_size=4", "actor.mini_batch_size=4"))
    assert len(history) == 2
    for step in history:
        for key in ("actor/pg_loss", "refiner/actor/pg_loss", signature):
            assert math.isfinite(step[key]), key
    if overrides == MULTI_TURN:   # longer than data.max_prompt_length
        assert max(s["refiner/prompt/length_mean"] for s in history) > 12
