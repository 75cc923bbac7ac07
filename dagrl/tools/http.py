"""The `http` tool: the policy calls a service over HTTP, as agents call a search API, a
retrieval server or a remote code sandbox.

    rollout.multi_turn.tools=[http]
    rollout.multi_turn.http.url=http://127.0.0.1:8000/search
    rollout.multi_turn.http.name=search            # what the policy calls it
    rollout.multi_turn.http.parameters={type: object, properties: {query: {type: string}},
                                        required: [query]}

A call POSTs its arguments (already checked against `parameters`) as a JSON object. A 2xx answer
is the result: its body as text, or, for a JSON object, its `result` field (an `error` field
instead is a failed call). Any other status, an unreachable service and a call that takes longer
than `http.timeout_s` (default: `rollout.multi_turn.tool_timeout_s`) are failed calls: a
ToolError whose message the policy reads and the rollout counts, as for every tool.

The request runs in a thread of the tool's own pool (urllib is blocking): one thread per call
in flight, up to `max_concurrent_calls`, so slow answers overlap instead of queueing, and the
pool outlives the event loop of each turn (asyncio.run would otherwise wait for the default
executor's threads at the end of every turn). The socket timeout equals the call's, so a thread
whose call timed out ends on its own shortly after.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from dagrl.config.multi_turn import HttpToolConfig, MultiTurnConfig
from dagrl.tools.base import ToolError, within

# What is kept of an error body in the message (the result itself is cut by the rollout).
MAX_ERROR_CHARS = 200


def _decode(name: str, body: bytes, content_type: str) -> tuple[str, str]:
    """(result, error) from an answer's body: a JSON object's `result` / `error` fields, or the
    body as text."""
    text = body.decode("utf-8", errors="replace")
    if "json" not in content_type:
        return text, ""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return "", f"{name}: the service's answer is not valid JSON"
    if isinstance(data, dict) and "error" in data and data["error"] not in (None, ""):
        return "", f"{name}: {str(data['error'])[:MAX_ERROR_CHARS]}"
    if isinstance(data, dict) and "result" in data:
        result = data["result"]
        return (result if isinstance(result, str) else json.dumps(result)), ""
    return text, ""


class HttpTool:
    """A tool answered by the service at `rollout.multi_turn.http.url` (module docstring)."""

    def __init__(self, cfg: MultiTurnConfig) -> None:
        http: HttpToolConfig = cfg.http
        if not http.url:
            raise ValueError("rollout.multi_turn.tools lists http: set "
                             "rollout.multi_turn.http.url to the service it calls")
        self.url = http.url
        self.name, self.description = http.name, http.description
        self.parameters = http.parameters
        self.timeout_s = http.timeout_s or cfg.tool_timeout_s
        self.pool = ThreadPoolExecutor(max_workers=cfg.max_concurrent_calls,
                                       thread_name_prefix=f"dagrl-tool-{self.name}")

    async def call(self, arguments: dict) -> str:
        loop = asyncio.get_running_loop()
        running = loop.run_in_executor(self.pool, self._post, arguments)
        return await within(running, self.timeout_s, self.name)

    def _post(self, arguments: dict) -> str:
        """One request, blocking (in a pool thread); ToolError for every kind of failure."""
        request = urllib.request.Request(
            self.url, data=json.dumps(arguments).encode(), method="POST",
            headers={"Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                body, content_type = answer.read(), answer.headers.get("Content-Type", "")
        except urllib.error.HTTPError as err:   # a status other than 2xx/3xx
            body = err.read() if err.fp is not None else b""
            _, message = _decode(self.name, body, err.headers.get("Content-Type", "") or "")
            detail = message.removeprefix(f"{self.name}: ") or \
                body.decode("utf-8", errors="replace")[:MAX_ERROR_CHARS] or err.reason
            raise ToolError(f"{self.name}: HTTP {err.code}: {detail}") from None
        except TimeoutError:
            raise ToolError(f"{self.name}: no result within {self.timeout_s:g} s") from None
        except urllib.error.URLError as err:
            if isinstance(err.reason, TimeoutError):
                raise ToolError(f"{self.name}: no result within {self.timeout_s:g} s") from None
            raise ToolError(f"{self.name}: cannot reach {self.url}: {err.reason}") from None
        except OSError as err:   # the connection dropped mid-answer
            raise ToolError(f"{self.name}: the request to {self.url} failed: {err}") from None
        result, error = _decode(self.name, body, content_type)
        if error:
            raise ToolError(error)
        return result
