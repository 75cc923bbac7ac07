"""Graph validation, YAML graphs, user roles and the planner."""

from __future__ import annotations

import textwrap

import pytest

from dagrl.config.loader import from_dict
from dagrl.config.schema import Config
from dagrl.dag.builtin import BUILTIN_GRAPHS
from dagrl.dag.planner import format_plan, make_plan
from dagrl.dag.spec import (
    GraphError,
    GraphSpec,
    NodeSpec,
    graph_from_dict,
    load_graph_yaml,
    validate_graph,
)
from dagrl.roles.plan import load_builtin_roles
from dagrl.roles.registry import ROLES, import_user_modules
from dagrl.rollout import rollout_backend

ROLES_ = load_builtin_roles()


def grpo_graph(cfg: Config) -> GraphSpec:
    """The built-in GRPO graph, with the configured rollout backend's capabilities."""
    return BUILTIN_GRAPHS.get("grpo")(cfg, rollout_backend(cfg))


def write(tmp_path, text, name="g.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_grpo_graph_order_and_plan():
    graph = grpo_graph(from_dict(Config, {"actor": {"skip_on_policy_old_logprob": False}}))
    order = validate_graph(graph, ROLES_)
    assert order == ["rollout", "reward", "old_logprob", "ref_logprob", "advantage", "actor_update"]
    plans = make_plan(graph, order, world_size=1)
    assert [t.node_id for t in plans[0].tasks] == order
    assert all(t.kind == "node" for t in plans[0].tasks)


def test_old_logprob_pass_only_when_pi_old_differs_from_pi():
    on_policy = Config()   # one optimizer step per batch: the graph skips the old_logprob pass
    assert "old_logprob" not in grpo_graph(on_policy).roles
    off_policy = from_dict(Config, {"actor": {"mini_batch_size": 16}})
    assert "old_logprob" in grpo_graph(off_policy).roles
    assert "old_logprob" in grpo_graph(from_dict(Config, {"actor": {"ppo_epochs": 2}})).roles
    kl_in_reward = from_dict(Config, {"algorithm": {"kl_in_reward": True}})
    assert "old_logprob" in grpo_graph(kl_in_reward).roles
    kept = from_dict(Config, {"actor": {"skip_on_policy_old_logprob": False}})
    assert "old_logprob" in grpo_graph(kept).roles


def test_grpo_without_kl_has_no_reference():
    cfg = Config()
    cfg.algorithm.kl_loss_coef = 0.0
    assert "ref_logprob" not in grpo_graph(cfg).roles


def test_yaml_cycle_names_the_nodes(tmp_path):
    path = write(tmp_path, """
        name: loop
        nodes:
          - {id: gen, role: rollout, deps: [upd]}
          - {id: score, role: reward, deps: [gen]}
          - {id: upd, role: actor_update, deps: [score]}
          - {id: other, role: advantage}
    """)
    with pytest.raises(GraphError) as err:
        validate_graph(load_graph_yaml(path), ROLES_)
    msg = str(err.value)
    assert "cycle" in msg
    for node in ("gen", "score", "upd"):
        assert node in msg
    assert "other" not in msg   # not on the cycle


def test_yaml_unknown_dependency(tmp_path):
    path = write(tmp_path, """
        nodes:
          - {id: gen, role: rollout}
          - {id: score, role: reward, deps: [gen, judge]}
    """)
    with pytest.raises(GraphError, match=r"node 'score' depends on unknown node\(s\) \['judge'\]"):
        validate_graph(load_graph_yaml(path), ROLES_)


def test_yaml_unknown_role_suggests(tmp_path):
    path = write(tmp_path, """
        nodes:
          - {id: gen, role: rolout}
    """)
    with pytest.raises(GraphError) as err:
        validate_graph(load_graph_yaml(path), ROLES_)
    assert "'gen'" in str(err.value) and "'rolout'" in str(err.value)
    assert "rollout" in str(err.value)


def test_duplicate_ids_and_bad_keys():
    graph = GraphSpec("g", (NodeSpec("a", "rollout"), NodeSpec("a", "reward")))
    with pytest.raises(GraphError, match=r"duplicate node id\(s\) \['a'\]"):
        validate_graph(graph, ROLES_)
    with pytest.raises(GraphError, match="node 'a' has unknown key"):
        graph_from_dict({"nodes": [{"id": "a", "role": "rollout", "dep": ["b"]}]})
    with pytest.raises(GraphError, match="no nodes"):
        validate_graph(GraphSpec("empty", ()), ROLES_)


def test_user_role_from_file(tmp_path):
    module = write(tmp_path, """
        from dagrl import register_role

        @register_role("test_noop_role")
        def noop(ctx, batch):
            return batch
    """, name="my_roles.py")
    import_user_modules([str(module)])
    assert "test_noop_role" in ROLES
    graph = graph_from_dict({"nodes": [{"id": "x", "role": "test_noop_role"}]})
    assert validate_graph(graph, ROLES) == ["x"]


def test_planner_reshards_around_subset_node():
    graph = graph_from_dict({"nodes": [
        {"id": "gen", "role": "rollout"},
        {"id": "rm", "role": "reward", "deps": ["gen"], "options": {"ranks": [0, 1]}},
        {"id": "adv", "role": "advantage", "deps": ["rm"]},
    ]})
    order = validate_graph(graph, ROLES_)
    plans = make_plan(graph, order, world_size=4)
    kinds = [(t.kind, t.node_id) for t in plans[0].tasks]
    assert kinds == [("node", "gen"), ("reshard", "rm"), ("node", "rm"), ("reshard", "adv"),
                     ("node", "adv")]
    # rank 3 does not host the reward model but takes part in both reshards
    assert [(t.kind, t.node_id) for t in plans[3].tasks] == [
        ("node", "gen"), ("reshard", "rm"), ("reshard", "adv"), ("node", "adv")]
    assert plans[0].tasks[1].src == (0, 1, 2, 3) and plans[0].tasks[1].dst == (0, 1)
    text = format_plan(graph, order, plans)
    assert "rank 3:" in text and "reshard ranks 0,1,2,3 -> ranks 0,1" in text


@pytest.mark.parametrize("role", ["ref_logprob", "old_logprob", "actor_update", "values",
                                  "critic_update", "reward_model"])
def test_a_sharded_models_node_on_a_rank_subset_is_refused(role):
    """Its weights are FSDP2-sharded over every worker: run on ranks 0 only, its forward would
    wait forever for rank 1's all-gather (it hung before this check)."""
    from dagrl.roles.plan import check_sharded_nodes_on_every_rank

    graph = graph_from_dict({"name": "g", "nodes": [
        {"id": "gen", "role": "rollout", "options": {"ranks": [0]}},   # a whole copy: fine
        {"id": "x", "role": role, "deps": ["gen"], "options": {"ranks": [0]}}]})
    with pytest.raises(GraphError, match=f"node 'x' has options.ranks \\[0\\], but its role "
                                         f"'{role}' runs the .* model, whose weights are sharded"):
        check_sharded_nodes_on_every_rank(graph, world_size=2)
    check_sharded_nodes_on_every_rank(graph, world_size=1)
    graph.node("x").options["ranks"] = [1, 0]        # every rank, in any order
    check_sharded_nodes_on_every_rank(graph, world_size=2)


def test_planner_rejects_bad_ranks():
    graph = graph_from_dict({"nodes": [{"id": "gen", "role": "rollout",
                                        "options": {"ranks": [5]}}]})
    with pytest.raises(GraphError, match="node 'gen': options.ranks"):
        make_plan(graph, ["gen"], world_size=2)


def _rollout_tp_plan(*overrides: str) -> list[tuple[str, str, int]]:
    from dagrl.roles.plan import plan_for
    from dagrl.train import load_cli_config

    cfg = load_cli_config(["rollout.backend=vllm", "actor.skip_on_policy_old_logprob=false",
                           *overrides])
    _, _, plans = plan_for(cfg, cfg.trainer.n_workers)
    assert len({tuple(p.tasks) for p in plans}) == 1   # every rank the same tasks
    return [(t.kind, t.node_id, t.group) for t in plans[1].tasks]


def test_rollout_tensor_parallelism_runs_the_rollout_nodes_on_replicas():
    """rollout.vllm.tensor_parallel_size=2 over 4 ranks: the prompts go into 2 replicas of 2
    ranks before the rollout (each engine's ranks issue the same requests), the reward runs
    there, and the training nodes take back each rank's half, moving nothing. With the
    actor's tensor parallelism of the same size the two layouts are one: no move at all."""
    assert _rollout_tp_plan("trainer.n_workers=4", "rollout.vllm.tensor_parallel_size=2") == [
        ("replicate", "rollout", 2), ("node", "rollout", 2), ("node", "reward", 2),
        ("unreplicate", "old_logprob", 2), ("node", "old_logprob", 1),
        ("node", "ref_logprob", 1), ("node", "advantage", 1), ("balance", "actor_update", 1),
        ("node", "actor_update", 1)]
    assert _rollout_tp_plan("trainer.n_workers=4", "rollout.vllm.tensor_parallel_size=2",
                            "actor.tensor_parallel_size=2") == [
        ("replicate", "rollout", 2), ("node", "rollout", 2), ("node", "reward", 2),
        ("node", "old_logprob", 2), ("node", "ref_logprob", 2), ("node", "advantage", 2),
        ("balance", "actor_update", 2), ("node", "actor_update", 2)]
    # different sizes: out of the rollout replicas, into the training ones
    kinds = _rollout_tp_plan("trainer.n_workers=4", "rollout.vllm.tensor_parallel_size=4",
                             "actor.tensor_parallel_size=2")
    assert kinds[:4] == [("replicate", "rollout", 4), ("node", "rollout", 4),
                         ("node", "reward", 4), ("unreplicate", "old_logprob", 4)]
    assert kinds[4] == ("replicate", "old_logprob", 2)
