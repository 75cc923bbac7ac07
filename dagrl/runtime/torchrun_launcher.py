"""`dagrl train --nproc-per-node N ...`: torchrun's elastic agent, started in this process.

The workers are the same as under `torchrun ... -m dagrl.train` (runtime/process.py); what
differs is the launcher's own output. torchrun re-raises a failed worker as `ChildFailedError`
from its `main`, so every failure ends in a ~45-line launcher traceback under dagrl's one error
line, and an interrupted run in a `SignalException` traceback. Here the agent runs in-process
and its exceptions end in an exit status: the first failing worker has already printed dagrl's
line; a worker that printed nothing (killed by a signal) gets one line here.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence

from dagrl.runtime.failures import INTERRUPTED_EXIT

FAILED = 1   # a failed run's status where its worker's is unknown


def _quiet_agent_logs(debug: bool) -> None:
    """The elastic agent logs each worker's start, its SIGTERMs and a failure summary; dagrl's
    own line says what matters. torch gives each of its loggers a level of its own (LOGLEVEL),
    so the parent logger's level is not enough. --debug keeps them."""
    if debug:
        return
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run",
                            "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL + 1)


def world_size(launcher_args: Sequence[str]) -> int | None:
    """nproc_per_node x nnodes from torchrun's options (None: an elastic range of nodes, the
    world size is known only at rendezvous; the workers read it then)."""
    from torch.distributed.run import parse_args, parse_min_max_nnodes

    ns = parse_args([*launcher_args, "-m", "dagrl.train"])
    low, high = parse_min_max_nnodes(ns.nnodes)
    if low != high or not ns.nproc_per_node.isdigit():
        return None
    return high * int(ns.nproc_per_node)


def launch_torchrun(launcher_args: Sequence[str], train_args: Sequence[str],
                    debug: bool = False) -> int:
    """Start `dagrl.train` with `train_args` under torchrun's agent with `launcher_args`
    (torchrun's options); returns the run's exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args([*launcher_args, "-m", "dagrl.train", *(["--debug"] if debug else []),
                       *train_args])
    _quiet_agent_logs(debug)
    try:
        run(args)
    except ChildFailedError as err:
        return _failed_status(err)
    except SignalException as err:
        # The agent passed the signal on to the workers; rank 0 said where the run stopped.
        return INTERRUPTED_EXIT if err.sigval == signal.SIGINT else 128 + int(err.sigval)
    except KeyboardInterrupt:   # before the agent installed its handlers
        return INTERRUPTED_EXIT
    return 0


def _failed_status(err) -> int:
    """The exit status of a failed run. A worker ended by a signal (kill -9, the OOM killer, a
    crash) printed nothing and is the cause (its peers failed on its closed sockets and said
    nothing): it gets its line here. Otherwise the first failing worker has printed its own."""
    # SIGTERM is how the agent stops the other workers once one has failed: not a cause.
    killed = sorted((failure.timestamp, rank, failure) for rank, failure in err.failures.items()
                    if failure.exitcode < 0 and failure.exitcode != -signal.SIGTERM)
    if not killed:
        return err.get_first_failure()[1].exitcode or FAILED
    _, rank, failure = killed[0]
    if failure.exitcode == -signal.SIGINT:
        return INTERRUPTED_EXIT
    print(f"error: rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}; "
          "the same command resumes from the last checkpoint", file=sys.stderr)
    return 128 - failure.exitcode
