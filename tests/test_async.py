"""trainer.mode=async, its parts one by one: placement of the graph on two sides, the async
buffer and the weight channel over real process groups (2 and 3 CPU processes, gloo), and
partial rollout with a real model."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from dagrl.config.loader import ConfigError, load_config
from dagrl.config.schema import Config
from dagrl.dag.async_placement import place_async
from dagrl.dag.spec import GraphError, GraphSpec, NodeSpec
from dagrl.data.batch import Batch
from dagrl.roles.plan import plan_with_sides, roles_on_side
from tests.dist_helpers import run_distributed

GRPO = GraphSpec("g", (NodeSpec("rollout", "rollout"), NodeSpec("reward", "reward", ("rollout",)),
                       NodeSpec("ref", "ref_logprob", ("rollout",)),
                       NodeSpec("adv", "advantage", ("reward", "ref")),
                       NodeSpec("update", "actor_update", ("adv",))))
ORDER = ["rollout", "ref", "reward", "adv", "update"]   # reward after a trainer-side node
# The sides the built-in roles declare (Role.side)
ROLLOUT_SIDE_ROLES, FOLLOWER_ROLES = roles_on_side("rollout"), roles_on_side("follower")


def test_the_next_steps_prompts_come_once_weights_are_fresh_enough_and_move_no_data(
        tmp_path, tokenizer):
    from types import SimpleNamespace

    from dagrl.data.dataset import PromptLoader
    from dagrl.data.makers import make_arith
    from dagrl.data.parquet import ParquetPrompts
    from dagrl.runtime.streams import FreshWeightsPromptSource

    files = make_arith(tmp_path, seed=0)
    loader = PromptLoader(ParquetPrompts([str(files["train"])]), tokenizer, batch_size=4,
                          max_prompt_length=32)
    source = FreshWeightsPromptSource(loader, torch.device("cpu"), [], source_rank=0,
                                      dtype=torch.float32, last_version=4, max_staleness=1,
                                      group=None)
    engine = SimpleNamespace(version=1, arrived=[])   # a receiver: versions loaded on poll

    def poll_all():
        loaded = bool(engine.arrived)
        if loaded:
            engine.version = engine.arrived.pop()
        return loaded

    engine.poll_all = poll_all
    source.receivers = [engine]
    position = loader.state_dict()
    # Step 3 is generated with version >= 1; step 4 needs version >= 2, not here yet.
    assert source.next_prompts(3) is None
    engine.arrived.append(2)
    ahead = source.next_prompts(3)
    assert ahead is not None and source.loads_mid_request == 1
    assert loader.state_dict() == position   # the step reads them again, as a resume would
    assert ahead["row_index"].tolist() == loader.next_batch()["row_index"].tolist()
    assert source.next_prompts(5) is None    # the run's last step is 5: nothing after it


def test_placement_defaults_half_and_half_and_puts_the_rollout_side_first():
    graph, order, sides = place_async(GRPO, ORDER, 4, ROLLOUT_SIDE_ROLES)
    assert sides.trainer_ranks == (0, 1) and sides.rollout_ranks == (2, 3)
    assert order == ["rollout", "reward", "ref", "adv", "update"]
    assert graph.node("reward").options["ranks"] == [2, 3]
    assert graph.node("update").options["ranks"] == [0, 1]
    _, _, three = place_async(GRPO, ORDER, 3, ROLLOUT_SIDE_ROLES)
    assert three.trainer_ranks == (0, 1) and three.rollout_ranks == (2,)


def test_placement_follows_options_ranks_and_refuses_what_cannot_loop():
    nodes = list(GRPO.nodes)
    nodes[0] = NodeSpec("rollout", "rollout", options={"ranks": [0]})
    _, _, sides = place_async(GraphSpec("g", tuple(nodes)), ORDER, 2, ROLLOUT_SIDE_ROLES)
    assert sides.rollout_ranks == (0,) and sides.trainer_ranks == (1,)
    split = nodes + [NodeSpec("x", "reward", ("rollout",), {"ranks": [1]})]
    with pytest.raises(GraphError, match="node 'x'.*rollout side's ranks"):
        place_async(GraphSpec("g", tuple(split)), ORDER + ["x"], 2, ROLLOUT_SIDE_ROLES)
    late = GraphSpec("g", GRPO.nodes + (NodeSpec("r2", "reward", ("adv",)),))
    with pytest.raises(GraphError, match="'r2'.*depends on trainer-side"):
        place_async(late, ORDER + ["r2"], 2, ROLLOUT_SIDE_ROLES)
    # A role that declares it cannot run async is refused, naming the node and the reason.
    with pytest.raises(GraphError, match="'adv'.*advantage.*not supported.*a reason"):
        place_async(GRPO, ORDER, 2, ROLLOUT_SIDE_ROLES, refusals={"advantage": "a reason"})
    # DAPO's filter reads no trained weights: it follows the reward to the rollout side, where
    # its more() can read fresh prompts.
    dapo = GraphSpec("g", GRPO.nodes + (NodeSpec("f", "filter", ("reward",)),))
    _, _, sides = place_async(dapo, ORDER + ["f"], 2, ROLLOUT_SIDE_ROLES, FOLLOWER_ROLES)
    assert "f" in sides.rollout_nodes


def test_the_frozen_reference_follows_its_inputs_to_the_rollout_side():
    graph, order, sides = place_async(GRPO, ORDER, 2, ROLLOUT_SIDE_ROLES, FOLLOWER_ROLES)
    assert sides.rollout_nodes == ("rollout", "ref", "reward")
    assert sides.trainer_nodes == ("adv", "update") and order[-2:] == ["adv", "update"]
    assert graph.node("ref").options["ranks"] == [1]
    # Its input made on the trainer side, or pinned to the trainer's ranks: it stays there.
    late = GraphSpec("g", GRPO.nodes[:2] + (NodeSpec("ref", "ref_logprob", ("adv",)),
                                            NodeSpec("adv", "advantage", ("reward",)),
                                            NodeSpec("update", "actor_update", ("adv", "ref"))))
    _, _, sides = place_async(late, ["rollout", "reward", "adv", "ref", "update"], 2,
                              ROLLOUT_SIDE_ROLES, FOLLOWER_ROLES)
    assert sides.trainer_nodes == ("adv", "ref", "update")
    nodes = list(GRPO.nodes)
    nodes[2] = NodeSpec("ref", "ref_logprob", ("rollout",), {"ranks": [0]})
    _, _, sides = place_async(GraphSpec("g", tuple(nodes)), ORDER, 2, ROLLOUT_SIDE_ROLES,
                              FOLLOWER_ROLES)
    assert sides.trainer_nodes == ("ref", "adv", "update")


def test_async_config_is_checked_and_planned():
    with pytest.raises(ConfigError, match="n_workers >= 2"):
        load_config(Config, None, ["trainer.mode=async"])
    with pytest.raises(ConfigError, match="rollout.partial needs trainer.mode=async"):
        load_config(Config, None, ["rollout.partial=true"])
    with pytest.raises(ConfigError, match="max_staleness"):
        load_config(Config, None, ["rollout.max_staleness=-1"])
    with pytest.raises(ConfigError, match="async_trainer_threads needs trainer.mode=async"):
        load_config(Config, None, ["trainer.async_trainer_threads=2"])
    cfg = load_config(Config, None, ["trainer.mode=async", "trainer.n_workers=2"])
    _, _, plans, sides = plan_with_sides(cfg, 2)
    assert sides.rollout_nodes == ("rollout", "reward", "ref_logprob")
    described = [t.describe() for t in plans[0].tasks]
    first_trainer_node = sides.trainer_nodes[0]
    buffer = f"reshard ranks 1 -> ranks 0 (before {first_trainer_node})"   # the buffer
    assert any(d.startswith(buffer) for d in described), described   # "; <= N samples x ..."
    # Scoring models, validation and the profiler run on their side.
    base = ["trainer.mode=async", "trainer.n_workers=2"]
    load_config(Config, None, [*base, "reward.source=judge", "judge.path=/x",
                               "data.val_files=[builtin:arith]", "trainer.val_every=2",
                               "profiler.enable=true"])


def test_async_tensor_parallelism_is_planned_on_the_trainer_side():
    """tp x sp under async: the training layout's replicas are made of the trainer ranks only
    (the buffer delivers sharded batches there, then one replicate); the rollout side's
    reference runs sharded (it has no training mesh)."""
    base = ["trainer.mode=async", "actor.sequence_parallel_size=2"]
    cfg = load_config(Config, None, [*base, "trainer.n_workers=4"])
    _, _, plans, sides = plan_with_sides(cfg, 4)
    assert sides.trainer_ranks == (0, 1) and "ref_logprob" in sides.rollout_nodes
    trainer = [t for t in plans[0].tasks if t.node_id in sides.trainer_nodes]
    replicate = next(t for t in trainer if t.kind == "replicate")
    assert (replicate.src, replicate.dst, replicate.group) == ((0, 1), (0, 1), 2)
    update = next(t for t in trainer if t.kind == "node" and t.role == "actor_update")
    assert update.group == 2 and trainer.index(replicate) < trainer.index(update)
    rollout = [t for t in plans[2].tasks if t.node_id in sides.rollout_nodes]
    assert rollout and all(t.group == 1 and t.dst == (2, 3) for t in rollout)
    assert not any(t.kind in ("replicate", "unreplicate") for t in plans[2].tasks)
    # A trainer side that does not split into tp x sp groups is refused before any work.
    cfg = load_config(Config, None, [*base, "trainer.n_workers=2"])
    with pytest.raises(GraphError, match=r"must divide the async trainer side's 1 rank\(s\)"):
        plan_with_sides(cfg, 2)


def test_a_second_policy_is_placed_on_both_sides_in_async_mode():
    """examples/two_policies: the refiner generates and is scored on the rollout side (the
    handoff and the reward mix follow their inputs there), and trains on the trainer side."""
    cfg = load_config(Config, None, [
        "trainer.mode=async", "trainer.n_workers=2",
        "dag.graph=examples/two_policies.graph.yaml",
        "models.refiner.model.path=builtin:tiny-llama", "algorithm.kl_loss_coef=0"])
    _, _, _, sides = plan_with_sides(cfg, 2)
    assert {"handoff", "refiner_rollout", "refiner_reward", "team_reward"} <= set(
        sides.rollout_nodes)
    assert "refiner_actor_update" in sides.trainer_nodes, sides.trainer_nodes


# --- the buffer and the weights over real process groups ---------------------------------------
def _fake_batch(step: int, rank: int, rng: random.Random) -> Batch:
    sizes = [rng.randint(1, 4) for _ in range(rng.randint(0, 5))]
    uids = [f"s{step}-r{rank}-g{g}" for g, n in enumerate(sizes) for _ in range(n)]
    n = len(uids)
    return Batch({"response_mask": torch.ones(n, rng.randint(1, 6)),
                  "value": torch.arange(n, dtype=torch.float64) + 1000 * step},
                 {"uid": uids}, batch_size=n)


def _weights(version: int) -> list[tuple[str, torch.Tensor]]:
    return [("a", torch.full((3, 4), float(version))), ("b", torch.arange(10.0) + version),
            ("c", torch.full((5,), -float(version)))]


class _Engine:
    """Records what the weight receiver loads into it."""

    def __init__(self):
        self.loaded = {}
        self.weights_version = 0

    def update_weights(self, named, version):
        self.loaded[version] = {name: t.clone() for name, t in named}
        self.weights_version = version


def _protocol(rank, world, steps, staleness):
    from dagrl.data.async_buffer import GroupReceiver, GroupSender
    from dagrl.engines.weight_channel import WeightReceiver, WeightSender

    trainers = (0,) if world == 2 else (0, 1)
    rollouts = tuple(r for r in range(world) if r not in trainers)
    bucket = 48   # bytes: the three tensors go in several buckets
    if rank in rollouts:
        engine = _Engine()
        receiver = WeightReceiver(engine, trainers[0], dtype=torch.float32,
                                  last_version=steps - 1, bucket_bytes=bucket)
        receiver.wait_for(0)
        sender = GroupSender(trainers)
        rng = random.Random(rank)
        pushed, versions = [], []
        for step in range(1, steps + 1):
            receiver.poll_all()
            if receiver.version < step - 1 - staleness:
                receiver.wait_for(step - 1 - staleness)
            versions.append(receiver.version)
            batch = _fake_batch(step, rank, rng)
            pushed.append(list(batch["uid"]))
            sender.push(batch, step, {"from": rank, "step": step})
        sender.flush()
        while receiver.expecting:
            receiver.wait_for(receiver.version + 1)
        ok = all(torch.equal(engine.loaded[v][n], t) for v in engine.loaded
                 for n, t in _weights(v))
        return {"pushed": pushed, "versions": versions, "loaded": sorted(engine.loaded), "ok": ok}
    sender = WeightSender(rollouts, is_source=rank == trainers[0], dtype=torch.float32,
                          last_version=steps - 1, bucket_bytes=bucket)
    sender.send_first(iter(_weights(0)), 0)
    receiver = GroupReceiver(rollouts)
    got = []
    for step in range(1, steps + 1):
        batch, metas = receiver.pull(step)
        got.append((list(batch["uid"]), batch["value"].tolist(), metas))
        sender.update_weights(iter(_weights(step)), version=12345)   # the version is counted
    sender.flush()
    return {"got": got}


@pytest.mark.parametrize("world,staleness", [(2, 1), pytest.param(3, 0, marks=pytest.mark.slow)])
def test_buffer_delivers_every_group_once_and_weights_arrive_in_order(world, staleness):
    steps = 5
    results = run_distributed(_protocol, world, steps, staleness)
    trainers = (0,) if world == 2 else (0, 1)
    rollouts = [r for r in range(world) if r not in trainers]
    for r in rollouts:
        res = results[r]
        assert res["ok"] and res["loaded"] == list(range(steps))   # every version, exact
        # the staleness bound held at every step
        assert all(step - 1 - v <= staleness for step, v in enumerate(res["versions"], 1))
    for step in range(steps):
        received = [u for t in trainers for u in results[t]["got"][step][0]]
        pushed = [u for r in rollouts for u in results[r]["pushed"][step]]
        assert sorted(received) == sorted(pushed)           # every sample, exactly once
        for t in trainers:                                   # groups stay whole, on one rank
            uids, values, metas = results[t]["got"][step]
            assert all(uids.count(g) == pushed.count(g) for g in set(uids))
            assert all(v >= 1000 * (step + 1) for v in values)
            expected = [{"from": r, "step": step + 1} for r in rollouts] if t == 0 else \
                [{} for _ in rollouts]
            assert metas == expected                         # metadata counted once


# --- partial rollout with a real model -----------------------------------------------------------
def _teacher_forced(model, prompt_ids, prompt_mask, out):
    from dagrl.engines.forward import batch_logprobs

    batch = Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                   "responses": out.responses, "response_mask": out.response_mask},
                  batch_size=len(prompt_ids))
    with torch.no_grad():
        return batch_logprobs(model, batch, micro_batch_size=64, temperature=1.0)


def test_partial_rollout_continues_with_new_weights_and_records_versions(tiny_model, tokenizer):
    from dagrl.rollout.native import NativeRollout
    from dagrl.rollout.sampling import SamplingParams
    from dagrl.rollout.versioned import VersionedRollout

    torch.manual_seed(0)
    other = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine = NativeRollout(copy.deepcopy(tiny_model), eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)
    prompts = [[1, 6, 40, 7, 43], [1, 9, 41, 4, 43], [1, 5, 43]]
    width = 6
    ids = torch.full((6, width), tokenizer.pad_token_id)
    mask = torch.zeros(6, width, dtype=torch.long)
    for i, p in enumerate(prompts * 2):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    seeds = torch.arange(6) * 7919 + 11
    params = SamplingParams(temperature=1.0)
    whole = engine.generate(ids, mask, seeds, params, max_new_tokens=12, min_new_tokens=12)

    swaps = []

    def between_chunks():   # new weights arrive at the first pause
        if not swaps:
            engine.update_weights(other.named_parameters(), 1)
            swaps.append(1)

    partial = VersionedRollout(engine, chunk_tokens=4, between_chunks=between_chunks)
    out = partial.generate(ids, mask, seeds, params, max_new_tokens=12, min_new_tokens=12)
    versions = partial.last_token_versions
    assert swaps and versions[:, :4].eq(0).all() and versions[:, 4:].eq(1).all()
    # the first chunk is the unchunked generation's, token for token
    assert torch.equal(out.responses[:, :4], whole.responses[:, :4])
    assert not torch.equal(out.responses, whole.responses)
    # each token's log-prob is the one of the weights that drew it
    old = _teacher_forced(tiny_model, ids, mask, out)
    new = _teacher_forced(other, ids, mask, out)
    expected = torch.where(versions == 0, old, new)
    assert torch.allclose(out.logprobs, expected, atol=2e-4)
    assert not torch.allclose(old[:, 4:], new[:, 4:], atol=1e-2)   # the swap mattered

    # Stops end a row early; without pauses the chunks continue one response.
    plain = VersionedRollout(engine, chunk_tokens=5, between_chunks=lambda: None)
    engine.update_weights(tiny_model.named_parameters(), 2)
    short = plain.generate(ids, mask, seeds, params, max_new_tokens=12)
    lengths = short.response_mask.sum(-1)
    assert plain.last_token_versions[short.response_mask.bool()].eq(2).all()
    assert (plain.last_token_versions[~short.response_mask.bool()] == -1).all()
    ended = torch.isin(short.responses, torch.tensor(engine.stop_token_ids)) & \
        short.response_mask.bool()
    assert (ended.sum(-1) <= 1).all() and ((lengths == 12) | (ended.sum(-1) == 1)).all()
