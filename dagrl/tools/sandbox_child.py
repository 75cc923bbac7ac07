"""The sandbox's own process: run untrusted Python code where it cannot harm the run or the host.

Started by dagrl/tools/sandbox.py as `python -I sandbox_child.py SETTINGS_JSON` with the code on
stdin; imports nothing from dagrl (it must not load torch). As root, it:

1. moves into new mount, network, PID, IPC and UTS namespaces (`unshare`): no network
   interface but a loopback that is down, so no socket can reach anything, not even the host's
   127.0.0.1, and no process outside the namespace is visible;
2. builds a new root in an empty tmpfs: the interpreter's directories and the system libraries
   bind-mounted read-only, a few device nodes, a fresh /proc, and /scratch, a small tmpfs owned
   by the sandbox's user, the only writable place (/tmp points to it); the skeleton itself is
   then made read-only;
3. forks the namespace's init (PID 1), which mounts /proc, chroots into the new root and forks
   the process that runs the code, reaping everything until that one exits; when init exits
   the kernel kills every process left in the namespace (what a fork bomb leaves behind);
4. the code's process sets rlimits (CPU time, address space, processes of its user, file
   size, open files, no core dumps), drops root for its own unprivileged user (every
   capability goes with it, so it cannot undo the mounts, enter other namespaces or leave the
   chroot) with no_new_privs set, and runs the code from /scratch.

Exit status: the code's exit code (0-124), 128 + signal when a signal killed it (SIGXCPU: the
CPU limit), or 125 with a line on stderr starting with "dagrl-sandbox:" when the sandbox itself
could not be set up (e.g. not root: creating namespaces needs CAP_SYS_ADMIN).
"""

from __future__ import annotations

import ast
import ctypes
import json
import os
import resource
import select
import signal
import sys
import traceback

SETUP_FAILED = 125
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
DEVICES = ("null", "zero", "full", "random", "urandom")
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(RuntimeError):
    pass


def _call(name: str, *args) -> None:
    if getattr(_libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{name}{args!r}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    _call("mount", enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))


def _bind_read_only(host_path: str, root: str) -> None:
    """`host_path` at the same path under `root`, read-only (a symlink is recreated as one)."""
    target = root + host_path
    if os.path.islink(host_path):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.lexists(target):
            os.symlink(os.readlink(host_path), target)
        return
    if not os.path.isdir(host_path) or os.path.isdir(target) and os.path.ismount(target):
        return
    os.makedirs(target, exist_ok=True)
    _mount(host_path, target, None, MS_BIND)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _interpreter_dirs() -> list[str]:
    """The directories Python reads from: its prefixes and every directory on sys.path, minus
    those inside another one (a bind mount brings its subdirectories along)."""
    dirs = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    dirs |= {os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)}
    dirs.add(os.path.dirname(os.path.realpath(sys.executable)))
    dirs |= {p for p in (sys.prefix, sys.base_prefix) if os.path.isdir(p)}
    kept = []
    for d in sorted(dirs, key=len):
        if not any(d == k or d.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(d)
    return kept


def build_root(root: str, uid: int, scratch_mb: int) -> None:
    """Steps 1-2 of the module docstring, in this process (root, before the fork)."""
    _call("unshare", CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS)
    # Nothing mounted here may propagate back to the host's mount namespace.
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in SYSTEM_DIRS:
        if os.path.lexists(path):
            _bind_read_only(path, root)
    # A path like the interpreter's under /root (mode 0700) stays reachable by the sandbox's
    # user: the skeleton's directories (made here, 0755) stand in for the host's on the way.
    for path in _interpreter_dirs():
        _bind_read_only(path, root)
    os.makedirs(root + "/dev", exist_ok=True)
    for name in DEVICES:
        node = f"{root}/dev/{name}"
        open(node, "w").close()
        _mount(f"/dev/{name}", node, None, MS_BIND)
    os.symlink("/proc/self/fd", root + "/dev/fd")
    os.makedirs(root + "/proc", exist_ok=True)
    os.makedirs(root + "/scratch", exist_ok=True)
    _mount("tmpfs", root + "/scratch", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={scratch_mb}m,mode=0700,uid={uid},gid={uid}")
    # /tmp points to the scratch directory, unless the skeleton already has a /tmp because the
    # interpreter or the code lives under the host's /tmp (a venv or checkout there): then
    # /tmp stays read-only and TMPDIR (set below) still sends temporary files to /scratch.
    if not os.path.lexists(root + "/tmp"):
        os.symlink("/scratch", root + "/tmp")
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _limit(kind: int, value: int, hard: int | None = None) -> None:
    resource.setrlimit(kind, (value, value if hard is None else hard))


def _run_code(code: str, settings: dict) -> None:
    """Step 4: limits, drop root, run. Never returns."""
    uid, cpu = settings["uid"], int(settings["cpu_time_s"])
    # SIGXCPU at the soft limit, SIGKILL a second later if the code catches it.
    _limit(resource.RLIMIT_CPU, cpu, cpu + 1)
    _limit(resource.RLIMIT_AS, settings["memory_mb"] << 20)
    _limit(resource.RLIMIT_NPROC, settings["max_processes"])
    _limit(resource.RLIMIT_FSIZE, settings["scratch_mb"] << 20)
    _limit(resource.RLIMIT_NOFILE, 64)
    _limit(resource.RLIMIT_CORE, 0)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    _call("prctl", PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0),
          ctypes.c_ulong(0), ctypes.c_ulong(0))
    os.chdir("/scratch")
    os.environ.clear()
    os.environ.update({"HOME": "/scratch", "TMPDIR": "/scratch", "PATH": "/usr/bin:/bin",
                       "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"})
    status = 0
    try:
        tree = ast.parse(code, "<code>")
        # Like a notebook cell: a last bare expression's value is printed.
        last = tree.body[-1] if tree.body else None
        if isinstance(last, ast.Expr):
            show = ast.parse("__value__ = None\nif __value__ is not None: print(repr(__value__))")
            show.body[0].value = last.value
            tree.body[-1:] = show.body
            ast.fix_missing_locations(tree)
        exec(compile(tree, "<code>", "exec"), {"__name__": "__main__"})
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException as err:   # the code's own error, reported to the policy
        status = 1
        try:
            frames = [f for f in traceback.extract_tb(err.__traceback__)
                      if f.filename == "<code>"]
            lines = traceback.format_list(frames[-3:])
            sys.stderr.write("Traceback (most recent call last):\n" + "".join(lines)
                             + "".join(traceback.format_exception_only(type(err), err)))
        except MemoryError:
            sys.stderr.write("MemoryError\n")
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(min(max(int(status), 0), 124))


def _init(root: str, settings: dict, alive: int) -> None:
    """Step 3: PID 1 of the new namespace. Never returns."""
    _call("prctl", PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0),
          ctypes.c_ulong(0), ctypes.c_ulong(0))
    # The runner holds the pipe's write end until it exits: an end of file now means it died
    # before the line above (getppid() cannot tell: it is 0 for a namespace's init).
    if select.select([alive], [], [], 0)[0]:
        os._exit(SETUP_FAILED)
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chroot(root)
    os.chdir("/")
    child = os.fork()
    if child == 0:
        os.close(alive)
        _run_code(settings["code"], settings)
    while True:   # reap every orphan; stop when the code's process is gone
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            break
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def main() -> None:
    settings = json.loads(sys.argv[1])
    settings["code"] = sys.stdin.read()
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    try:
        if os.geteuid() != 0:
            raise SetupError("the sandbox creates namespaces and mounts, which needs root "
                             f"(CAP_SYS_ADMIN); this process runs as uid {os.geteuid()}")
        build_root(settings["root"], settings["uid"], settings["scratch_mb"])
    except (SetupError, OSError) as err:
        sys.stderr.write(f"dagrl-sandbox: cannot set up the sandbox: {err}\n")
        sys.exit(SETUP_FAILED)
    alive, keep = os.pipe()
    init = os.fork()
    if init == 0:
        try:
            os.close(keep)
            _init(settings["root"], settings, alive)
        except BaseException as err:   # a setup failure inside the namespace
            sys.stderr.write(f"dagrl-sandbox: cannot set up the sandbox: {err}\n")
            sys.stderr.flush()
            os._exit(SETUP_FAILED)
    _, status = os.waitpid(init, 0)
    sys.exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    main()
