"""Rule-based reward scorers, looked up by a row's ``data_source``.

Every scorer has the signature ``fn(solution_str, ground_truth, extra_info) -> float | dict``;
a dict must hold ``"score"`` and may carry other numeric keys that are reported as metrics.
Register a new one with ``@SCORERS.register("my/data_source")``.
"""

from __future__ import annotations

import re

from dagrl.registry import Registry

SCORERS: Registry = Registry("reward scorer")

_DIGITS = "0123456789"


@SCORERS.register("arith")
def arith_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Exact integer answer, with partial credit for answers that look like the right one.

    With ``resp = solution_str.strip()`` and ``gt = ground_truth.strip()``::

        score = 1                                                      if resp == gt
        score = 0.2 * digit_frac + 0.2 * length_score + 0.4 * position_match   otherwise

        digit_frac     = #digits(resp) / len(resp)     (a leading '-' counts; 0 if resp empty)
        length_score   = max(0, 1 - |len(resp) - len(gt)| / len(gt))
        position_match = #{i < min(len(resp), len(gt)) : resp[i] == gt[i]} / len(gt)

    A wrong answer scores at most 0.8, so the exact answer always wins. The shaping exists so a
    randomly initialised tiny model trained from scratch gets a non-zero GRPO advantage from
    the first steps (emitting digits, then the right length, then the right digits).
    """
    resp, gt = solution_str.strip(), ground_truth.strip()
    if not gt:
        raise ValueError("arith ground truth is empty")
    if resp == gt:
        return 1.0
    n_digits = sum(c in _DIGITS for c in resp) + resp.startswith("-")
    digit_frac = n_digits / len(resp) if resp else 0.0
    length_score = max(0.0, 1.0 - abs(len(resp) - len(gt)) / len(gt))
    position_match = sum(r == g for r, g in zip(resp, gt, strict=False)) / len(gt)
    return 0.2 * digit_frac + 0.2 * length_score + 0.4 * position_match


_AFTER_EQUALS = re.compile(r"\s*(-?\d+)")


@SCORERS.register("tool_calc")
def tool_calc_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """The `tool-calc` agent task: the final answer is the integer right after the response's
    last `=` (`37*48+19=1795` -> 1795). The response is decoded whole, tool results included
    (as verl decodes multi-turn responses); with the tiny models' tool-call format a policy
    turn ending in `=` *is* a calculator call, so that integer is the calculator's answer to
    the policy's last call, and the calculator is the only way to an exact answer.

    With ``v`` the answer and ``g = int(ground_truth)`` (> 0)::

        score = 1                                       if v == g
        score = 0.1 + 0.8 * min(v / g, g / v) ** 2      if v > 0
        score = 0.1                                     if v <= 0
        score = 0                                       without an integer after a `=`

    0.1 pays for a call that returned a number at all; the rest for how close the value is as
    a ratio, which pays for putting the problem's own numbers into the call (its tens digits
    alone give ~0.77 on average over the task) more than for a fixed call that ignores the
    problem (the best constant averages ~0.40).
    """
    equals = solution_str.rfind("=")
    found = _AFTER_EQUALS.match(solution_str, equals + 1) if equals >= 0 else None
    if found is None:
        return 0.0
    value, target = int(found.group(1)), int(str(ground_truth).strip())
    if value == target:
        return 1.0
    if value <= 0 or target <= 0:
        return 0.1
    return 0.1 + 0.8 * min(value / target, target / value) ** 2


# ---------------------------------------------------------------------------------------------
# GSM8K: "... #### 42"

# verl's extraction (verl/utils/reward_score/gsm8k.py), so scores compare across frameworks:
# only the last 300 characters are searched; "strict" takes the number after the last "#### "
# (commas and "$" removed), "flexible" the last number anywhere; the answer is compared with the
# ground truth as a string.
_GSM8K_CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_ANY_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer verl's GSM8K scorer extracts from a response, or None."""
    tail = solution_str[-_GSM8K_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    if method == "flexible":
        numbers = [n for n in _ANY_NUMBER.findall(tail) if n not in ("", ".")]
        return numbers[-1] if numbers else None
    raise ValueError(f"gsm8k extraction method {method!r} is not strict or flexible")


@SCORERS.register("openai/gsm8k", "gsm8k")
def gsm8k_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """verl's GSM8K score, strict extraction: 1.0 if the number after the last ``#### `` equals
    the ground truth (as a string, commas and ``$`` removed), else 0.0; no format bonus.

    So "#### 42" scores 1 for "42", but "####42" (no space), "#### 42.0" and "#### 42." do not:
    the strictness is verl's, kept so that rewards and accuracies compare with its runs.
    """
    answer = gsm8k_answer(solution_str, "strict")
    return float(answer is not None and answer == str(ground_truth).strip())


@SCORERS.register("gsm8k_flexible")
def gsm8k_flexible_score(solution_str: str, ground_truth: str,
                         extra_info: dict | None = None) -> float:
    """verl's GSM8K score, flexible extraction: the last number in the response (anywhere, no
    ``####`` needed) against the ground truth; select it with ``reward.scorer=gsm8k_flexible``."""
    answer = gsm8k_answer(solution_str, "flexible")
    return float(answer is not None and answer == str(ground_truth).strip())


def gsm8k_numeric_answer(solution_str: str) -> float | None:
    """The last number in the response's last 300 characters as a value: "$", "," and a
    trailing "." removed ("The answer is $1,200." -> 1200.0), or None."""
    found = gsm8k_answer(solution_str, "flexible")
    if found is None:
        return None
    try:
        return float(found.replace(",", "").replace("$", "").rstrip("."))
    except ValueError:          # "1.2.3", "..5": not a number
        return None


# also the built-in shapes task's (data/shapes.py): its answers are numbers too
@SCORERS.register("gsm8k_numeric", "shapes")
def gsm8k_numeric_score(solution_str: str, ground_truth: str,
                        extra_info: dict | None = None) -> float:
    """The last number in the response compared by value: 1.0 if it equals the ground truth,
    else 0.0; select it with ``reward.scorer=gsm8k_numeric``.

    verl's flexible extraction compares strings, so "The answer is 8." extracts "8." and
    scores 0 against "8" — and small models end most answers with a sentence. This
    scorer strips "$", "," and a trailing "." and compares values ("8.", "8.0", "$8" all equal
    8), as lm-evaluation-harness's GSM8K "flexible-extract" does with its normalisation.
    """
    answer = gsm8k_numeric_answer(solution_str)
    try:
        target = float(str(ground_truth).replace(",", "").strip())
    except ValueError as err:
        raise ValueError(f"gsm8k_numeric: ground truth {ground_truth!r} is not a number") from err
    return float(answer is not None and answer == target)


# ---------------------------------------------------------------------------------------------
# MATH: "... \boxed{\frac{1}{2}}"


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}``, ``\fbox{...}`` or ``\boxed ...`` in ``text``.

    Braces are matched with nesting, so ``\boxed{\frac{1}{2}}`` gives ``\frac{1}{2}``.
    The brace-less form ``\boxed 5`` takes the token up to the next space or ``$``.
    None when there is no box or its braces never close.
    """
    # (position, command) of the later of the two box commands
    start, command = max((text.rfind(cmd), cmd) for cmd in ("\\boxed", "\\fbox"))
    if start < 0:
        return None
    rest = text[start + len(command) :]
    if rest[:1].isspace():
        token = re.match(r"\s+([^\s$]+)", rest)
        return token.group(1) if token else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(rest):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None


_TEXT = re.compile(r"\\text\{([^{}]*)\}")
_DROP = re.compile(r"\\left(?![a-zA-Z])|\\right(?![a-zA-Z])|\\!|\\,|\^\{\\circ\}|\^\\circ|\$|\s")


def normalize_math_answer(answer: str) -> str:
    r"""A modest, predictable normalisation of a LaTeX answer.

    Done: ``\text{X}`` -> ``X``; remove ``\left``, ``\right``, ``\!``, ``\,``, ``^\circ``,
    ``^{\circ}``, ``$`` and all whitespace; ``\dfrac``/``\tfrac`` -> ``\frac``; drop one
    trailing period.
    Not done (these still compare unequal): ``0.5`` vs ``\frac{1}{2}``, ``\frac12`` vs
    ``\frac{1}{2}``, ``x=3`` vs ``3``, reordered sets or tuples, plain-text units ("5 cm" vs
    "5"), and anything needing symbolic equivalence.
    """
    answer = _TEXT.sub(r"\1", answer)
    answer = _DROP.sub("", answer)
    answer = answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return answer.removesuffix(".")


@SCORERS.register(
    "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math"
)
def math_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    r"""1.0 if the last ``\boxed{}`` answer equals the ground truth after
    :func:`normalize_math_answer`, else 0.0 (also when the response has no box).

    A ground truth that itself contains ``\boxed`` (a full reference solution) is reduced to
    its last boxed answer first.
    """
    truth = str(ground_truth)
    if "\\boxed" in truth or "\\fbox" in truth:
        boxed_truth = last_boxed(truth)
        if boxed_truth is None:
            raise ValueError(f"math ground truth {truth[:80]!r} has an unbalanced \\boxed")
        truth = boxed_truth
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    return float(normalize_math_answer(answer) == normalize_math_answer(truth))
