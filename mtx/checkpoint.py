"""Checkpoints with orbax: the whole training state, restorable onto any mesh that fits the model.

A checkpoint holds the TrainState (step = data position, fp32 params, optimizer state, loss scale) and the resolved
config. Dropout keys are derived from (seed, step), so restoring the step restores the RNG too. orbax writes each
step into a temporary directory and renames it when complete, so a crash never leaves a half-written step that
looks finished. Restoring reads the arrays straight into the shardings of the current mesh.

Once a step is finished mtx records every file of it with its size (`mtx_files.json` in the step), so a step
damaged later (a file deleted, truncated or emptied) is found before anything is loaded (`Checkpointer.problem`):
resuming then falls back to the newest intact step (mtx/run.py). A step without that record (its run died between
the step's end and the record) is checked for readable config and metadata and for empty files instead.

Saves are synchronous unless `async_save` (--async-save): orbax then writes the step on a background thread while
training goes on, and `wait` (at the next save, and before the run ends or stops) finishes it and records its files.
With `keep_last` (--keep-last-n-checkpoints) `wait` then deletes the older steps that only mtx wrote (see `_prune`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from mtx.architecture import ADDED_FIELDS, NOT_SHAPING
from mtx.config import FIELD_TYPES, SCHEDULE_FIELDS, Config, ModelConfig
from mtx.config_checks import check_saved_combinations
from mtx.distributed import is_main_process
from mtx.errors import first_line
from mtx.files import MANIFEST, looks_like_step
from mtx.schema_checks import check_field


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, found while loading it (after the checks of mtx.run.prepare)."""


@contextlib.contextmanager
def _orbax_quiet(asyncio_too: bool = False):
    """orbax's warnings (absl) off while it scans steps: a broken step gets mtx's own one line instead. With
    `asyncio_too`, also asyncio's report of every read task that failed beside the first (a step whose bytes are
    damaged: each array's read fails, and asyncio logs each one's traceback at shutdown)."""
    loggers = [logging.getLogger("absl")] + ([logging.getLogger("asyncio")] if asyncio_too else [])
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL if logger.name == "asyncio" else logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


# What inference keeps of the saved config besides the model (mtx/loading.py): the tokenizer, the precision, the micro
# batch, how a step computes, and BERT's masked positions (the head's size). The rest (the pipeline's layout and
# schedule, sequence parallelism and the overlap of its collectives, the optimizer's sharding, processes, data
# handling, checkpoint and run settings) was training's choice, which another mesh may not allow: it starts from the
# defaults, so any checkpoint loads on any mesh.
KEPT_FOR_INFERENCE = ("micro_batch_size", "seed", "bf16", "fp16", "recompute_granularity", "recompute_activations",
                      "scan_layers", "use_flash_attn", "mlm_head_positions", "mask_prob", "vocab_file", "merge_file",
                      "tokenizer_type", "tokenizer_model")
# Besides the model, all that is read from a saved config, so checked before a step counts as intact: what
# inference keeps, and what a resume compares or keeps (the global batch; the lr and weight-decay schedules,
# mtx/resume.py; the seed and micro batch are kept already).
READ_FROM_CHECKPOINTS = ("global_batch_size", *KEPT_FOR_INFERENCE, *SCHEDULE_FIELDS)


def config_problem(saved) -> str | None:
    """What is wrong with a config as mtx saved it (a step's, or a run directory's config.json), None if nothing:
    another shape, an unknown field, a model field missing, or a value of a type or out of a range no run could have
    saved (an edited file) among the fields read from it: the model's and READ_FROM_CHECKPOINTS (what a resume and
    evaluation take); or such values together (check_saved_combinations). The file's fault, not a flag's. Only
    those: a check of other fields added since the file was written must not break it."""
    try:
        cfg = Config.from_dict(saved)
    except (ValueError, TypeError) as e:
        return f"its config {first_line(e)}"
    missing = [f.name for f in dataclasses.fields(ModelConfig)
               if f.name not in saved.get("model", {}) and f.name not in ADDED_FIELDS]
    if missing:
        return f"its config lacks model.{missing[0]}"
    try:
        for f in dataclasses.fields(cfg.model):
            check_field(f.name, FIELD_TYPES[f.name], getattr(cfg.model, f.name))
        for name in READ_FROM_CHECKPOINTS:
            check_field(name, FIELD_TYPES[name], cfg.value(name))
    except (ValueError, TypeError) as e:
        return f"its config has a value mtx refuses: {first_line(e)}"
    try:
        check_saved_combinations(cfg)
    except ValueError as e:
        return f"its config has values mtx refuses together: {first_line(e)}"
    return None


class Checkpointer:
    """The orbax checkpoints of one directory: save (sync or async), record, prune, check and restore steps."""

    def __init__(self, directory: str | Path, *, async_save: bool = False, keep_last: int | None = None,
                 keep_every: int | None = None):
        self.directory = Path(directory).absolute()
        self.async_save, self.keep_last, self.keep_every = async_save, keep_last, keep_every
        self._unrecorded: list[int] = []  # steps saved here whose files are not recorded yet
        with _orbax_quiet():  # its warning about a step it cannot read: `problem` says what is wrong, in its line
            self._manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
                create=True, max_to_keep=None, enable_async_checkpointing=async_save))

    def steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, state, cfg: Config) -> None:
        """Saves the state and config as step `state.step`; returns once the step is on disk and recorded, or with
        async_save as soon as its arrays are copied off the devices (`wait` finishes it)."""
        self.wait()  # the previous step is finished (long since, at any save interval): record its files first
        step = int(jax.device_get(state.step))
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(cfg.to_dict())))
        self._unrecorded.append(step)
        if not self.async_save:
            self.wait()

    def wait(self) -> None:
        """Waits for the save in flight, records the files of the steps saved here (only these: a step found
        without its record may have been damaged since it was written), then with keep_last deletes the steps no
        longer kept. A Checkpointer that only reads writes nothing."""
        self._manager.wait_until_finished()
        steps, self._unrecorded = self._unrecorded, []
        if not steps or not is_main_process():
            return
        for step in steps:
            path = self.directory / str(step)
            if (path / "commit_success.txt").exists() and not (path / MANIFEST).exists():
                files = {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}
                tmp = path / f"{MANIFEST}.tmp"
                tmp.write_text(json.dumps(files, indent=0) + "\n")
                os.replace(tmp, path / MANIFEST)
        if self.keep_last is not None:
            self._prune()

    def _prune(self) -> None:
        """Deletes the steps that --keep-last-n-checkpoints / --keep-checkpoint-every no longer keep. Only a step that
        matches its file record exactly (intact, and nothing in it that mtx did not write) is ever deleted, and only
        once `keep_last` newer steps are intact: the newest step, a broken or unrecorded step, a step that a fallback
        from broken newer ones would resume and a step that is a link are kept. Each goes in two moves, renamed to
        <step>.deleting (no longer a step to any reader) and then removed; a leftover from a run killed in between
        goes next time."""
        for leftover in self.directory.glob("*.deleting"):
            if re.fullmatch(r"\d+\.deleting", leftover.name):  # only what this method renamed (5.old.deleting: not)
                shutil.rmtree(leftover, ignore_errors=True)
        steps = sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and p.is_dir())
        intact = [s for s in steps if self._recorded_problem(self.directory / str(s)) is None]
        kept = set(intact[-self.keep_last:]) | set(steps[-1:])
        kept |= {s for s in steps if self.keep_every and s % self.keep_every == 0}
        doomed = [s for s in intact if s not in kept and self._only_recorded_files(self.directory / str(s))
                  and not (self.directory / str(s)).is_symlink()]  # (a link put there: its files are not mtx's here)
        for step in doomed:
            path = self.directory / str(step)
            trash = path.with_name(f"{step}.deleting")
            path.rename(trash)
            shutil.rmtree(trash)
        if doomed:
            self._manager.reload()  # orbax's list of steps

    def intact_step(self, wanted: int | None, load: str | Path) -> tuple[int, dict[int, str]]:
        """(The step to read: `wanted` (--ckpt-step), else the newest intact one; the broken steps passed over, with
        what is wrong with each). One-line ValueError naming the fix when `wanted` is missing or broken, or when no
        step is intact. `load` is the directory as the user wrote it."""
        steps = self.steps()
        if not steps:
            raise no_checkpoint(load)
        if wanted is not None and wanted not in steps:
            raise ValueError(f"--load {load} has no step {wanted} (it has {steps}); pass one of those to --ckpt-step.")
        broken = {}
        for step in [wanted] if wanted is not None else reversed(steps):
            if (problem := self.problem(step)) is None:
                return step, broken
            broken[step] = problem
        intact = [s for s in steps if s not in broken and self.problem(s) is None]
        step, problem = next(iter(broken.items()))
        raise ValueError(f"--load {load}: step {step} is broken ({problem}); "
                         + (f"pass --ckpt-step {intact[-1]}, the newest intact step." if intact else
                            "no step is intact: start a new run."))

    def problem(self, step: int) -> str | None:
        """Why `step` cannot be loaded (a file missing, truncated or emptied; an unreadable or incomplete config), in
        a few words; None when it is intact."""
        path = self.directory / str(step)
        if (path / MANIFEST).exists():
            if (problem := self._recorded_problem(path)) is not None:
                return problem
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
        return config_problem(saved)

    @staticmethod
    def _recorded_problem(path: Path) -> str | None:
        """What differs between a step and its file record (a file missing or of another size), None when they
        agree; a step without a readable record is never matched."""
        try:
            files = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            return f"its file record {MANIFEST} is unreadable"
        if not isinstance(files, dict) or not all(isinstance(n, str) and type(size) is int and size >= 0
                                                  for n, size in files.items()):
            return f"its file record {MANIFEST} is not an object of file sizes in bytes"
        for name, size in files.items():
            if not (path / name).is_file():
                return f"{name} is missing"
            if (found := (path / name).stat().st_size) != size:
                return f"{name} has {found} bytes, {size} when saved"
        return None

    @staticmethod
    def _only_recorded_files(path: Path) -> bool:
        """Whether a step holds nothing but its recorded files and the record (nobody added anything)."""
        recorded = set(json.loads((path / MANIFEST).read_text())) | {MANIFEST}
        return all(str(f.relative_to(path)) in recorded for f in path.rglob("*") if not f.is_dir())

    def saved_config(self, step: int) -> Config:
        return Config.from_dict(self._saved_dict(step))

    def _saved_dict(self, step: int) -> dict:
        """The config saved with `step`, as written (sections of fields)."""
        return self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def restore(self, abstract_state, cfg: Config, step: int | None = None):
        """The state at `step` (default: latest), laid out like `abstract_state` (shapes and target shardings)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise no_checkpoint(self.directory)
        check_compatible(self.saved_config(step), cfg.model, self.directory)
        return self._read(step, self._manager, ocp.args.StandardRestore(abstract_state))

    def restore_params(self, abstract_state, cfg: Config, step: int):
        """Only the fp32 weights of `step` (--finetune, --no-load-optim), laid out like `abstract_state.params`; the
        optimizer state, two thirds of the bytes, is not read."""
        check_compatible(self.saved_config(step), cfg.model, self.directory)
        item = {"params": abstract_state.params}
        args = ocp.args.PyTreeRestore(item=item, partial_restore=True,
                                      restore_args=ocp.checkpoint_utils.construct_restore_args(item))
        # (a manager of its own: orbax binds a manager's item to one handler, and this one saves with StandardSave)
        with _orbax_quiet():  # its warnings about a read-only manager ("Given directory is read only"): by design
            reader = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(read_only=True))
            try:
                return self._read(step, reader, args)["params"]
            finally:
                reader.close()

    def _read(self, step: int, manager, args):
        try:
            with _orbax_quiet(asyncio_too=True):
                restored = manager.restore(step, args=ocp.args.Composite(state=args))
        except Exception as e:  # damage the file record could not see (same size, different bytes)
            older = [s for s in self.steps() if s < step]
            raise CheckpointError(
                f"--load {self.directory}: step {step} could not be read ({_first_line(e)}); "
                + (f"pass --ckpt-step {older[-1]} to resume from the step before." if older else
                   "it is the only step: start a new run.")) from e
        return restored["state"]

    def close(self) -> None:
        """Finishes the save in flight (and its record) and releases orbax's threads."""
        self.wait()
        self._manager.close()


def check_compatible(saved_config: Config, current, directory) -> None:
    """Refuses to load a checkpoint of a different architecture (its saved config's model against `current`), naming
    every differing field and the flags that would match it (the model type first: it explains the rest; the
    vocabulary by the tokenizer flags of the saved run, which set it)."""
    saved = saved_config.model
    skipped = ("seq_length", *NOT_SHAPING)  # nor does the length of the sequences trained on

    def value(m, name):  # a learned position table's rows as the model has them (unset: --seq-length's)
        return m.max_positions if name == "max_position_embeddings" and not m.rope else getattr(m, name)

    # (a setting of a feature off in both models changes neither: a preset's --num-query-groups under
    # --no-group-query-attention once refused a checkpoint, naming a flag mtx then refused)
    differ = [f.name for f in dataclasses.fields(saved) if f.name not in skipped
              and (saved.acts(f.name) or current.acts(f.name)) and value(saved, f.name) != value(current, f.name)]
    if not differ:
        return
    where = f"--load {directory} was saved with"
    if "model_type" in differ:
        raise ValueError(f"{where} model_type={saved.model_type!r} but this run has {current.model_type!r}; pass "
                         f"--config of a {saved.model_type} preset (or --use-checkpoint-args), or load a "
                         f"{current.model_type} checkpoint.")
    if differ == ["vocab_size"]:  # train.py takes it from the tokenizer: --vocab-size would not change it
        from mtx.data.tokenizer import tokenizer_flags

        flags = tokenizer_flags(saved_config.data, saved.vocab_size) or "--vocab-file, --merge-file, --tokenizer-type"
        raise ValueError(f"{where} vocab_size={saved.vocab_size} but this run's tokenizer has {current.vocab_size}; "
                         f"pass the tokenizer it was trained with ({flags}), or load a matching checkpoint.")
    from mtx.cli import flag_for  # the flags that set them as saved (train.py's parser; imported where used)

    saved_values = ", ".join(f"{name}={value(saved, name)!r}" for name in differ)
    # what turns a feature on or off, and the saved model's settings of the features it has
    flags = " ".join(flag_for(name, value(saved, name)) for name in differ if name != "vocab_size" and saved.acts(name))
    if "max_position_embeddings" in differ and current.seq_length > saved.max_positions:  # (a table cannot grow)
        flags += f" --seq-length {saved.max_positions}"
    raise ValueError(f"{where} {saved_values} but this run has "
                     f"{', '.join(repr(value(current, name)) for name in differ)}; pass {flags} (or "
                     "--use-checkpoint-args), or load a matching checkpoint.")


def say_passed_over(load, broken: dict[int, str], step: int, doing: str = "reading", *, file=None) -> None:
    """One line per broken step passed over for `step`, the newest intact one (`Checkpointer.intact_step`), from the
    main process: "step 8 is broken (...); <doing> step 6, the newest intact one." (stderr unless `file`)."""
    for s, problem in broken.items() if is_main_process() else ():
        print(f"mtx: --load {load}: step {s} is broken ({problem}); {doing} step {step}, the newest intact one.",
              file=file or sys.stderr)


def saved_step(load: str | Path, ckpt_step: int | None, written_by: str) -> tuple[int, Config]:
    """(The step to read, its saved Config) of the checkpoints in `load`: `ckpt_step`, else the newest intact one,
    the broken ones passed over said in a line each; no arrays are read. One-line ValueError if there is none (a
    directory `written_by` writes is named)."""
    if not is_checkpoint_dir(load):
        raise no_checkpoint(load, written_by)
    ckpt = Checkpointer(load)
    try:
        step, broken = ckpt.intact_step(ckpt_step, load)
        say_passed_over(load, broken, step)
        return step, ckpt.saved_config(step)
    finally:
        ckpt.close()


def no_checkpoint(load: str | Path, written_by: str = "--save") -> ValueError:
    """The one-line refusal of a --load that holds no checkpoint (a directory `written_by` does); one step of a
    checkpoint directory, given for the directory, is named as such."""
    path = Path(load)
    if looks_like_step(path) and is_checkpoint_dir(path.parent):
        return ValueError(f"--load {load} is step {path.name} of the checkpoints in {path.parent}; pass --load "
                          f"{path.parent} --ckpt-step {path.name}.")
    return ValueError(f"--load {load} holds no checkpoint; pass a directory written by {written_by}.")


def is_checkpoint_dir(path: str | Path) -> bool:
    """True if `path` holds at least one finished orbax step: a directory named by its step number that holds what a
    step holds (mtx's file record, orbax's metadata or the state), even damaged; a user's folder "4" is none."""
    path = Path(path)
    return path.is_dir() and any(looks_like_step(p) for p in path.iterdir())


def _first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {first_line(error)}"
