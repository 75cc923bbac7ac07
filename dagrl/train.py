"""Train: `dagrl train [CONFIG.yaml] [key=value ...]`, or `python -m dagrl.train ...`.

    dagrl train                                  # GRPO on the built-in arithmetic task
    dagrl train examples/grpo_arith.yaml actor.lr=1e-3 trainer.total_steps=100
    dagrl train --print-config rollout.n=4       # show the resolved config and exit
    dagrl train trainer.n_workers=2              # two workers, started as Ray actors
    dagrl train --nproc-per-node 2               # two workers under torchrun's agent, no Ray
    torchrun --nproc-per-node 2 -m dagrl.train trainer.n_workers=2   # the same, torchrun's output
    dagrl train --from-verl run_qwen2-7b.sh     # a verl launch script's overrides, translated
    dagrl train --verl data.train_batch_size=64 actor_rollout_ref.rollout.n=4 ...   # verl keys
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types
from collections.abc import Sequence
from typing import Any

from dagrl.config.loader import ConfigError, dump_yaml, with_defaults
from dagrl.config.presets import load_run_config
from dagrl.config.schema import Config
from dagrl.data.errors import DatasetError
from dagrl.runtime.config_names import check_config_names

# torchrun's options `dagrl train` passes on to the agent (runtime/torchrun_launcher.py).
TORCHRUN_OPTIONS = {"--nproc-per-node": "N", "--nnodes": "N|MIN:MAX", "--node-rank": "RANK",
                    "--master-addr": "HOST", "--master-port": "PORT", "--rdzv-backend": "NAME",
                    "--rdzv-endpoint": "HOST:PORT", "--rdzv-id": "ID"}


def split_config_args(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """The optional leading YAML path, and the `key=value` overrides."""
    path = None
    rest = list(args)
    if rest and "=" not in rest[0]:
        path = rest.pop(0)
    bad = [a for a in rest if "=" not in a]
    if bad:
        raise ConfigError(f"expected key=value overrides after the config file, got {bad}")
    return path, rest


def with_launcher_world(launcher_args: Sequence[str], args: Sequence[str]) -> list[str]:
    """`[CONFIG.yaml] [key=value ...]` with trainer.n_workers set to the world size torchrun's
    options give, unless the overrides set it (an elastic range of nodes: left as it is)."""
    from dagrl.runtime.torchrun_launcher import world_size

    path, overrides = split_config_args(args)
    world = world_size(launcher_args)
    if world is not None:
        overrides = with_defaults([f"trainer.n_workers={world}"], overrides)
    return [*([path] if path else []), *overrides]


def load_cli_config(args: Sequence[str]) -> Config:
    """[CONFIG.yaml] [key=value ...] -> the config, with algorithm.name's preset applied."""
    path, overrides = split_config_args(args)
    cfg = load_run_config(path, overrides)
    check_config_names(cfg)
    return cfg


def translated_verl_args(script: str | None, args: Sequence[str]) -> list[str]:
    """verl overrides (a launch script's, then `args`) -> dagrl overrides; prints what became
    what (every verl key, and verl's defaults applied) on standard error."""
    from pathlib import Path

    from dagrl.config.verl import parquet_rows, translate
    from dagrl.config.verl_script import overrides_from_script

    verl_args = list(args)
    if script is not None:
        path = Path(script)
        if not path.is_file():
            raise ConfigError(f"--from-verl {script}: no such file")
        verl_args = [*overrides_from_script(path.read_text(), dict(os.environ)), *verl_args]
    translation = translate(verl_args, parquet_rows)
    if os.environ.get("RANK", "0") == "0":
        print(f"verl -> dagrl ({len(translation.overrides)} dagrl keys):\n"
              f"{translation.table()}", file=sys.stderr)
    return translation.overrides


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dagrl train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config and exit")
    parser.add_argument("--debug", action="store_true",
                        help="print tracebacks on the terminal (they always go to the run's "
                             "dagrl.log)")
    parser.add_argument("--from-verl", metavar="SCRIPT",
                        help="a verl launch script: its `python -m verl.trainer.main_ppo` "
                             "overrides (and the key=value arguments after it) are verl keys, "
                             "translated to dagrl's (dagrl/config/verl.py)")
    parser.add_argument("--verl", action="store_true",
                        help="the key=value arguments are verl keys, translated to dagrl's")
    parser.add_argument("args", nargs="*", help="[CONFIG.yaml] [key=value ...]")
    launcher = parser.add_argument_group(
        "torchrun", "start the workers under torchrun's agent in this process (one line per "
        "failure, no launcher traceback); the options mean what torchrun's do")
    for option, metavar in TORCHRUN_OPTIONS.items():
        launcher.add_argument(option, metavar=metavar)
    ns = parser.parse_args(argv)
    launcher_args = [item for option in TORCHRUN_OPTIONS
                     if (value := getattr(ns, option.strip("-").replace("-", "_"))) is not None
                     for item in (option, value)]
    if launcher_args and ns.print_config:
        parser.error("--print-config runs no workers: give it without the torchrun options")
    try:
        if ns.from_verl or ns.verl:
            ns.args = translated_verl_args(ns.from_verl, ns.args)
        if launcher_args:   # the config's checks (tp x sp dividing the workers) read the count
            ns.args = with_launcher_world(launcher_args, ns.args)
        # Under dagrl's torchrun launcher too: a config error is found once, before any worker.
        cfg = load_cli_config(ns.args)
    except (ConfigError, DatasetError) as err:
        # A bad config, or a data file it lists that is missing (found before torch loads).
        # Under torchrun every rank finds the same error: rank 0 says it (and torchrun's
        # summary shows it, from the error file torchrun gives each worker).
        config_error = isinstance(err, ConfigError)
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr)
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            from dagrl.runtime.failures import Failure, write_elastic_error_file

            write_elastic_error_file(Failure.of(err), None)
            if os.environ.get("RANK", "0") != "0":
                # torchrun stops every worker when one exits: let rank 0 say it first.
                time.sleep(5.0)
        if ns.debug:
            raise
        return 2 if config_error else 1
    if ns.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    if cfg.trainer.async_trainer_threads:   # the workers started from here inherit it
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if launcher_args:
        from dagrl.runtime.torchrun_launcher import launch_torchrun

        # The files and the reward function once, here, before torchrun starts a worker per
        # rank to import the model code and check everything again.
        if _files_refused(cfg, ns.debug):
            return 1
        return launch_torchrun(launcher_args, ns.args, ns.debug)
    from dagrl.runtime.distributed import env_world

    if env_world() is not None:   # started by torchrun: this process is one worker
        from dagrl.runtime.process import torchrun_main

        code = torchrun_main(cfg, ns.debug)
        # Training is over and the process group is destroyed. Skip the interpreter's teardown:
        # some C++ thread left by torch's import machinery sometimes aborts the process there
        # ("terminate called without an active exception", ~1 run in 3 under pytest), which
        # torchrun reports as a failed run although every step and file was written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return _launch(cfg, ns.debug)


def _files_refused(cfg: Config, debug: bool) -> bool:
    """input_checks.check_file_inputs in this process: True when it refused (one line said)."""
    from dagrl.runtime.failures import Failure, report
    from dagrl.runtime.input_checks import check_file_inputs

    try:
        check_file_inputs(cfg)
    except Exception as err:
        failure = Failure.of(err)
        if not failure.user:   # a bug: its traceback, as the workers would show it
            raise
        report(failure, None, debug)
        return True
    return False


def _launch(cfg: Config, debug: bool) -> int:
    """Run in this process (one worker) or as the Ray driver; any failure is one line (and a
    hint saying where its traceback went)."""
    from dagrl.runtime.failures import (
        INTERRUPTED_EXIT,
        Failure,
        Terminated,
        WorkerFailed,
        append_run_log,
        interrupted_line,
        interrupts_once,
        report,
        was_interrupted,
    )
    from dagrl.runtime.launch import Outcome, launch

    outcome = Outcome()
    try:
        with interrupts_once():
            launch(cfg, outcome)
    except Terminated as err:
        message = "stopped by SIGTERM; the workers (and Ray) were shut down"
        print(f"error: {message}", file=sys.stderr)
        append_run_log(outcome.run_dir, message)
        return int(err.code)
    except (Exception, KeyboardInterrupt) as err:
        if was_interrupted(err):   # Ctrl-C: not an error; where it stopped, how to go on
            line = interrupted_line(outcome.run_dir, cfg.trainer.checkpoint_dir)
            print(line, file=sys.stderr)
            append_run_log(outcome.run_dir, line)
            return INTERRUPTED_EXIT
        failure = err.failure if isinstance(err, WorkerFailed) else Failure.of(err)
        # A bug (not a user error) with nowhere to log it: the traceback is all there is.
        report(failure, outcome.log, debug or (outcome.log is None and not failure.user))
        return 1
    return 0


class _CallableModule(types.ModuleType):
    """`dagrl.train` is this module (`python -m dagrl.train`, `torchrun -m dagrl.train`) and the
    Python API's function at once: importing a submodule makes it the package's attribute, so
    calling the module calls dagrl.api.train (README: Python API)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from dagrl.api import train

        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
