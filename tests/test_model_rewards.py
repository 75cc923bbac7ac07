"""Rewards from models: a sequence-classification reward model and a generative judge
(dagrl/engines/reward_model.py, dagrl/engines/judge.py, roles/model_reward.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from dagrl.config.loader import ConfigError
from dagrl.config.model_rewards import JudgeConfig
from dagrl.config.schema import Config
from dagrl.data.dataset import encode_prompt
from dagrl.engines.judge import Judge
from dagrl.engines.models import (
    build_char_tokenizer,
    load_model,
    load_tokenizer,
    tiny_model_config,
    write_tiny_model,
)
from dagrl.engines.reward_model import (
    RewardModelEngine,
    RewardModelError,
    load_reward_model,
    render_pair,
)
from dagrl.engines.tiny_reward_model import digit_share, train_tiny_digit_rm
from dagrl.rollout import model_rollout
from dagrl.runtime.launch import launch
from dagrl.train import load_cli_config

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "reward_model.yaml"
FAST = ["logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1"]

PAIRS = [([{"role": "user", "content": "3+4="}], "7"),
         ([{"role": "user", "content": "12+19="}], "31abc"),
         ([{"role": "user", "content": "0+0="}], ""),
         ([{"role": "user", "content": "20+20="}], "forty 40 40"),
         ([{"role": "user", "content": "5+5="}], "1"),
         ([{"role": "user", "content": "7+8="}], "x=15 or 16")]


def write_reward_model(out: Path, num_labels: int = 1, seed: int = 0) -> Path:
    tokenizer = build_char_tokenizer()
    config = tiny_model_config("tiny-qwen2", len(tokenizer), 64, 2)
    config.num_labels = num_labels
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_reward_model_scores_equal_a_direct_forward_of_each_sample(tmp_path):
    path = write_reward_model(tmp_path / "rm")
    model = load_reward_model(str(path), "float32", torch.device("cpu"))
    tokenizer = load_tokenizer(str(path))
    # Micro-batches of 4: the second holds 2 samples, every batch is right-padded.
    engine = RewardModelEngine(model, tokenizer, micro_batch_size=4, max_length=64,
                               device=torch.device("cpu"))
    scores = engine.score([p for p, _ in PAIRS], [r for _, r in PAIRS])
    direct = AutoModelForSequenceClassification.from_pretrained(path).eval()
    for i, (prompt, response) in enumerate(PAIRS):
        ids = tokenizer(render_pair(tokenizer, prompt, response),
                        add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            expected = float(direct(input_ids=ids).logits[0, 0])
        assert scores[i].item() == pytest.approx(expected, abs=1e-5), i
    assert len(set(scores.tolist())) == len(PAIRS)   # the inputs really differ


def test_reward_model_keeps_the_last_max_length_tokens(tmp_path):
    path = write_reward_model(tmp_path / "rm")
    tokenizer = load_tokenizer(str(path))
    engine = RewardModelEngine(load_reward_model(str(path), "float32", torch.device("cpu")),
                               tokenizer, micro_batch_size=8, max_length=5,
                               device=torch.device("cpu"))
    ids = engine.encode([PAIRS[1][0]], [PAIRS[1][1]])[0]
    assert tokenizer.decode(ids) == "31abc"[-5:]


def test_a_reward_model_with_two_labels_is_refused(tmp_path):
    path = write_reward_model(tmp_path / "rm2", num_labels=2)
    with pytest.raises(RewardModelError, match="2 labels"):
        load_reward_model(str(path), "float32", torch.device("cpu"))


@pytest.mark.slow
def test_the_tiny_digit_reward_model_learns_its_target():
    model, tokenizer, error = train_tiny_digit_rm(steps=300)
    assert error < 0.05
    engine = RewardModelEngine(model.eval(), tokenizer, micro_batch_size=8, max_length=64,
                               device=torch.device("cpu"))
    prompts = [[{"role": "user", "content": "4+9="}]] * 3
    scores = engine.score(prompts, ["abcd", "1b3d", "1234"])
    assert [digit_share(r) for r in ("abcd", "1b3d", "1234")] == [0.0, 0.5, 1.0]
    assert scores[0] < scores[1] < scores[2], scores


@pytest.mark.slow
def test_the_reward_model_example_learns_from_the_reward_models_scores(tmp_path):
    """examples/reward_model.yaml: the policy's reward (the RM's score) rises."""
    cfg: Config = load_cli_config([str(EXAMPLE), f"trainer.run_dir={tmp_path / 'run'}", *FAST,
                                   "trainer.total_steps=20"])
    assert cfg.reward.source == "reward_model"
    history = launch(cfg)
    rewards = [step["reward/mean"] for step in history]
    assert len(rewards) == 20 and all(math.isfinite(r) for r in rewards)
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.2, rewards


# --- the judge ---------------------------------------------------------------------------

def make_judge(tmp_path, **overrides) -> tuple[Judge, Path]:
    path = write_tiny_model(tmp_path / "judge", seed=3)
    tokenizer = load_tokenizer(str(path))
    engine = model_rollout("hf", load_model(str(path)).eval(),
                           eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)
    cfg = JudgeConfig(path=str(path), backend="hf", template="{prompt}{response}",
                      score_pattern=r"(\d)", score_scale=9.0, max_new_tokens=4, **overrides)
    return Judge(cfg, engine, tokenizer), path


def test_judge_answers_are_hf_greedy_generations_and_their_scores_are_parsed(tmp_path):
    judge, path = make_judge(tmp_path, micro_batch_size=4)
    prompts = [p for p, _ in PAIRS] * 2
    responses = [r for _, r in PAIRS] + ["a", "b", "c", "dd", "e1", "zz"]
    result = judge.grade(prompts, responses, [None] * len(prompts),
                         torch.zeros(len(prompts), dtype=torch.long))
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = load_tokenizer(str(path))
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        ids = torch.tensor([encode_prompt(tokenizer, prompt[0]["content"] + response)])
        out = model.generate(ids, do_sample=False, max_new_tokens=4,
                             eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert result.outputs[i] == answer, i
        digits = [c for c in answer if c.isdigit()]
        expected = int(digits[0]) / 9.0 if digits else 0.0
        assert result.scores[i] == pytest.approx(expected), i
        assert result.parsed[i] == bool(digits)
    # This seed's judge answers some samples with a digit and others without.
    assert 0 < result.n_unparseable < len(prompts), result.outputs
    assert result.n_unparseable == result.parsed.count(False)


def test_a_run_scored_by_a_judge_counts_unparseable_answers_and_goes_on(tmp_path):
    judge_dir = write_tiny_model(tmp_path / "judge", seed=3)
    history = launch(load_cli_config([
        f"trainer.run_dir={tmp_path / 'run'}", *FAST, "trainer.total_steps=2",
        "reward.source=judge", f"judge.path={judge_dir}", "judge.backend=hf",
        "judge.template=q {prompt} a {response}", r"judge.score_pattern=(\d)",
        "judge.max_new_tokens=4", "judge.score_scale=9"]))
    assert len(history) == 2
    unparseable = sum(step["judge/unparseable"] for step in history)
    parsed = sum(step["judge/parsed_fraction"] for step in history) / 2
    assert unparseable > 0 and parsed > 0, (unparseable, parsed)
    assert all(math.isfinite(step["reward/mean"]) for step in history)


@pytest.mark.parametrize("overrides, message", [
    (["reward.source=reward_model"], "reward_model.path"),
    (["reward.source=judge"], "judge.path"),
    (["reward.source=judge", "judge.path=x", "judge.score_pattern=\\d"], "exactly one group"),
    (["reward.source=judge", "judge.path=x", "judge.template={question}"], "template"),
    (["reward.source=reward_model", "reward_model.path=x", "reward.scorer=gsm8k_flexible"],
     "reward.source"),
    (["reward.source=judge", "judge.path=x", "algorithm.name=remax"], "remax"),
])
def test_bad_model_reward_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_cli_config(overrides)


def test_a_missing_reward_model_directory_is_named_before_the_run_starts(tmp_path):
    with pytest.raises(ConfigError, match="reward_model.path: .* is not a directory"):
        load_cli_config([f"trainer.run_dir={tmp_path / 'run'}", "reward.source=reward_model",
                         f"reward_model.path={tmp_path / 'nowhere'}"])
    assert not (tmp_path / "run").exists()


# The reward model sharded over 2+ workers (torchrun and Ray) scoring like one worker: the
# composition matrix's runs with reward=reward_model on several workers (docs/composition.md).
