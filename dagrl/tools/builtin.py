"""The built-in tools: `calculator` (arithmetic, evaluated in this process without running
any code), `python` (the policy's code, run in the sandbox of dagrl/tools/sandbox.py) and `http`
(a service called over HTTP, dagrl/tools/http.py)."""

from __future__ import annotations

import ast
import math
import operator

from dagrl.config.multi_turn import MultiTurnConfig
from dagrl.tools.base import TOOLS, ToolError
from dagrl.tools.http import HttpTool
from dagrl.tools.sandbox import Sandbox

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
# Bounds on every intermediate value, so `9**9**9` is refused instead of eating the CPU.
MAX_INT_BITS = 1024
MAX_EXPONENT = 1024


def _evaluate(node: ast.AST) -> int | float:
    """Numbers, + - * / // % ** and parentheses; anything else (names, calls, strings,
    attributes, comparisons) is refused."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or isinstance(left, int)
                                             and isinstance(right, int) and right > 0 and
                                             left.bit_length() * right > MAX_INT_BITS):
            raise ToolError("calculator: the power is too large")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("calculator: division by zero") from None
        except OverflowError:
            raise ToolError("calculator: the result is too large") from None
        if isinstance(value, complex):
            raise ToolError("calculator: the result is not a real number")
        if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise ToolError("calculator: the result is too large")
        return value
    raise ToolError(f"calculator: only numbers, + - * / // % ** and parentheses are allowed, "
                    f"not {type(node).__name__}")


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text: integers exactly, other numbers to 12
    significant digits (`7/2` -> `3.5`, `6/3` -> `2`)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"calculator: the expression is longer than {MAX_EXPRESSION_CHARS} "
                        "characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"calculator: {expression.strip()!r} is not an arithmetic "
                        "expression") from None
    value = _evaluate(tree)
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("calculator: the result is not a finite number")
    return str(value) if isinstance(value, int) else format(value, ".12g")


class Calculator:
    name = "calculator"
    description = "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses."
    parameters = {"type": "object",
                  "properties": {"expression": {"type": "string",
                                                "description": "the expression, e.g. 12*(3+4)"}},
                  "required": ["expression"], "additionalProperties": False}

    async def call(self, arguments: dict) -> str:
        return calculate(arguments["expression"])


class PythonTool:
    name = "python"
    description = ("Run Python code in a sandbox (no network, no files outside its working "
                   "directory, limited CPU time and memory) and return what it prints; the "
                   "value of a last bare expression is printed too.")
    parameters = {"type": "object",
                  "properties": {"code": {"type": "string", "description": "the code to run"}},
                  "required": ["code"], "additionalProperties": False}

    def __init__(self, cfg: MultiTurnConfig) -> None:
        self.sandbox = Sandbox(cfg.sandbox, max_concurrent=cfg.max_concurrent_calls)
        self.sandbox.check()   # before training: a sandbox that cannot be built fails here

    async def call(self, arguments: dict) -> str:
        result = await self.sandbox.run(arguments["code"])
        if not result.ok:   # the loop writes "error: " before a ToolError's message
            raise ToolError("python: " + result.message().removeprefix("error: "))
        return result.output


TOOLS.add("calculator", lambda cfg: Calculator())
TOOLS.add("python", PythonTool)
TOOLS.add("http", HttpTool)
