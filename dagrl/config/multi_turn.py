"""The `rollout.multi_turn` section: agent rollouts, in which the policy calls tools or acts in
an environment over several turns (dagrl/rollout/multi_turn.py), and the sandbox that runs
the policy's code (dagrl/tools/sandbox.py).

Tool and environment names are checked against their registries when the worker builds them
(the registries live above this layer); what can be checked here is checked in
`__post_init__`, with messages that start with the field name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from dagrl.config.loader import require


@dataclass
class SandboxConfig:
    """Limits of the process that runs the policy's code (the `python` tool). CPU time, not wall
    time, is the main limit, so a machine that is busy (or a paused process) does not turn a
    legitimate call into a timeout; `wall_time_s` only catches code that sleeps or blocks."""
    cpu_time_s: int = 5             # RLIMIT_CPU of the sandboxed process (whole seconds)
    wall_time_s: float = 60.0       # generous: killed after this long whatever it does
    memory_mb: int = 512            # RLIMIT_AS (address space) of each sandboxed process
    max_processes: int = 32         # RLIMIT_NPROC of the sandbox's user: a fork bomb stops here
    scratch_mb: int = 16            # size of its scratch directory (a tmpfs): all it may write
    max_output_chars: int = 2048    # what is kept of its stdout + stderr

    def __post_init__(self) -> None:
        require(self.cpu_time_s >= 1, "cpu_time_s must be >= 1 (whole seconds)")
        require(self.wall_time_s >= self.cpu_time_s, "wall_time_s must be >= cpu_time_s")
        require(self.memory_mb >= 64, "memory_mb must be >= 64 (a Python interpreter needs ~30)")
        require(self.max_processes >= 1, "max_processes must be >= 1")
        require(self.scratch_mb >= 1, "scratch_mb must be >= 1")
        require(self.max_output_chars > 0, "max_output_chars must be > 0")


def _one_string_parameter() -> dict[str, Any]:
    return {"type": "object",
            "properties": {"input": {"type": "string", "description": "what to send"}},
            "required": ["input"], "additionalProperties": False}


@dataclass
class HttpToolConfig:
    """The `http` tool: a service that answers over HTTP (a search API, a remote code sandbox,
    a retrieval server). A call POSTs its arguments, checked against `parameters`, as a JSON
    object to `url`; the answer's body is the result (or its JSON `result` field), a JSON
    `error` field or an HTTP error status is a failed call (dagrl/tools/http.py)."""
    url: str = ""                   # http:// or https://, e.g. http://127.0.0.1:8000/search
    name: str = "http"              # what the policy calls it (and the tool-call format names)
    description: str = "Send a request to a web service and read its answer."
    # JSON schema of the arguments object; the `tiny` format fills the first required one.
    parameters: dict[str, Any] = field(default_factory=_one_string_parameter)
    # Wall-clock limit of one call, connection included; 0: rollout.multi_turn.tool_timeout_s.
    timeout_s: float = 0.0

    def __post_init__(self) -> None:
        require(not self.url or self.url.startswith(("http://", "https://")),
               f"url must start with http:// or https://, got {self.url!r}")
        require(bool(self.name), "name must not be empty")
        require(self.parameters.get("type") == "object",
               "parameters must be a JSON schema with type: object (the arguments object)")
        require(self.timeout_s >= 0, "timeout_s must be >= 0 (0: tool_timeout_s)")


@dataclass
class MultiTurnConfig:
    # Off: one response per prompt (rollout.max_new_tokens tokens). On: a chat in which each
    # policy turn may call tools (their results are appended and the policy goes on) or, with
    # an environment, is answered by it; the response holds every turn, and only the policy's
    # tokens are trained on. rollout.max_new_tokens is then the budget of the whole response,
    # tool and environment tokens included.
    enable: bool = False
    # Policy turns per episode, at most.
    max_turns: int = 4
    # Tokens one policy turn may generate; 0: whatever is left of rollout.max_new_tokens.
    max_tokens_per_turn: int = 0
    # Tools the policy may call: built-in names (calculator, python, http) or a user's function,
    # `path/to/file.py:function` or `package.module:function` (dagrl/tools/base.py).
    tools: list[str] = field(default_factory=list)
    # How tool calls are written and parsed: `hermes`, `<tool_call>{"name": ..., "arguments":
    # {...}}</tool_call>` as the chat templates of Qwen2.5/Qwen3 and Hermes models render them
    # (schemas passed to the template as tools=); `tiny`, `[name:]argument=` for the built-in
    # character-level tiny models (dagrl/rollout/chat.py).
    format: Literal["hermes", "tiny"] = "hermes"
    # An environment that answers the turns without a tool call: a built-in name (guess_number)
    # or `path/to/file.py:Class`. Empty: a turn without a tool call ends the episode.
    environment: str = ""
    # Tool calls in flight at once, over the whole batch.
    max_concurrent_calls: int = 8
    # Wall-clock limit of one call of a tool that runs in this process (a user's function or
    # Tool object); the sandboxed python tool has the sandbox's limits instead.
    tool_timeout_s: float = 30.0
    # A tool's result is cut to this many characters before it enters the chat.
    max_tool_output_chars: int = 512
    # trainer.mode=async: while a batch's episodes await their tools, the rollout ranks start
    # the next step's episodes (first turn generated, first calls sent) as soon as they hold
    # weights fresh enough for that step (rollout.max_staleness), loading them between turns.
    # Off: each batch is generated with the weights it started with.
    look_ahead: bool = True
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    # The service the `http` tool calls (its URL, name and argument schema).
    http: HttpToolConfig = field(default_factory=HttpToolConfig)

    def __post_init__(self) -> None:
        require(self.max_turns > 0, "max_turns must be > 0")
        require(self.max_tokens_per_turn >= 0, "max_tokens_per_turn must be >= 0 (0: no limit)")
        require(self.max_concurrent_calls > 0, "max_concurrent_calls must be > 0")
        require(self.tool_timeout_s > 0, "tool_timeout_s must be > 0")
        require(self.max_tool_output_chars > 0, "max_tool_output_chars must be > 0")
        require(len(set(self.tools)) == len(self.tools), f"tools lists a tool twice: {self.tools}")
        require(not self.enable or bool(self.tools) or bool(self.environment),
               "enable=true needs tools or an environment (a chat with neither has one turn)")
        require("http" not in self.tools or bool(self.http.url),
               "tools lists http: set http.url to the service it calls")
