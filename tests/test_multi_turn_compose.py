"""Multi-turn rollouts (tools, environments) composed with the other features (issue 34):
tensor and sequence parallelism on 2 workers reproduce the 1-worker run (the gapped masks and
turn_scores travel into the replicated layout, and Ulysses reads the attention mask); a reward
model or a judge scores whole episodes; two policies each run their own tool episodes
(examples/agents_with_tools.yaml)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dagrl.config.loader import with_defaults
from dagrl.data.batch import Batch, response_attention
from dagrl.observe.metrics import StepMetrics
from dagrl.roles.multi_model import merge_view, mix_rewards, model_view
from dagrl.runtime.launch import launch
from dagrl.train import load_cli_config
from tests.test_model_parallel_runs import FAST, assert_same_run, config, metrics, torchrun
from tests.test_model_rewards import write_reward_model

ROOT = Path(__file__).resolve().parents[1]

STEPS = 3
# examples/tool_calc.yaml's agent, smaller: the calculator over up to 3 turns.
TOOLS = ["data.train_files=[builtin:tool-calc]", "data.max_prompt_length=12",
         "data.train_batch_size=8", "rollout.n=4", "actor.mini_batch_size=8",
         "rollout.max_new_tokens=32", "rollout.multi_turn.enable=true",
         "rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.format=tiny",
         "rollout.multi_turn.max_turns=3", "rollout.multi_turn.max_tokens_per_turn=12",
         f"trainer.total_steps={STEPS}"]
# The guess_number environment: its rewards land on turns (turn_scores), PPO's critic reads
# the gapped masks too.
ENVIRONMENT = ["data.train_files=[builtin:guess-number]", "data.max_prompt_length=40",
               "data.train_batch_size=8", "rollout.n=4", "actor.mini_batch_size=8",
               "algorithm.name=ppo", "rollout.max_new_tokens=40", "rollout.multi_turn.enable=true",
               "rollout.multi_turn.environment=guess_number", "rollout.multi_turn.max_turns=4",
               "rollout.multi_turn.max_tokens_per_turn=4", f"trainer.total_steps={STEPS}"]
AGENT = ["multi_turn/turns_mean", "multi_turn/observation_tokens_mean"]


def test_multi_turn_composes_in_the_config():
    base = ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]"]
    env = ["rollout.multi_turn.enable=true", "rollout.multi_turn.environment=guess_number"]
    rm = ["reward.source=reward_model", "reward_model.path=builtin:tiny-digit-rm"]
    for overrides in ([*base, "actor.tensor_parallel_size=2", "trainer.n_workers=2"],
                      [*base, "actor.sequence_parallel_size=2", "trainer.n_workers=2"],
                      [*base, "reward.source=judge", "judge.path=builtin:tiny-qwen2"],
                      [*base, *rm],
                      [*base, f"dag.graph={ROOT / 'examples' / 'agents_with_tools.graph.yaml'}",
                       "models.checker.actor.lr=0.1"],
                      # the environment's turn rewards and the model's episode score add
                      [*env, "reward.source=judge", "judge.path=builtin:tiny-qwen2"],
                      [*env, *rm]):
        load_cli_config(overrides)


# A dense reward, so that every step's groups have advantages and gradients (tool_calc pays
# the random policy almost nothing): the share of digits in the whole episode, tool results
# included.
DIGITS = """
def digits(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
"""


@pytest.fixture(scope="module")
def dense_tools(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "digits.py"
    path.write_text(DIGITS)
    return [*TOOLS, f"reward.custom_fn={path}:digits"]


@pytest.fixture(scope="module")
def one_worker_tools(tmp_path_factory, dense_tools):
    run_dir = tmp_path_factory.mktemp("one_tools") / "run"
    launch(config(run_dir, *dense_tools))
    return metrics(run_dir)


@pytest.mark.composition   # 2-worker runs: with the matrix (pytest -m composition)
@pytest.mark.parametrize("layout", ["actor.tensor_parallel_size=2",
                                    "actor.sequence_parallel_size=2"], ids=["tp2", "sp2"])
def test_tool_episodes_under_model_parallelism_match_one_worker(tmp_path, one_worker_tools,
                                                                dense_tools, layout):
    assert len(one_worker_tools) == STEPS
    for step in one_worker_tools:   # tool tokens in the episodes, gradients every step
        assert step["tools/calls_mean"] > 0 and step["actor/grad_norm"] > 0
    torchrun(tmp_path / "run", *dense_tools, layout)
    assert_same_run(metrics(tmp_path / "run"), one_worker_tools,
                    extra=[*AGENT, "tools/calls_mean"])


@pytest.mark.composition   # 2-worker runs: with the matrix (pytest -m composition)
def test_environment_episodes_with_ppo_under_sequence_parallelism_match_one_worker(tmp_path):
    one = tmp_path / "one"
    launch(config(one, *ENVIRONMENT))
    torchrun(tmp_path / "sp", *ENVIRONMENT, "actor.sequence_parallel_size=2")
    critic = ["critic/values", "critic/vf_loss", "critic/grad_norm"]
    assert_same_run(metrics(tmp_path / "sp"), metrics(one), extra=[*AGENT, *critic])


# --- model rewards ------------------------------------------------------------------------

def reward_step(tmp_path, *overrides, base=TOOLS):
    """One worker's first step up to the reward node: (worker, batch)."""
    from dagrl.runtime.run_dir import prepare_run
    from dagrl.runtime.worker import Worker

    cfg = prepare_run(config(tmp_path / "run", *base, *overrides))
    worker = Worker(cfg)
    tasks = worker.plan.tasks
    upto = next(i for i, t in enumerate(tasks) if t.node_id == "reward") + 1
    batch = worker.run_tasks(tasks[:upto], worker.source.next_batch(1, StepMetrics()), 1,
                             StepMetrics())
    return worker, batch


def test_a_reward_model_scores_whole_episodes_tool_results_included(tmp_path):
    from dagrl.roles.score import decode_responses

    rm = write_reward_model(tmp_path / "rm")   # random weights: any score is the model's
    worker, batch = reward_step(tmp_path, "reward.source=reward_model",
                                f"reward_model.path={rm}")
    tokenizer = worker.engines.tokenizer
    episodes = decode_responses(tokenizer, batch["responses"], batch["response_attention_mask"])
    policy_only = decode_responses(tokenizer, batch["responses"], batch["response_mask"])
    # The tool's answers are in the text the reward model reads, not only the policy's tokens.
    assert sum(e != p for e, p in zip(episodes, policy_only, strict=True)) > 0
    expected = worker.engines.reward_model.score(batch["prompt"], episodes)
    assert batch["scores"].tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    assert batch["rm_scores"].tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    # ... on the policy's last token (the gaps' tool tokens get none)
    last = (batch["response_mask"] * torch.arange(1, batch["response_mask"].shape[1] + 1)
            ).amax(-1).long() - 1
    rows = torch.arange(len(batch))
    assert batch["token_level_scores"][rows, last].tolist() == pytest.approx(expected.tolist())


def test_an_environments_turn_rewards_add_to_a_reward_models_episode_score(tmp_path):
    rm = write_reward_model(tmp_path / "rm")
    metrics = StepMetrics()
    worker, batch = reward_step(tmp_path, "reward.source=reward_model", f"reward_model.path={rm}",
                                base=ENVIRONMENT)
    turns = batch["turn_scores"]
    assert (turns != 0).any()                     # the environment rewarded some turns
    mask = batch["response_mask"]
    last = (mask * torch.arange(1, mask.shape[1] + 1)).amax(-1).long() - 1
    rows = torch.arange(len(batch))
    # the model's score on the episode's last policy token, the turn rewards where they were
    model_part = batch["token_level_scores"] - turns
    assert model_part[rows, last].tolist() == pytest.approx(batch["rm_scores"].tolist(), abs=1e-6)
    model_part[rows, last] = 0
    assert (model_part == 0).all()
    assert batch["scores"].tolist() == pytest.approx(
        (batch["rm_scores"] + turns.sum(-1)).tolist(), abs=1e-6)
    # each part visible on its own: reward/environment beside the total
    from dagrl.roles.score import place_outcome_scores

    ctx = SimpleNamespace(metrics=metrics, config=worker.cfg)
    place_outcome_scores(ctx, batch, batch["rm_scores"].clone())
    got = metrics.reduce()
    assert got["reward/environment/mean"] == pytest.approx(float(turns.sum(-1).mean()))
    assert got["reward/mean"] == pytest.approx(float(batch["scores"].mean()), abs=1e-6)


@pytest.mark.composition   # 2-worker runs: with the matrix (pytest -m composition)
@pytest.mark.parametrize("source", ["reward_model", "judge"])
def test_model_rewards_of_tool_episodes_on_two_workers(tmp_path, source):
    from dagrl.engines.models import write_tiny_model

    if source == "reward_model":
        scoring = ["reward.source=reward_model",
                   f"reward_model.path={write_reward_model(tmp_path / 'rm')}"]
    else:
        judge_dir = write_tiny_model(tmp_path / "judge", seed=3)
        scoring = ["reward.source=judge", f"judge.path={judge_dir}", "judge.backend=hf",
                   "judge.template=q {prompt} a {response}", r"judge.score_pattern=(\d)",
                   "judge.max_new_tokens=4", "judge.score_scale=9"]
    torchrun(tmp_path / "run", *with_defaults(TOOLS, ["trainer.total_steps=2", *scoring]))
    history = metrics(tmp_path / "run")
    assert len(history) == 2
    for step in history:
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "tools/calls_mean"):
            assert math.isfinite(step[key]), (step["step"], key)
        assert step["tools/calls_mean"] > 0 and step["batch/samples"] == 32
    if source == "judge":   # the judge answered, and some answers held a grade
        assert sum(s["judge/parsed_fraction"] for s in history) > 0
    else:                   # a model's scores: they differ between samples
        assert any(s["reward/std"] > 0 for s in history)


# --- two policies, each with its own tool episodes ------------------------------------------

AGENTS = ROOT / "examples" / "agents_with_tools.yaml"
SMALL = ["data.train_batch_size=8", "actor.mini_batch_size=8",
         f"dag.graph={ROOT / 'examples' / 'agents_with_tools.graph.yaml'}"]


def test_a_policys_view_carries_its_own_multi_turn_fields():
    # the agent re-renders the prompt (new width) and adds the attention mask: under the prefix
    batch = Batch({"prompt_ids": torch.zeros(2, 3, dtype=torch.long),
                   "checker/prompt_ids": torch.ones(2, 5, dtype=torch.long)},
                  {"uid": ["a", "a"], "checker/prompt": [[], []]})
    view = model_view(batch, "checker")
    assert view["prompt_ids"].shape == (2, 5)
    view["prompt_ids"] = torch.full((2, 8), 7)
    view["response_mask"] = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    view["response_attention_mask"] = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    merged = merge_view(batch, view, "checker", "checker_rollout")
    assert merged["checker/prompt_ids"].tolist() == [[7] * 8] * 2
    assert merged["prompt_ids"].shape == (2, 3)            # the main policy's own, untouched
    assert "response_attention_mask" not in merged         # the main policy has none
    again = model_view(merged, "checker")
    assert response_attention(again).tolist() == view["response_attention_mask"].tolist()


def test_a_mixed_reward_sits_on_the_policys_last_token_of_a_gapped_response():
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    batch = Batch({"scores": torch.tensor([1.0, 0.0]), "checker/scores": torch.tensor([0.0, 1.0]),
                   "response_mask": mask}, {"uid": ["a", "a"]})
    ctx = SimpleNamespace(node=SimpleNamespace(id="mix", model="", options={"from": "checker"}),
                          model_engines={"checker": None}, metrics=StepMetrics())
    out = mix_rewards(ctx, batch)
    assert out["token_level_scores"].tolist() == [[0, 0, 0, 0, 0.5, 0], [0.5, 0, 0, 0, 0, 0]]


def test_two_agents_each_run_their_own_tool_episodes_and_both_update(tmp_path):
    history = launch(load_cli_config([str(AGENTS), f"trainer.run_dir={tmp_path / 'run'}",
                                      *FAST, *SMALL, "trainer.total_steps=2"]))
    assert len(history) == 2
    for prefix in ("", "checker/"):
        assert sum(s[f"{prefix}tools/calls_mean"] for s in history) > 0, prefix
        for step in history:
            assert step[f"{prefix}actor/optimizer_steps"] == 1, (prefix, step["step"])
            for key in ("reward/mean", "actor/pg_loss", "multi_turn/turns_mean"):
                assert math.isfinite(step[prefix + key]), (prefix, key)
        assert any(s[f"{prefix}actor/grad_norm"] > 0 for s in history), prefix
    # two agents, two sets of weights and episodes: their numbers differ
    assert any(s["actor/grad_norm"] != s["checker/actor/grad_norm"] for s in history)


def test_each_agent_is_credited_with_its_own_turns(tmp_path):
    """One step in process: each policy's episodes, masks and rewards are its own fields; the
    checker's prompt is the problem and the solver's whole episode."""
    from dagrl.roles.score import decode_responses
    from dagrl.runtime.run_dir import prepare_run
    from dagrl.runtime.worker import Worker

    cfg = prepare_run(load_cli_config([str(AGENTS), f"trainer.run_dir={tmp_path / 'run'}",
                                       *FAST, *SMALL, "trainer.total_steps=1"]))
    worker = Worker(cfg)
    batch = worker.run_tasks(worker.plan.tasks, worker.source.next_batch(1, StepMetrics()), 1,
                             StepMetrics())
    solver_text = decode_responses(worker.engines.tokenizer, batch["responses"],
                                   batch["response_attention_mask"])
    for i, prompt in enumerate(batch["checker/prompt"]):
        assert prompt[0]["content"] == batch["prompt"][i][-1]["content"] + solver_text[i] + "?"
    for prefix in ("", "checker/"):
        mask, attention = batch[prefix + "response_mask"], batch[prefix + "response_attention_mask"]
        assert (attention >= mask).all() and batch[prefix + "token_level_scores"].shape == \
            mask.shape
    # the solver's prompts are the dataset's (data.max_prompt_length wide), the checker's the
    # solver's episodes: as wide as the longest of them, not cut or bounded by the dataset's limit
    assert batch["prompt_ids"].shape[1] == cfg.data.max_prompt_length
    assert batch["checker/prompt_mask"].sum(-1).max() == batch["checker/prompt_ids"].shape[1]
    # the checker's episodes are not the solver's, and each policy took its own update
    assert not torch.equal(batch["responses"], batch["checker/responses"])
    assert worker.engines.actor.version == worker.model_engines["checker"].actor.version == 1
