"""Save and resume for the worker (runtime/worker.py): what a checkpoint holds (every trained
policy's actor and critic, the data position, the policies' versions, the KL controller's state)
and how a run continues from one. The ranks that train do this (async: the trainer side); the
files and their atomic commit are runtime/checkpoint.py's.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

from dagrl.engines.models import plain_config
from dagrl.observe.loggers import GENERATIONS_FILE
from dagrl.observe.run_files import cut_jsonl
from dagrl.runtime.checkpoint import CheckpointError, Stateful, resolve_resume
from dagrl.runtime.failures import interrupts_deferred
from dagrl.runtime.model_identity import model_identity


class CheckpointedWorker:
    """The Worker's checkpoint methods (a part of the Worker, kept in its own file)."""

    def trained_engines(self) -> dict:
        """The engines a checkpoint holds, by name: actor, critic, and `<model>:actor` /
        `<model>:critic` of each extra policy."""
        out = {}
        bundles = {"": self.engines, **self.model_engines}
        for model, engines in bundles.items():
            for name in ("actor", "critic"):
                engine = getattr(engines, name)
                if engine is not None:
                    out[f"{model}:{name}" if model else name] = engine
        return out

    def stateful_engines(self) -> dict[str, Stateful]:
        return {name: Stateful(e.model, e.optimizer, e.scheduler)
                for name, e in self.trained_engines().items()}

    def save_checkpoint(self, step: int) -> Path:
        e = self.engines
        state = {"loader": self.source.position(), "world_size": self.world_size,
                 "versions": {name: engine.version
                              for name, engine in self.trained_engines().items()},
                 "kl_controller": e.kl_controller.state_dict() if e.kl_controller else None}
        if self.placement.kind == "trainer":
            # What a resume does with the groups generated but not yet trained on.
            state["async"] = {"trainer_ranks": list(self.side.ranks),
                              "in_flight_groups": "regenerated"}
        began = time.perf_counter()
        with interrupts_deferred():   # Ctrl-C: this checkpoint first
            path = self.checkpointer.save(step, self.stateful_engines(), state,
                                          hf_files=self.engines.write_hf_files,
                                          manifest=self.manifest_entries)
        self.log(f"checkpoint: step {step} -> {path} ({time.perf_counter() - began:.1f} s)")
        return path

    @functools.cached_property
    def manifest_entries(self) -> dict:
        """What the manifest records beside its files: the actor's model (compared before a
        resume builds anything: runtime/input_checks.py) and the layout that wrote it. The
        same for the whole run: computed once (hashing a large vocabulary takes a moment)."""
        e, a = self.engines, self.cfg.actor
        return {"model": model_identity(plain_config(e.actor.model.config), e.tokenizer,
                                        self.cfg.model.path),
                "layout": {"workers": self.world_size, "mode": self.cfg.trainer.mode,
                           "trainer_ranks": list(self.side.ranks),
                           "tensor_parallel_size": a.tensor_parallel_size,
                           "sequence_parallel_size": a.sequence_parallel_size}}

    def resume(self) -> tuple[int, dict | None]:
        """Load the checkpoint `trainer.resume` selects into the trained engines; returns its
        step and data position ((0, None): none). The run's logs are cut back to that step."""
        step, position = self._load_checkpoint()
        if self.is_lead:
            self._cut_logs(step if self.resumed_from is not None else -1)
        return step, position

    def _cut_logs(self, last_step: int) -> None:
        """The checkpoint is the run's truth: records past its step (the steps about to be run
        again, or an earlier attempt's when there is no checkpoint) go, damaged lines are
        skipped with one warning line each file."""
        for name in ("metrics.jsonl", GENERATIONS_FILE):
            path = self.run_dir / name
            dropped, contents = cut_jsonl(path, last_step)
            if contents.skipped:
                self.log_event("warning: " + contents.skipped_line(path))
            if dropped and last_step < 0:
                self.log(f"{path}: {dropped} record(s) of an earlier attempt dropped (it left "
                         "no checkpoint: this run starts over)")

    def _load_checkpoint(self) -> tuple[int, dict | None]:
        self.resumed_from = None
        resume = self.cfg.trainer.resume
        if resume == "auto":   # the newest that loads completely, falling back past damage
            found = self.checkpointer.load_newest(self.stateful_engines(), self.log_event)
            if found is None:
                return 0, None
            path, state = found
        else:
            path = resolve_resume(resume, self.checkpoint_root)
            if path is None:
                return 0, None
            state = self.checkpointer.load(path, self.stateful_engines())
        self.resumed_from = path
        if not isinstance(state.get("loader"), dict):
            raise CheckpointError(f"checkpoint {path}: no dataloader position")
        trained = self.trained_engines()
        for name, version in state["versions"].items():
            trained[name].version = version
        e = self.engines
        if e.kl_controller is not None and state["kl_controller"] is not None:
            e.kl_controller.load_state_dict(state["kl_controller"])
        step = int(state["step"])
        in_flight = ("; the groups in flight then are generated again"
                     if self.placement.kind != "all" else "")
        self.log(f"resumed from {path} (step {step}, saved by {state['world_size']} worker(s), "
                 f"now {self.world_size}{in_flight})")
        return step, state["loader"]
