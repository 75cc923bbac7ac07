"""Tools a policy calls in multi-turn rollouts: the interface and how configured tools are
loaded (base.py), the built-ins `calculator`, `python` and `http` (builtin.py, http.py), and the
sandbox that runs the policy's code (sandbox.py, sandbox_child.py)."""

from __future__ import annotations

from dagrl.tools import builtin  # noqa: F401 (registers the built-in tools)
from dagrl.tools.base import TOOLS, Tool, ToolError, load_tools, openai_schema
from dagrl.tools.sandbox import Sandbox, SandboxResult, SandboxUnavailable

__all__ = ["TOOLS", "Sandbox", "SandboxResult", "SandboxUnavailable", "Tool", "ToolError",
           "load_tools", "openai_schema"]
