"""Checkpoints with orbax: the whole training state, restorable onto any mesh that fits the model.

A checkpoint holds the TrainState (step = data position, fp32 params, optimizer state, loss scale) and the resolved
config. Dropout keys are derived from (seed, step), so restoring the step restores the RNG too. orbax writes each
step into a temporary directory and renames it when complete, so a crash never leaves a half-written step that
looks finished. Restoring reads the arrays straight into the shardings of the current mesh.

Once a step is finished mtx records every file of it with its size (`mtx_files.json` in the step), so a step
damaged later (a file deleted, truncated or emptied) is found before anything is loaded (`Checkpointer.problem`):
resuming then falls back to the newest intact step (mtx/run.py). A step without that record (its run died between
the step's end and the record) is checked for readable config and metadata and for empty files instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from mtx.config import Config, ModelConfig
from mtx.distributed import is_main_process

MANIFEST = "mtx_files.json"  # in a finished step: {path relative to the step: size in bytes} of its every file


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, found while loading it (after the checks of mtx.run.prepare)."""


class Checkpointer:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(create=True, max_to_keep=None))

    def steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, state, cfg: Config) -> None:
        self.wait()  # the previous step is finished (long since, at any save interval): record its files first
        step = int(jax.device_get(state.step))
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(cfg.to_dict())))

    def wait(self) -> None:
        """Waits for the save in flight, then records the files of every finished step that lacks the record."""
        self._manager.wait_until_finished()
        if not is_main_process():
            return
        for step in self.steps():
            path = self.directory / str(step)
            if (path / "commit_success.txt").exists() and not (path / MANIFEST).exists():
                files = {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}
                tmp = path / f"{MANIFEST}.tmp"
                tmp.write_text(json.dumps(files, indent=0) + "\n")
                os.replace(tmp, path / MANIFEST)

    def problem(self, step: int) -> str | None:
        """Why `step` cannot be loaded (a file missing, truncated or emptied; an unreadable or incomplete config), in
        a few words; None when it is intact."""
        path = self.directory / str(step)
        if (path / MANIFEST).exists():
            try:
                files = json.loads((path / MANIFEST).read_text())
            except ValueError:
                return f"its file record {MANIFEST} is unreadable"
            for name, size in files.items():
                if not (path / name).is_file():
                    return f"{name} is missing"
                if (found := (path / name).stat().st_size) != size:
                    return f"{name} has {found} bytes, {size} when saved"
        else:
            empty = [f for f in sorted(path.rglob("*")) if f.is_file() and f.stat().st_size == 0]
            if empty:
                return f"{empty[0].relative_to(path)} is empty"
            try:
                json.loads((path / "state" / "_METADATA").read_text())
            except (OSError, ValueError):
                return "state/_METADATA is unreadable"
        try:
            saved = self._saved_dict(step)
        except Exception as e:  # orbax and JSON raise many kinds
            return f"its config is unreadable ({_first_line(e)})"
        missing = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in saved.get("model", {})]
        return f"its config lacks model.{missing[0]}" if missing else None

    def saved_config(self, step: int) -> Config:
        return Config.from_dict(self._saved_dict(step))

    def _saved_dict(self, step: int) -> dict:
        """The config saved with `step`, as written (sections of fields)."""
        return self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def restore(self, abstract_state, cfg: Config, step: int | None = None):
        """The state at `step` (default: latest), laid out like `abstract_state` (shapes and target shardings)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise ValueError(f"--load {self.directory} holds no checkpoint; pass a directory written by --save.")
        check_compatible(self.saved_config(step).model, cfg.model, self.directory)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state)))
        except Exception as e:  # damage the file record could not see (same size, different bytes)
            older = [s for s in self.steps() if s < step]
            raise CheckpointError(
                f"--load {self.directory}: step {step} could not be read ({_first_line(e)}); "
                + (f"pass --ckpt-step {older[-1]} to resume from the step before." if older else
                   "it is the only step: start a new run.")) from e
        return restored["state"]

    def close(self) -> None:
        self._manager.close()


def check_compatible(saved, current, directory) -> None:
    """Refuses to load a checkpoint of a different architecture, naming the first differing field."""
    for field in dataclasses.fields(saved):
        if field.name in ("hidden_dropout", "attention_dropout", "label_smoothing", "seq_length",
                          "init_method_std"):
            continue  # regularization, training length and init do not shape a parameter
        a, b = getattr(saved, field.name), getattr(current, field.name)
        if a != b:
            raise ValueError(f"--load {directory} was saved with {field.name}={a!r} but this run has {b!r}; "
                             f"pass --{field.name.replace('_', '-')} {a} or load a matching checkpoint.")


def is_checkpoint_dir(path: str | Path) -> bool:
    """True if `path` holds at least one finished orbax step."""
    path = Path(path)
    return path.is_dir() and any(p.is_dir() and p.name.isdigit() for p in path.iterdir())


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    text = text[0].split(" See full")[0][:200] if text else ""  # (tensorstore appends a long pointer)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
