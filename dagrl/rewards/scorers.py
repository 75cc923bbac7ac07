"""Rule-based reward scorers, looked up by a row's ``data_source``.

Every scorer has the signature ``fn(solution_str, ground_truth, extra_info) -> float | dict``;
a dict must hold ``"score"`` and may carry other numeric keys that are reported as metrics.
Register a new one with ``@SCORERS.register("my/data_source")``.
"""

from __future__ import annotations

import re
from decimal import Decimal

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


# ---------------------------------------------------------------------------------------------
# GSM8K: "... #### 42"

# After the last "####": optional "$", a sign, digits with thousands commas, optional decimals.
_GSM8K_ANSWER = re.compile(r"\s*\$?\s*(-?\s*\$?\s*[0-9][0-9,]*(?:\.[0-9]+)?)")


def _as_decimal(text: str) -> Decimal | None:
    """``"$1,234.50"`` -> ``Decimal("1234.50")``; None when the text is not a plain number."""
    cleaned = re.sub(r"[\s,$]", "", text)
    if not re.fullmatch(r"-?[0-9]+(?:\.[0-9]+)?", cleaned):
        return None
    return Decimal(cleaned)


@SCORERS.register("openai/gsm8k", "gsm8k")
def gsm8k_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 if the number after the last ``####`` equals the ground truth, else 0.0.

    Commas, ``$`` and spaces are removed and both sides are compared as numbers, so "42",
    "42.0", "42.00" and "$42" are equal. No ``####`` (or no number after it) scores 0.0.
    """
    expected = _as_decimal(str(ground_truth))
    if expected is None:
        raise ValueError(f"gsm8k ground truth {ground_truth!r} is not a number")
    _, sep, tail = solution_str.rpartition("####")
    if not sep:
        return 0.0
    match = _GSM8K_ANSWER.match(tail)
    if match is None:
        return 0.0
    answer = _as_decimal(match.group(1))
    return float(answer is not None and answer == expected)


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
