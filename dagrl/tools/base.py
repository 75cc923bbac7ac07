"""What a tool is, and how the configured ones are found.

A tool has a name, a description, a JSON schema of its arguments, and an async `call(arguments)
-> str`. `rollout.multi_turn.tools` lists built-in names (`calculator`, `python`: registered in
TOOLS) or a user's function by `path/to/file.py:function` / `package.module:function`, loaded
like a custom reward function:

    def lookup_price(item: str) -> str:
        \"\"\"The price of an item in the shop.

        Args:
            item: the item's name
        \"\"\"
        return PRICES.get(item, "unknown item")

A plain function (sync or async) becomes a tool whose name is the function's and whose schema
transformers builds from its signature and docstring (`get_json_schema`: a description and an
`Args:` entry per parameter are required). An object or class with `name`, `description`,
`parameters` and an async `call` is used as it is (a class is instantiated without arguments).

Arguments are checked against the schema (jsonschema) before a call. A tool reports a problem
the policy should read by raising `ToolError`; the rollout turns it, and any other exception, a
timeout included, into an error message in the chat and counts it.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import jsonschema

from dagrl.config.multi_turn import MultiTurnConfig
from dagrl.registry import Registry
from dagrl.rewards.custom import load_function


class ToolError(Exception):
    """A failed call, with a message for the policy (bad arguments, a limit hit, ...)."""


@runtime_checkable
class Tool(Protocol):
    name: str
    description: str
    parameters: dict            # JSON schema of the arguments object

    async def call(self, arguments: dict) -> str:
        """Run with validated arguments; the result is text for the chat."""


# Built-in tools: name -> factory(the multi_turn config) -> Tool.
TOOLS: Registry[Callable[[MultiTurnConfig], Tool]] = Registry("tool")


def openai_schema(tool: Tool) -> dict:
    """The tool as chat templates take it (`apply_chat_template(..., tools=[...])`)."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": tool.parameters}}


def check_arguments(tool: Tool, arguments: Any) -> None:
    """ToolError naming what is wrong when `arguments` does not fit the tool's schema."""
    if not isinstance(arguments, dict):
        raise ToolError(f"{tool.name}: arguments must be a JSON object, got "
                        f"{type(arguments).__name__}")
    try:
        jsonschema.validate(arguments, tool.parameters)
    except jsonschema.ValidationError as err:
        where = "/".join(map(str, err.absolute_path))
        raise ToolError(f"{tool.name}: bad arguments{f' at {where}' if where else ''}: "
                        f"{err.message}") from None


class FunctionTool:
    """A user's plain function (sync or async) as a tool; sync ones run in a thread. Both have
    `timeout_s` of wall time (a thread cannot be killed: it is left to finish on its own)."""

    def __init__(self, fn: Callable, timeout_s: float, spec: str = "") -> None:
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(fn)["function"]
        except Exception as err:   # transformers raises its own error types for docstrings
            raise ValueError(f"tool {spec or fn.__name__!r}: cannot build its JSON schema from "
                             f"the signature and docstring ({err}); give the function a "
                             "docstring with a description and an 'Args:' entry per "
                             "parameter") from err
        self.fn, self.timeout_s = fn, timeout_s
        self.name, self.description = schema["name"], schema.get("description", "")
        self.parameters = schema.get("parameters", {"type": "object", "properties": {}})

    async def call(self, arguments: dict) -> str:
        if inspect.iscoroutinefunction(self.fn):
            running = self.fn(**arguments)
        else:
            running = asyncio.to_thread(self.fn, **arguments)
        result = await within(running, self.timeout_s, self.name)
        return result if isinstance(result, str) else str(result)


async def within(running, timeout_s: float, name: str) -> Any:
    """`await running`, or a ToolError for the policy after `timeout_s` of wall time."""
    try:
        return await asyncio.wait_for(running, timeout_s)
    except asyncio.TimeoutError:
        raise ToolError(f"{name}: no result within {timeout_s:g} s") from None


class TimedTool:
    """A user's Tool object, its calls limited to `timeout_s` of wall time like a function's."""

    def __init__(self, tool: Tool, timeout_s: float) -> None:
        self.tool, self.timeout_s = tool, timeout_s
        self.name, self.description = tool.name, tool.description
        self.parameters = tool.parameters

    async def call(self, arguments: dict) -> str:
        return await within(self.tool.call(arguments), self.timeout_s, self.name)


def load_tool(spec: str, cfg: MultiTurnConfig) -> Tool:
    """A built-in tool by name, or a user's tool by `file.py:name` / `module:name`."""
    if spec in TOOLS:
        return TOOLS.get(spec)(cfg)
    if ":" not in spec:
        raise ValueError(f"rollout.multi_turn.tools: {TOOLS.unknown_message(spec)} (or name "
                         "your own as path/to/file.py:function)")
    obj = load_function(spec, what="tool")
    if inspect.isclass(obj):
        obj = obj()
    if isinstance(obj, Tool) and inspect.iscoroutinefunction(obj.call):
        return TimedTool(obj, cfg.tool_timeout_s)
    return FunctionTool(obj, cfg.tool_timeout_s, spec)


def load_tools(specs: Sequence[str], cfg: MultiTurnConfig) -> dict[str, Tool]:
    """name -> tool for every configured spec; two tools of one name are an error."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = load_tool(spec, cfg)
        if tool.name in tools:
            raise ValueError(f"rollout.multi_turn.tools: two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools
