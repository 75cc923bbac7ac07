"""Run the policy's code in a sandbox that holds: its own process with CPU-time, memory, process
and file-size limits, no network, a read-only view of nothing but the interpreter and the system
libraries, and a small scratch directory as the only writable place (how it is built:
dagrl/tools/sandbox_child.py). Output is cut to `max_output_chars`.

Linux, as root: the sandbox creates namespaces and mounts. Where it cannot (another OS, no
CAP_SYS_ADMIN), `Sandbox.check` raises `SandboxUnavailable` with the reason before training
starts, rather than running the code unconfined.

Every failure of the code is a result, never an exception: the tool turns it into a clear error
message for the policy (`SandboxResult.message`), and the run goes on.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dagrl.config.multi_turn import SandboxConfig

CHILD = Path(__file__).with_name("sandbox_child.py")
SETUP_FAILED = 125
# The sandboxed code runs as a uid of its own: UID_BASE + (the trainer's pid mod 2^20) * 2^10 +
# slot (one slot per call in flight), so each call's process limit (counted per uid) counts
# only its own processes, also with several workers on one host; no file on the host belongs
# to these users.
UID_BASE = 1_000_000_000
UID_SPAN = 2**30
MAX_SLOTS = 2**10


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be built on this machine; the message says why."""


@dataclass
class SandboxResult:
    status: str          # ok | error | exit | cpu_time | memory | processes | wall_time | killed
    output: str          # stdout then stderr, cut to max_output_chars
    exit_code: int | None
    limits: SandboxConfig

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def message(self) -> str:
        """What the policy reads: the output, or a clear error naming the limit that stopped
        the code (with what it printed before)."""
        lim = self.limits
        reason = {
            "error": "the code raised an error",
            "cpu_time": f"the code ran past its CPU time limit ({lim.cpu_time_s:g} s) and was "
                        "stopped",
            "memory": f"the code ran out of memory (limit {lim.memory_mb} MiB)",
            "processes": f"the code hit the limit of {lim.max_processes} processes and was "
                         "stopped",
            "wall_time": f"the code ran past its time limit ({lim.wall_time_s:g} s of wall time)"
                         " and was stopped",
            "exit": f"the code exited with status {self.exit_code}",
            "killed": f"the code was killed (exit status {self.exit_code})",
        }.get(self.status)
        if reason is None:
            return self.output
        return f"error: {reason}" + (f"\n{self.output}" if self.output else "")


def _classify(exit_code: int, stderr: str) -> str:
    last = stderr.strip().rsplit("\n", 1)[-1] if stderr.strip() else ""
    if exit_code == 0:
        return "ok"
    if exit_code == 128 + signal.SIGXCPU:
        return "cpu_time"
    if last.startswith("MemoryError") or exit_code == 128 + signal.SIGSEGV and not last:
        return "memory"
    if last.startswith("BlockingIOError") and "Resource temporarily unavailable" in last:
        return "processes"   # fork() refused by RLIMIT_NPROC (EAGAIN)
    if exit_code == 128 + signal.SIGKILL:
        return "cpu_time"    # the hard CPU limit, one second after SIGXCPU was ignored
    if exit_code >= 128:
        return "killed"
    return "error" if last else "exit"   # a traceback, or sys.exit(n) without one


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more " \
                                                          "characters cut]"


TAIL_BYTES = 512


async def _read_capped(stream: asyncio.StreamReader, limit: int) -> tuple[bytes, bytes]:
    """Read a pipe to its end: (its first `limit` bytes, its last TAIL_BYTES bytes; the tail
    tells how the code ended even when it printed much more)."""
    kept, tail = bytearray(), b""
    while chunk := await stream.read(65536):
        if len(kept) < limit:
            kept += chunk[:limit - len(kept)]
        tail = (tail + chunk)[-TAIL_BYTES:]
    return bytes(kept), tail


class Sandbox:
    """Runs code with `limits`, at most `max_concurrent` processes at a time."""

    def __init__(self, limits: SandboxConfig, max_concurrent: int = 8) -> None:
        self.limits = limits
        self._slots = list(range(min(max_concurrent, MAX_SLOTS)))
        self._uid_base = UID_BASE + (os.getpid() % 2**20) * MAX_SLOTS
        self._free: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:   # each asyncio.run has its own loop
            self._loop, self._free = loop, asyncio.Semaphore(len(self._slots))
        return self._free

    def check(self) -> None:
        """Build one sandbox and run `print(1)` in it; SandboxUnavailable if it cannot."""
        result = asyncio.run(self.run("print(1)"))
        if not result.ok or result.output.strip() != "1":
            raise SandboxUnavailable(f"the python tool's sandbox does not work here: "
                                     f"{result.message()}")

    async def run(self, code: str) -> SandboxResult:
        async with self._semaphore():
            slot = self._slots.pop()
            try:
                return await self._run(code, self._uid_base + slot)
            finally:
                self._slots.append(slot)

    async def _run(self, code: str, uid: int) -> SandboxResult:
        lim = self.limits
        # An empty directory on the host: the mount point of the sandbox's root, which lives
        # only in the sandbox's mount namespace (nothing is ever written into it here).
        root = tempfile.mkdtemp(prefix="dagrl-sandbox-")
        settings = {"root": root, "uid": uid, "cpu_time_s": lim.cpu_time_s,
                    "memory_mb": lim.memory_mb, "max_processes": lim.max_processes,
                    "scratch_mb": lim.scratch_mb}
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", str(CHILD), json.dumps(settings),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True)
            proc.stdin.write(code.encode())
            await proc.stdin.drain()
            proc.stdin.close()
            cap = 4 * lim.max_output_chars
            reading = asyncio.gather(_read_capped(proc.stdout, cap),
                                     _read_capped(proc.stderr, cap), proc.wait())
            try:
                (out, _), (err, err_tail), exit_code = await asyncio.wait_for(
                    reading, lim.wall_time_s)
                timed_out = False
            except asyncio.TimeoutError:
                # Killing the runner kills the namespace's init (its parent-death signal),
                # and with it every process the code started.
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
                out, err, err_tail, exit_code, timed_out = b"", b"", b"", proc.returncode, True
        finally:
            shutil.rmtree(root, ignore_errors=True)
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        if exit_code == SETUP_FAILED and "dagrl-sandbox:" in stderr:
            raise SandboxUnavailable(stderr.strip().split("dagrl-sandbox: ", 1)[1])
        status = "wall_time" if timed_out else _classify(exit_code,
                                                         err_tail.decode(errors="replace"))
        output = stdout + (("\n" if stdout and not stdout.endswith("\n") else "") + stderr
                           if stderr else "")
        return SandboxResult(status, _cut(output.strip("\n"), lim.max_output_chars), exit_code,
                             lim)
