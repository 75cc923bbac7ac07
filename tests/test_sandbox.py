"""The python tool's sandbox holds: code that reaches for the network, writes outside its
scratch directory, burns CPU, eats memory or forks without end is stopped with a clear error,
the host is untouched, and the next call runs normally. Every test really attempts the escape.

Time limits are on CPU time (a paused or busy machine does not trip them); the one wall-clock
limit tested is hit by code that sleeps far longer than it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

from dagrl.config.multi_turn import MultiTurnConfig, SandboxConfig
from dagrl.tools import Sandbox, SandboxUnavailable, ToolError
from dagrl.tools.builtin import PythonTool
from dagrl.tools.sandbox import UID_BASE, UID_SPAN

LIMITS = SandboxConfig(cpu_time_s=1, wall_time_s=120, memory_mb=256, max_processes=16,
                       scratch_mb=4, max_output_chars=400)


@pytest.fixture(scope="module")
def sandbox():
    box = Sandbox(LIMITS, max_concurrent=4)
    try:
        box.check()
    except SandboxUnavailable as err:   # not Linux or not root: nothing to test here
        pytest.skip(f"sandbox unavailable: {err}")
    return box


def run(box: Sandbox, code: str):
    return asyncio.run(box.run(code))


def sandbox_processes(wait_s: float = 10.0) -> list[int]:
    """Host pids of processes that run as a sandbox user, once none is left or after `wait_s`
    (the kernel kills a namespace's processes as its init exits, which takes a moment)."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    uid = int((entry / "status").read_text().split("\nUid:\t")[1].split()[0])
                except (OSError, IndexError):
                    continue
                if UID_BASE <= uid < UID_BASE + UID_SPAN:
                    pids.append(int(entry.name))
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.05)


def test_ordinary_code_runs_and_prints(sandbox):
    result = run(sandbox, "import math\nprint(math.factorial(5))\n2 + 3")
    assert result.ok and result.output == "120\n5"


def test_network_is_unreachable_even_on_the_hosts_loopback(sandbox):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    port = server.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port), timeout=5):   # open from the host
        server.accept()[0].close()
    for address in (f"('127.0.0.1', {port})", "('1.1.1.1', 53)"):
        result = run(sandbox, f"import socket\nsocket.create_connection({address}, timeout=5)")
        assert result.status == "error", result.output
        assert "Network is unreachable" in result.output
        assert result.message().startswith("error: the code raised an error")
    with pytest.raises(TimeoutError):   # nothing reached the server from the sandbox
        server.accept()
    server.close()


def test_writes_outside_the_scratch_directory_fail_and_leave_the_host_untouched(sandbox):
    # The interpreter's own directory is visible (read-only) inside; root can write there.
    name = f"escape-{uuid.uuid4().hex}"
    targets = [f"{sys.prefix}/{name}", f"/{name}", f"/usr/{name}", f"/proc/{name}"]
    for target in targets:
        result = run(sandbox, f"open({target!r}, 'w').write('x')")
        assert result.status == "error", (target, result.output)
        assert "Read-only file system" in result.output or "Permission denied" in result.output \
            or "No such file" in result.output, result.output
        assert not Path(target).exists()
    # A directory anyone may write to on the host (like /tmp) is not reachable: /tmp inside
    # is the scratch directory, or, when the interpreter itself lives under the host's /tmp
    # (a CI checkout or venv there), a read-only skeleton holding only those directories.
    shared = Path(f"/tmp/{name}")
    shared.mkdir(mode=0o777)
    try:
        shared.chmod(0o777)
        result = run(sandbox, f"import os\nprint(os.path.exists({str(shared)!r}))\n"
                              f"_ = open('/tmp/{name}', 'w').write('inside')")
        assert result.output.splitlines()[0] == "False", result.output
        assert result.ok or "Read-only file system" in result.output, result.output
        assert list(shared.iterdir()) == []
    finally:
        os.rmdir(shared)
    # Its scratch directory is writable, within its size.
    assert run(sandbox, "open('a', 'w').write('x' * 1000)\nprint(len(open('a').read()))").output \
        == "1000"
    big = run(sandbox, "open('big', 'wb').write(b'x' * (8 << 20))")
    assert big.status != "ok"


def test_it_cannot_regain_root_or_see_the_hosts_processes(sandbox):
    result = run(sandbox, "import os\nprint(os.getuid() != 0, sorted(os.listdir('/proc'))[:2])\n"
                          "os.setuid(0)")
    assert result.status == "error" and "PermissionError" in result.output
    assert result.output.startswith("True ['1', '2']")   # only its own namespace's processes


def test_runaway_cpu_time_is_stopped(sandbox):
    result = run(sandbox, "while True:\n    pass")
    assert result.status == "cpu_time"
    assert result.message() == "error: the code ran past its CPU time limit (1 s) and was stopped"
    # Ignoring SIGXCPU only buys a second: the hard limit kills it.
    result = run(sandbox, "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
                          "while True:\n    pass")
    assert result.status == "cpu_time" and result.exit_code == 128 + signal.SIGKILL


def test_memory_blowup_is_stopped(sandbox):
    result = run(sandbox, "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))")
    assert result.status == "memory"
    assert result.message().startswith("error: the code ran out of memory (limit 256 MiB)")


@pytest.mark.parametrize("code", [
    "import os\nwhile True:\n    os.fork()",
    # children that survive the refusals keep forking until their CPU time runs out
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
])
def test_fork_bombs_are_stopped_and_leave_no_process(sandbox, code):
    result = run(sandbox, code)
    assert result.status in ("processes", "cpu_time"), result.output
    assert result.message().startswith("error: the code ")
    assert sandbox_processes() == []


def test_code_that_sleeps_is_stopped_at_the_wall_time_limit():
    box = Sandbox(SandboxConfig(cpu_time_s=1, wall_time_s=2), max_concurrent=1)
    result = run(box, "import time\ntime.sleep(3600)")
    assert result.status == "wall_time"
    assert "time limit (2 s of wall time)" in result.message()
    assert sandbox_processes() == []


def test_output_is_cut(sandbox):
    result = run(sandbox, "print('y' * 100000)")
    assert result.ok and result.output.startswith("y" * 400)
    assert result.output.endswith("more characters cut]") and len(result.output) < 500


def test_the_python_tool_reports_each_escape_as_a_tool_error_and_goes_on(sandbox):
    tool = PythonTool(MultiTurnConfig(sandbox=LIMITS))
    with pytest.raises(ToolError, match="CPU time limit"):
        asyncio.run(tool.call({"code": "while True: pass"}))
    with pytest.raises(ToolError, match="Network is unreachable"):
        asyncio.run(tool.call({"code": "import socket; socket.create_connection(('1.1.1.1', 53))"}))
    assert asyncio.run(tool.call({"code": "print(6 * 7)"})) == "42"


def test_concurrent_calls_each_get_their_own_sandbox(sandbox):
    async def many():
        return await asyncio.gather(*(sandbox.run(f"open('f', 'w').write('{i}')\n"
                                                  "import time; time.sleep(0.2)\n"
                                                  "print(open('f').read())") for i in range(6)))
    assert [r.output for r in asyncio.run(many())] == [str(i) for i in range(6)]


def test_a_sandbox_that_cannot_be_built_says_why(monkeypatch):
    # The mount point of its root does not exist: the set-up fails inside the runner, and
    # check() (run before training starts) says so instead of running the code unconfined.
    import dagrl.tools.sandbox as sandbox_module

    monkeypatch.setattr(sandbox_module.tempfile, "mkdtemp",
                        lambda prefix: "/nonexistent/dagrl-sandbox-root")
    with pytest.raises(SandboxUnavailable, match="cannot set up the sandbox"):
        Sandbox(LIMITS).check()


ESCAPES = {   # each row's code, and what its episode must read back
    "network": ("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=5)",
                "Network is unreachable"),
    "write": ("open('/usr/escape-attempt', 'w').write('x')", "Read-only file system"),
    "cpu": ("while True:\n    pass", "CPU time limit"),
    "memory": ("x = []\nwhile True:\n    x.append(bytearray(10**7))", "ran out of memory"),
    "fork": ("import os\nwhile True:\n    os.fork()", "the code "),
    "ok": ("print(6 * 7)", "42"),
}


def test_a_rollout_whose_tool_code_tries_each_escape_reads_the_errors_and_goes_on(sandbox):
    # One batch of episodes through the multi-turn loop (Hermes format, the python tool): each
    # first turn runs one escape; every episode gets its error back as the tool's answer and
    # takes its second turn, and the rollout returns.
    import json

    import torch

    from dagrl.rollout.multi_turn import MultiTurnRollout
    from dagrl.rollout.sampling import SamplingParams
    from dagrl.tools import load_tools
    from tests.test_multi_turn import ScriptedEngine, byte_tokenizer

    tok = byte_tokenizer()

    def policy(context: str) -> str:
        if "</tool_response>" in context:
            return "done<|im_end|>"
        name = context.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
        call = {"name": "python", "arguments": {"code": ESCAPES[name][0]}}
        return f"<tool_call>{json.dumps(call)}</tool_call><|im_end|>"

    cfg = MultiTurnConfig(enable=True, tools=["python"], max_turns=2, sandbox=LIMITS,
                          max_tool_output_chars=4000)
    loop = MultiTurnRollout(ScriptedEngine(tok, policy, [tok.eos_token_id]), tok, cfg,
                            tools=load_tools(cfg.tools, cfg), env_factory=None,
                            prompt_width=2000, response_width=2000,
                            pad_token_id=tok.pad_token_id)
    rows = [{"prompt": [{"role": "user", "content": name}]} for name in ESCAPES]
    out = loop.generate(rows, torch.arange(len(rows)), SamplingParams(1.0), torch.device("cpu"))
    for i, (name, (_, expected)) in enumerate(ESCAPES.items()):
        text = tok.decode(out.responses[i, :int(out.attention_mask[i].sum())])
        answer = text.split("<tool_response>\n", 1)[1].split("\n</tool_response>")[0]
        assert expected in answer, (name, answer)
        assert answer.startswith("error: python: the code ") == (name != "ok"), (name, answer)
        assert text.endswith("done<|im_end|>"), name
    assert out.turns.tolist() == [2.0] * len(ESCAPES)
    assert out.tool_errors.tolist() == [1.0] * (len(ESCAPES) - 1) + [0.0]
    assert sandbox_processes() == []
