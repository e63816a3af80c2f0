"""Checkpoints with orbax: the whole training state, restorable onto any mesh that fits the model.

A checkpoint holds the TrainState (step = data position, fp32 params, optimizer state, loss scale) and the resolved
config. Dropout keys are derived from (seed, step), so restoring the step restores the RNG too. orbax writes each
step into a temporary directory and renames it when complete, so a crash never leaves a half-written step that
looks finished. Restoring reads the arrays straight into the shardings of the current mesh.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from mtx.config import Config


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
        step = int(jax.device_get(state.step))
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(cfg.to_dict())))

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def saved_config(self, step: int) -> Config:
        restored = self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        return Config.from_dict(restored["config"])

    def restore(self, abstract_state, cfg: Config, step: int | None = None):
        """The state at `step` (default: latest), laid out like `abstract_state` (shapes and target shardings)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise ValueError(f"--load {self.directory} holds no checkpoint; pass a directory written by --save.")
        check_compatible(self.saved_config(step).model, cfg.model, self.directory)
        restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
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
