from __future__ import annotations

import math
import random
import textwrap
import time

import pytest

from dagrl.registry import UnknownNameError
from dagrl.rewards import (
    SCORERS,
    RewardError,
    RewardManager,
    arith_score,
    gsm8k_score,
    last_boxed,
    load_function,
    math_score,
    normalize_math_answer,
)

# --------------------------------------------------------------------------- arith


@pytest.mark.parametrize(
    "resp, gt, expected",
    [
        ("19", "19", 1.0),
        (" 19\n", "19", 1.0),
        ("-4", "-4", 1.0),
        ("", "19", 0.0),  # no digits, length off by 2/2, no positions
        ("18", "19", 0.2 + 0.2 + 0.4 * 1 / 2),
        ("-5", "-4", 0.2 + 0.2 + 0.4 * 1 / 2),  # the leading '-' counts as a digit
        ("4", "-4", 0.2 + 0.2 * 0.5 + 0.0),
        ("1a", "19", 0.2 * 0.5 + 0.2 + 0.4 * 1 / 2),
        ("12345", "19", 0.2 + 0.0 + 0.4 * 1 / 2),  # length score clipped at 0
        ("a-1", "19", 0.2 * 1 / 3 + 0.2 * 0.5 + 0.0),  # '-' not leading: not a digit
        ("190", "19", 0.2 + 0.2 * 0.5 + 0.4),
    ],
)
def test_arith_partial_credit(resp, gt, expected):
    assert arith_score(resp, gt, None) == pytest.approx(expected)


def test_arith_wrong_answers_never_reach_exact_score():
    rng = random.Random(0)
    for _ in range(2000):
        gt = str(rng.randint(-50, 500))
        resp = "".join(rng.choice("0123456789- x") for _ in range(rng.randint(0, 5)))
        score = arith_score(resp, gt, None)
        if resp.strip() != gt:
            assert 0.0 <= score <= 0.8


# --------------------------------------------------------------------------- gsm8k


# verl's gsm8k.compute_score(method="strict"/"flexible", format_score=0) on the same cases.
@pytest.mark.parametrize(
    "resp, gt, strict, flexible",
    [
        ("so she has 42 apples.\n#### 42", "42", 1.0, 1.0),
        ("#### $1,234", "1234", 0.0, 0.0),      # "$" before the number: no strict match
        ("#### 1,234 dollars", "1234", 1.0, 0.0),   # flexible keeps the comma
        ("#### -3", "-3", 1.0, 1.0),
        ("#### 3", "-3", 0.0, 0.0),
        ("#### 42.00", "42", 0.0, 0.0),         # compared as strings, as verl does
        ("####42", "42", 0.0, 1.0),             # strict needs "#### "
        ("#### 42.", "42", 0.0, 0.0),           # the period is part of the number
        ("the answer is 42", "42", 0.0, 1.0),
        ("#### 41 wait #### 42", "42", 1.0, 1.0),   # the last one counts
        ("#### 42 wait #### 41", "42", 0.0, 0.0),
        ("#### 42, so 7 more", "42", 1.0, 0.0),
        ("#### ", "42", 0.0, 0.0),
        ("", "42", 0.0, 0.0),
        ("#### 42" + " pad" * 100, "42", 0.0, 0.0),   # only the last 300 characters are read
    ],
)
def test_gsm8k_strict_and_flexible_as_verl(resp, gt, strict, flexible):
    assert gsm8k_score(resp, gt, None) == strict
    assert SCORERS.get("gsm8k_flexible")(resp, gt, None) == flexible


@pytest.mark.parametrize(
    "resp, gt, score",
    [
        ("So the answer is 8.", "8", 1.0),       # verl's flexible extracts "8." -> 0
        ("#### 42.00", "42", 1.0),
        ("It costs $1,234.", "1234", 1.0),
        ("#### -3", "-3", 1.0),
        ("#### 3", "-3", 0.0),
        ("8 apples, then 9.", "8", 0.0),          # the last number counts
        ("no number here", "8", 0.0),
        ("version 1.2.3", "1", 0.0),             # not a number: no answer
        ("the answer is 42" + " pad" * 100, "42", 0.0),   # the last 300 characters only
    ],
)
def test_gsm8k_numeric_compares_the_last_number_by_value(resp, gt, score):
    assert SCORERS.get("gsm8k_numeric")(resp, gt, None) == score


def test_gsm8k_numeric_names_a_ground_truth_that_is_not_a_number():
    with pytest.raises(ValueError, match="gsm8k_numeric: ground truth 'x'"):
        SCORERS.get("gsm8k_numeric")("8", "x", None)


def test_reward_scorer_scores_every_sample_with_one_scorer():
    manager = RewardManager(scorer="gsm8k_flexible")
    result = manager.score(["it is 7", "#### 7"], ["arith", "openai/gsm8k"], ["7", "7"],
                           [None, None])
    assert result.scores == [1.0, 1.0]
    assert RewardManager().score(["it is 7"], ["openai/gsm8k"], ["7"], [None]).scores == [0.0]


def test_reward_scorer_config_is_checked():
    from dagrl.config.loader import ConfigError
    from dagrl.train import load_cli_config

    with pytest.raises(ConfigError, match="reward.scorer: .*gsm8k_flexible"):
        load_cli_config(["reward.scorer=gsm8k_flexibel"])
    with pytest.raises(ConfigError, match="reward.scorer and custom_fn"):
        load_cli_config(["reward.scorer=gsm8k", "reward.custom_fn=x.py:f"])


# --------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{\sqrt{\frac{a}{b^{2}}}}", r"\sqrt{\frac{a}{b^{2}}}"),
        (r"\boxed{1} then \boxed{2}", "2"),
        (r"\boxed{1} then \fbox{3}", "3"),
        (r"$\boxed 5$", "5"),
        (r"\boxed{1", None),  # braces never close
        ("no box here", None),
        (r"\boxed{}", ""),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "resp, gt, expected",
    [
        (r"answer \boxed{\dfrac{1}{2}}", r"\frac{1}{2}", 1.0),
        (r"$\boxed{ 90^\circ }$", "90", 1.0),
        (r"\boxed{90^{\circ}}", "90", 1.0),
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
        (r"\boxed{3.}", "3", 1.0),
        (r"\boxed{10\text{ cm}}", "10cm", 1.0),  # \text{} keeps its content
        (r"\boxed{10\text{ cm}}", "10", 0.0),  # units are not dropped
        (r"\boxed{0.5}", r"\frac{1}{2}", 0.0),  # no numeric equivalence
        (r"\boxed{-7}", "7", 0.0),
        (r"\boxed{3}", r"The area is $\boxed{3}$.", 1.0),  # boxed ground truth
        ("3", "3", 0.0),  # no box in the response
        (r"\boxed{\tfrac{\pi}{4}}", r"\frac{\pi}{4}", 1.0),
    ],
)
def test_math(resp, gt, expected):
    assert math_score(resp, gt, None) == expected


def test_math_normalization_leaves_longer_commands_alone():
    assert normalize_math_answer(r"\leftarrow \rightarrow") == r"\leftarrow\rightarrow"


def test_scorer_names():
    assert SCORERS.get("arith") is arith_score
    assert SCORERS.get("openai/gsm8k") is SCORERS.get("gsm8k") is gsm8k_score
    for name in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                 "HuggingFaceH4/MATH-500", "math"):
        assert SCORERS.get(name) is math_score


# --------------------------------------------------------------------------- user functions

USER_FILE = textwrap.dedent(
    """
    import numpy as np

    THRESHOLD = 3
    RETURNS = {
        "none": None, "str": "1.0", "nan": float("nan"), "inf": float("inf"),
        "bool": True, "nodict": {"acc": 1.0},
        "np32": np.float32(0.5), "np64": np.int64(2), "int": 1,
    }

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str.startswith("boom"):
            raise ZeroDivisionError("kaboom")
        if solution_str in RETURNS:
            return RETURNS[solution_str]
        if solution_str == "dict":
            return {"score": 0.25, "acc": True, "pred": "x", "len": len(data_source)}
        return float(solution_str == ground_truth) + (extra_info or {}).get("bonus", 0.0)
    """
)


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    return path


def test_load_function_from_file_absolute_and_relative(user_file, monkeypatch):
    fn = load_function(f"{user_file}:compute_score")
    assert fn("any", "7", "7", {"bonus": 0.5}) == 1.5
    monkeypatch.chdir(user_file.parent)
    assert load_function("my_reward.py:compute_score")("any", "7", "8") == 0.0


def test_load_function_from_module():
    assert load_function("dagrl.rewards.scorers:gsm8k_score") is gsm8k_score


def test_load_function_errors(user_file):
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_function("missing.py:compute_score")
    with pytest.raises(AttributeError, match=r"'score_fn'.*compute_score"):
        load_function(f"{user_file}:score_fn")
    with pytest.raises(TypeError, match="'THRESHOLD' is a int"):
        load_function(f"{user_file}:THRESHOLD")
    with pytest.raises(ValueError, match="'no_colon'"):
        load_function("no_colon")
    with pytest.raises(ModuleNotFoundError, match="no_such_pkg"):
        load_function("no_such_pkg.mod:fn")


# --------------------------------------------------------------------------- manager


def test_manager_dispatches_by_data_source():
    result = RewardManager().score(
        responses=["19", "18", "#### 42", r"\boxed{2}"],
        data_sources=["arith", "arith", "openai/gsm8k", "HuggingFaceH4/MATH-500"],
        ground_truths=["19", "19", "42", "3"],
        extra_infos=[None, {"split": "train"}, None, None],
    )
    assert result.scores == [1.0, pytest.approx(0.6), 1.0, 0.0]
    assert result.n_errors == 0 and result.first_error is None and result.extra == {}


def test_manager_custom_fn_scores_every_sample_and_collects_extras(user_file):
    manager = RewardManager(custom_fn=f"{user_file}:compute_score")
    result = manager.score(
        responses=["7", "dict", "np32", "np64", "int"],
        data_sources=["not/registered", "abcd", "x", "x", "x"],
        ground_truths=["7", "", "", "", ""],
        extra_infos=[{"bonus": 0.5}, None, None, None, None],
    )
    assert result.scores == [1.5, 0.25, 0.5, 2.0, 1.0]
    assert all(type(s) is float for s in result.scores)
    # Only numeric side values become metrics; NaN where a sample has none.
    assert set(result.extra) == {"acc", "len"}
    assert result.extra["len"][1] == 4.0 and result.extra["acc"][1] == 1.0
    assert all(math.isnan(result.extra["len"][i]) for i in (0, 2, 3, 4))


def test_manager_raise_names_the_sample(user_file):
    manager = RewardManager(custom_fn=f"{user_file}:compute_score")
    long_response = "boom" + "x" * 200
    with pytest.raises(RewardError) as info:
        manager.score(
            responses=["7", long_response],
            data_sources=["arith", "my/source"],
            ground_truths=["7", "7"],
            extra_infos=[None, None],
            sample_ids=["uid-0", "uid-1"],
        )
    message = str(info.value)
    assert "sample 1" in message and "'uid-1'" in message and "'my/source'" in message
    assert "compute_score" in message and "kaboom" in message
    assert repr(long_response[:80]) in message and long_response[:81] not in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize("bad", ["none", "str", "nan", "inf", "bool", "nodict"])
def test_manager_non_number_return_is_a_failure(user_file, bad):
    manager = RewardManager(custom_fn=f"{user_file}:compute_score")
    with pytest.raises(RewardError, match="sample 0"):
        manager.score([bad], ["x"], ["7"], [None])


def test_manager_count_mode(user_file):
    manager = RewardManager(on_error="count", error_score=-1.0,
                            custom_fn=f"{user_file}:compute_score")
    result = manager.score(
        responses=["7", "boom", "none", "dict"],
        data_sources=["x"] * 4,
        ground_truths=["7"] * 4,
        extra_infos=[None] * 4,
    )
    assert result.scores == [1.0, -1.0, -1.0, 0.25]
    assert result.n_errors == 2
    assert "sample 1" in result.first_error and "kaboom" in result.first_error
    assert math.isnan(result.extra["acc"][1])  # a failed sample reports no extras


def test_manager_builtin_scorer_failure_under_count():
    # An empty arith ground truth makes the scorer raise.
    result = RewardManager(on_error="count").score(["1", "2"], ["arith"] * 2, ["", "2"], [None] * 2)
    assert result.scores == [0.0, 1.0] and result.n_errors == 1
    assert "arith_score" in result.first_error


@pytest.mark.parametrize("on_error", ["raise", "count"])
def test_manager_unknown_data_source_lists_known(on_error):
    with pytest.raises(UnknownNameError) as info:
        RewardManager(on_error=on_error).score(["1", "2"], ["arith", "nope/ds"], ["1", "2"],
                                              [None, None])
    message = str(info.value)
    assert "'nope/ds'" in message and "sample 1" in message
    assert "arith" in message and "openai/gsm8k" in message and "lighteval/MATH" in message


def test_manager_argument_validation(user_file):
    with pytest.raises(ValueError, match=r"reward\.on_error.*'raise', 'count'.*'ignore'"):
        RewardManager(on_error="ignore")
    with pytest.raises(ValueError, match="error_score"):
        RewardManager(error_score=float("nan"))
    with pytest.raises(FileNotFoundError):
        RewardManager(custom_fn="nowhere.py:compute_score")
    with pytest.raises(ValueError, match="ground_truths"):
        RewardManager().score(["1", "2"], ["arith", "arith"], ["1"], [None, None])


# ------------------------------------------------- scorers in worker processes, timeouts

SLOW_FILE = textwrap.dedent(
    """
    import asyncio
    import os
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            while True:          # a scorer that never returns
                time.sleep(1)
        if solution_str == "boom":
            raise ValueError("kaboom")
        return {"score": float(solution_str == ground_truth), "pid": os.getpid()}

    async def async_score(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(0.01)
        if solution_str == "hang":
            await asyncio.sleep(3600)
        return float(solution_str == ground_truth)
    """
)


@pytest.fixture
def slow_file(tmp_path):
    path = tmp_path / "slow_reward.py"
    path.write_text(SLOW_FILE)
    return path


@pytest.mark.parametrize("fn", ["compute_score", "async_score"])
def test_a_hanging_scorer_is_cut_off_at_its_timeout_and_counted(slow_file, fn):
    # Generous timeout: the scorers that return take milliseconds, so only the hanging one can
    # reach it, even on a busy machine. on_error=raise: a timeout is counted all the same.
    manager = RewardManager(custom_fn=f"{slow_file}:{fn}", num_workers=2, timeout_s=5.0,
                            error_score=-1.0)
    try:
        result = manager.score(["7", "hang", "8", "7"], ["x"] * 4, ["7"] * 4, [None] * 4,
                               sample_ids=["a", "b", "c", "d"])
        assert result.scores == [1.0, -1.0, 0.0, 1.0]
        assert (result.n_timeouts, result.n_errors) == (1, 0)
        assert "timed out for sample 1 (id 'b')" in result.first_error
        assert "reward.timeout_s=5 s" in result.first_error
        # The pool goes on: its killed worker was replaced.
        again = manager.score(["7", "7"], ["x"] * 2, ["7"] * 2, [None] * 2)
        assert again.scores == [1.0, 1.0] and again.n_timeouts == 0
    finally:
        manager.pool.close()


def test_pooled_scorers_run_in_other_processes_and_keep_the_error_rules(slow_file):
    import os

    manager = RewardManager(custom_fn=f"{slow_file}:compute_score", num_workers=2)
    try:
        result = manager.score(["7", "8"], ["x"] * 2, ["7"] * 2, [None] * 2)
        assert result.scores == [1.0, 0.0]
        assert os.getpid() not in result.extra["pid"]
        with pytest.raises(RewardError, match="sample 1.*ValueError: kaboom"):
            manager.score(["7", "boom"], ["x"] * 2, ["7"] * 2, [None] * 2)
        # Built-in scorers by data_source, in the pool too.
        builtin = RewardManager(num_workers=1)
        assert builtin.score(["19"], ["arith"], ["19"], [None]).scores == [1.0]
        builtin.pool.close()
    finally:
        manager.pool.close()


KILLED_ONCE = textwrap.dedent(
    """
    import os
    import signal

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "die" and not os.path.exists(extra_info["marker"]):
            open(extra_info["marker"], "w").close()
            os.kill(os.getpid(), signal.SIGKILL)   # as the OOM killer would, mid-sample
        return {"score": float(solution_str == ground_truth), "pid": os.getpid()}
    """
)


def test_a_pool_worker_killed_mid_batch_or_while_idle_loses_no_sample(tmp_path):
    import os
    import signal

    path = tmp_path / "killed_once.py"
    path.write_text(KILLED_ONCE)
    manager = RewardManager(custom_fn=f"{path}:compute_score", num_workers=2)
    info = [{"marker": str(tmp_path / "died")}] * 4
    try:
        result = manager.score(["7", "die", "8", "7"], ["x"] * 4, ["7"] * 4, info)
        assert (tmp_path / "died").exists() and manager.pool.restarts == 1
        assert result.scores == [1.0, 0.0, 0.0, 1.0] and result.n_errors == 0
        worker = manager.score(["7"], ["x"], ["7"], info[:1]).extra["pid"][0]
        os.kill(int(worker), signal.SIGKILL)   # a worker of the new pool, waiting for work
        time.sleep(0.5)
        again = manager.score(["7", "8"], ["x"] * 2, ["7"] * 2, info[:2])
        assert again.scores == [1.0, 0.0] and manager.pool.restarts == 2
    finally:
        manager.pool.close()


def test_async_scorers_run_in_process_too(slow_file):
    manager = RewardManager(custom_fn=f"{slow_file}:async_score")
    assert manager.score(["7", "8"], ["x"] * 2, ["7"] * 2, [None] * 2).scores == [1.0, 0.0]


def test_a_timeout_needs_worker_processes():
    with pytest.raises(ValueError, match="timeout_s needs reward.num_workers"):
        RewardManager(timeout_s=1.0)


def test_tool_calc_scores_the_number_after_the_last_equals_sign():
    score = SCORERS.get("tool_calc")
    assert score("37*48+19=1795 ", "1795") == 1.0               # the calculator's answer
    assert score("37*48+19=1795 done", "1795") == 1.0
    assert score("1+1=2 37*48+19=1795 ", "1795") == 1.0         # the last call counts
    # partial credit: 0.1 for a number, 0.8 * (the ratio, at most 1) squared
    assert score("30*40+10=1210 ", "1795") == pytest.approx(0.1 + 0.8 * (1210 / 1795) ** 2)
    assert score("x=3590", "1795") == pytest.approx(0.1 + 0.8 * 0.25)
    assert score("37*48+19=1795 1=1 ", "1795") == pytest.approx(0.1 + 0.8 / 1795 ** 2)
    assert score("x=-5", "1795") == pytest.approx(0.1)
    for no_answer in ("1795", "37*48+19=", "=error: calculator: ...", ""):
        assert score(no_answer, "1795") == 0.0, no_answer


HANG_ONCE_FILE = textwrap.dedent(
    """
    import os
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        try:   # the first sample scored hangs, whichever worker takes it
            os.close(os.open(os.path.join(os.path.dirname(__file__), "hung"),
                             os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return 0.5
        while True:
            time.sleep(1)
    """
)


def test_a_training_step_goes_on_past_a_hanging_reward_and_counts_it(tmp_path):
    from dagrl.config.loader import load_config
    from dagrl.config.schema import Config
    from dagrl.runtime.launch import launch

    (tmp_path / "hang_once.py").write_text(HANG_ONCE_FILE)
    cfg = load_config(Config, None, [
        f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=2",
        "logging.progress_bar=false", "trainer.torch_threads=1", "data.train_batch_size=2",
        "actor.mini_batch_size=2",
        "rollout.n=2", f"reward.custom_fn={tmp_path / 'hang_once.py'}:compute_score",
        "reward.num_workers=1", "reward.timeout_s=5", "reward.error_score=-1"])
    history = launch(cfg)
    assert len(history) == 2
    # step 1: one of the 4 samples hung and scored error_score; step 2 had none
    assert history[0]["reward/timeouts"] == 1 and history[1]["reward/timeouts"] == 0
    assert history[0]["reward/min"] == -1.0 and history[0]["reward/max"] == 0.5
    assert history[1]["reward/min"] == history[1]["reward/max"] == 0.5
