"""Where mtx may write, checked before any device work: it never writes over a file it did not create.

A run directory (--save, --run-dir) must be new, empty, or hold only what mtx writes there: its config.json, its
metrics.jsonl, orbax checkpoint steps, W&B's wandb/ folder and the id of its W&B run, TensorBoard's event files
and mtx.plot's figures (`run_files` says which, as train.py prints it). Tools that write files
(mtx.data.preprocess) refuse existing outputs unless told to overwrite. Paths whose parent cannot be written, or
that run through a regular file, are refused up front.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import tempfile
from pathlib import Path

MARK = ("Software", "mtx.plot")  # the PNG tEXt entry that tells mtx.plot's figures from others
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
WANDB_ID = "wandb_run_id"  # the W&B run of a run directory, so that a resumed run logs into it (mtx/metrics.py)
RUN_LOCK = "mtx.lock"  # held by the run writing a run directory (mtx/run_lock.py)
CONFIG = "config.json"  # a run directory's resolved config (mtx/run.py)
METRICS = "metrics.jsonl"  # its metrics, a line per --log-interval (mtx/metrics.py)
MANIFEST = "mtx_files.json"  # in a finished step: {path relative to the step: size in bytes} of its every file


def check_run_dir(path: str | Path, flag: str) -> None:
    """Refuses a run directory that is a file, sits where nothing can be written, or holds files mtx did not write."""
    _in_one_line(_check_run_dir, Path(path), flag)


def _in_one_line(check, path: Path, flag: str) -> None:
    """check(path, flag), with the OS's own refusals to look (a name too long, a loop of links) in one line."""
    try:
        check(path, flag)
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}; choose another path.") from None


def _check_run_dir(path: Path, flag: str) -> None:
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a directory; pass a directory path.")
    if path.is_dir():
        foreign = sorted(entry.name for entry in path.iterdir() if not _written_by_mtx(entry))
        if foreign == [CONFIG] and any(_is_step(entry) for entry in path.iterdir()):
            raise ValueError(f"{flag} {path}: its config.json is not the one mtx wrote (damaged or replaced), beside "
                             "its checkpoints; put back the run's config.json (each step keeps a copy: "
                             "<step>/config/metadata), or choose a new directory.")
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise ValueError(f"{flag} {path} holds files mtx did not write ({shown}); mtx never writes over them: "
                             "choose a new or empty directory.")
    check_writable(path, flag, a_run_dir=True)


def check_new_files(paths, flag: str, *, overwrite: bool = False, overwrite_flag: str = "--overwrite") -> None:
    """Refuses output files that exist already (unless `overwrite`) or could not be created."""
    paths = [Path(p) for p in paths]
    existing = [str(p) for p in paths if p.exists()]
    if existing and not overwrite:
        raise ValueError(f"{flag}: {', '.join(existing)} exist(s) already; choose another {flag} or pass "
                         f"{overwrite_flag} to replace them.")
    for p in paths:
        if p.is_dir():
            raise ValueError(f"{flag}: {p} is a directory; choose another {flag}.")
        check_writable(p.parent, flag)


def check_json_lines(path: str | Path, flag: str, keys: tuple[str, ...]) -> None:
    """Refuses a results file to append to unless it is new, or holds results of the same tool already (JSON lines,
    each an object with the `keys` of the tool's records): appending to any other file, even JSON lines of another
    kind (a corpus for mtx.data.preprocess), would change a file mtx did not write."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; pass a file to append the results to.")
    if path.exists():
        try:
            records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, ValueError):
            records = None
        if records is None or not all(isinstance(r, dict) and set(keys) <= r.keys() for r in records):
            raise ValueError(f"{flag} {path} exists and is not a JSON-lines file of this tool's results (records "
                             f"with {', '.join(keys)}); mtx appends only to those: choose a new file.")
        if not os.access(path, os.W_OK):
            raise ValueError(f"{flag} {path} is not writable; choose a file you can write.")
    check_writable(path.parent, flag)


TRACE_FLAGS = ("--tensorboard-dir", "--profile")  # outputs a run directory may hold inside: event files, traces
PROBE = ".mtx-probe-"  # the directory check_writable makes and removes to see that something can be created


def check_writable(path: str | Path, flag: str, *, a_run_dir: bool = False) -> None:
    """Refuses a path inside a checkpoint step, in a run directory (unless `a_run_dir`: the path may be one itself,
    or `flag` writes traces: `TRACE_FLAGS`), that runs through a regular file, or whose nearest existing ancestor
    cannot be written: not writable to this user, or nothing can be created there (a probe directory, `PROBE`, made
    and removed)."""
    _in_one_line(lambda path, flag: _check_writable(path, flag, a_run_dir), Path(path).absolute(), flag)


def check_outside(path: str | Path, run_dir: str | Path, flag: str) -> None:
    """Refuses an output of a run inside its own run directory (made yet or not), where it would keep the run's
    resume from taking the directory (files mtx did not write there)."""
    where = Path(path).expanduser().absolute()
    if where.is_relative_to(Path(run_dir).absolute()):
        raise ValueError(_in_run_dir(flag, where, run_dir))


def _in_run_dir(flag: str, path: Path, run) -> str:
    return (f"{flag} {path} would put files in the run directory {run}, which a resumed run would then refuse (files "
            "mtx did not write there); choose a path outside it.")


def _check_writable(path: Path, flag: str, a_run_dir: bool) -> None:
    if step := next((p for p in (path, *path.parents) if _is_step(p)), None):
        # files added to a step break it for nobody, but keep it from being pruned, and mix with the checkpoint
        raise ValueError(f"{flag} {path} is inside checkpoint step {step.name} of {step.parent}; choose a directory "
                         "outside the checkpoint.")
    around = path.parents if a_run_dir else (path, *path.parents)
    if flag not in TRACE_FLAGS and (run := next((p for p in around if _is_run_dir(p)), None)):
        # a run directory holds only what a run writes there: anything else keeps that run from resuming
        raise ValueError(_in_run_dir(flag, path, run))
    ancestor = path
    while not ancestor.exists():
        if ancestor.is_symlink():  # a link to nothing: creating the directory would fail on it
            raise ValueError(f"{flag} {path}: {ancestor} is a link to {os.readlink(ancestor)}, which does not "
                             "exist; choose another path (or create the link's target).")
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{flag} {path}: {ancestor} is a file, not a directory; choose another path.")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {ancestor} is not writable; choose a directory you can write.")
    try:  # what access() cannot tell: a pseudo-filesystem (/proc, /sys) or a mount refusing new files, as root too
        os.rmdir(tempfile.mkdtemp(prefix=PROBE, dir=ancestor))
    except OSError as e:
        raise ValueError(f"{flag} {path}: nothing can be created in {ancestor} ({e.strerror or e}); choose a "
                         "directory you can write.") from None


# What an orbax step directory holds, one of them even when damaged: mtx's file record (MANIFEST), orbax's
# metadata, its items, its commit marker.
OWN_STEP_MARKS = (MANIFEST, "_CHECKPOINT_METADATA", "commit_success.txt")  # names only mtx and orbax write
STEP_MARKS = OWN_STEP_MARKS + ("state", "config")


def looks_like_step(entry: Path) -> bool:
    """A directory named by its step number holding what a step holds: a user's folder "4" is none."""
    return entry.is_dir() and entry.name.isdigit() and any((entry / mark).exists() for mark in STEP_MARKS)


def _is_step(path: Path) -> bool:
    """A checkpoint step for sure: numbered, holding mtx's record or orbax's own metadata (a folder 2024/ of a user
    holding config/ is none)."""
    return looks_like_step(path) and any((path / mark).exists() for mark in OWN_STEP_MARKS)


def _written_by_mtx(entry: Path) -> bool:
    """Whether a run directory entry is one mtx writes: its config, its metrics, an orbax checkpoint step, trackers'
    files, mtx.plot's figures."""
    if entry.name == CONFIG:
        return is_mtx_config(entry)
    if entry.name.startswith(PROBE):  # another process's check_writable, about to remove it
        return True
    if entry.name in (METRICS, METRICS + ".tmp"):  # (a tmp: a resume cut short while it rewrote the file)
        return is_mtx_metrics(entry)
    if entry.name in (WANDB_ID, WANDB_ID + ".tmp", RUN_LOCK) or entry.name.startswith(f".{RUN_LOCK}."):
        return entry.is_file()  # (the last: a lock being written, mtx/run_lock.py)
    if entry.is_dir() and entry.name.isdigit() and not any(entry.iterdir()):
        return True  # a step emptied since it was written (a resume sets it aside; nothing in it to lose)
    if looks_like_step(entry) or entry.is_dir() and (".orbax-checkpoint-tmp" in entry.name
                                                    or re.fullmatch(r"\d+\.(broken\d*|deleting)", entry.name)):
        return True  # a checkpoint step (orbax names its steps by number; unfinished ones get a tmp suffix; a
        # broken one that a resumed run set aside, mtx/resume.py; one being deleted, mtx/checkpoint.py `_prune`)
    if entry.name in ("wandb", "profile") and entry.is_dir():
        return True  # Weights & Biases' files without --wandb-save-dir (mtx/metrics.py); --profile's trace without
        # --tensorboard-dir (mtx/run.py)
    if entry.is_file() and entry.suffix == ".png":  # figures mtx.plot drew into the run directory (--out RUN_DIR)
        return made_by_mtx_plot(entry)
    if entry.is_file() and _TRACKER_FILE.fullmatch(entry.name):  # --tensorboard-dir the run directory itself
        return True
    if entry.is_dir():  # a --tensorboard-dir inside the run directory (README's example): event files and traces only
        files = [f for f in entry.rglob("*") if not f.is_dir()]
        return bool(files) and all(_TRACKER_FILE.fullmatch(f.name) for f in files)
    return False


# What mtx's TensorBoard writer and --profile's trace put in a --tensorboard-dir
_TRACKER_FILE = re.compile(r"events\.out\.tfevents\..+|.+\.xplane\.pb|.+\.trace\.json\.gz|perfetto_trace\.json\.gz")


def is_mtx_metrics(path: Path) -> bool:
    """Whether `path` is a metrics.jsonl that mtx wrote: empty, or its first line a JSON record with a step."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
        record = json.loads(first) if first.strip() else {"step": 0}
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "step" in record


def _is_run_dir(path: Path) -> bool:
    """A directory a run of mtx wrote into: its config.json or metrics.jsonl is mtx's."""
    return is_mtx_config(path / CONFIG) or (path / METRICS).is_file() and is_mtx_metrics(path / METRICS)


def same_path(a, b) -> bool:
    """Whether two paths name one file or directory, however spelt (relative, a trailing slash, a link)."""
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def is_mtx_config(path: Path) -> bool:
    """Whether `path` is a config.json that mtx wrote (a run directory's, or a checkpoint's)."""
    try:
        sections = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(sections, dict) and {"model", "parallel", "optimizer", "training"} <= set(sections)


def run_files(cfg, run_dir) -> str:
    """The line that says where the run's files go: its directory (--save, else --run-dir, else runs/<time>) and the
    tracker directories outside it."""
    t, log, folder = cfg.training, cfg.logging, lambda path: os.path.join(path, "")  # "runs/x/" once
    files = [CONFIG, METRICS, *([WANDB_ID] if log.wandb_project else []),
             *(["checkpoints"] if t.save else [])]
    line = f"mtx: run directory {folder(run_dir)} ({', '.join(files)})"
    if log.tensorboard_dir:
        line += f"; TensorBoard events in {folder(log.tensorboard_dir)}"
    if log.wandb_project:
        line += f"; Weights & Biases files in {folder(log.wandb_save_dir or run_dir)}"
    return line


def json_line(record) -> str:
    """record as one line of strict JSON: a float that is not finite (a diverged loss, its perplexity) written as
    null, which every JSON reader takes (Python's NaN and Infinity are not JSON)."""
    def finite(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        return [finite(v) for v in x] if isinstance(x, (list, tuple)) else x

    return json.dumps(finite(record), allow_nan=False)


def forget_new_run_dir(path: Path) -> None:
    """Takes back a run directory this run created and never trained in: its config.json, (empty) metrics and lock
    go, then the directory if nothing else is in it (a W&B folder, say, stays)."""
    if not path.is_dir():  # taken back already
        return
    for name in (CONFIG, METRICS, RUN_LOCK):
        (path / name).unlink(missing_ok=True)
    if not any(path.iterdir()):
        path.rmdir()


def expand_home(value):
    """A path (or a tuple of them: a blend's weights are left as they are) with a leading ~ or ~user made that home
    directory; one naming no home directory here is left as it was (unexpanded_home finds it)."""
    if isinstance(value, (tuple, list)):
        return type(value)(expand_home(v) for v in value)
    return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value


def unexpanded_home(value) -> str | None:
    """The first path of `value` (one, or a tuple) still starting with ~ after expand_home: ~nosuchuser, ~+."""
    return next((v for v in (value if isinstance(value, (tuple, list)) else (value,))
                 if isinstance(v, str) and v.startswith("~")), None)


def not_a_file(path: str | Path) -> str:
    """What a path that is no regular file is, for a one-line refusal: a directory, another kind of file (a FIFO,
    a device, which reading would block on or consume), or nothing."""
    path = Path(path)
    return "is a directory" if path.is_dir() else "is not a regular file" if path.exists() else "no such file"


def new_temporary(path: str | Path) -> str:
    """A new file beside `path` (created here, exclusively, under a name no other file has), readable as `path` will
    be (the umask's mode, not mkstemp's 0600): an output is written there whole, then renamed onto `path`, so no file
    of the user's is ever written or removed on the way."""
    path = Path(path)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(temporary, 0o666 & ~_umask())
    return temporary


def _umask() -> int:
    """The process's umask, read where Linux shows it (setting it to read it would briefly change it for every
    thread), else by setting it back."""
    try:
        return int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                        if line.startswith("Umask:")), 8)
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0)
        os.umask(umask)
        return umask


def made_by_mtx_plot(path: Path) -> bool:
    """Whether `path` is a PNG carrying mtx.plot's text chunk (Software = mtx.plot)."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    if not data.startswith(PNG_SIGNATURE):
        return False
    at = len(PNG_SIGNATURE)
    while at + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        if kind == b"tEXt" and body == f"{MARK[0]}\x00{MARK[1]}".encode("latin-1"):
            return True
        if kind in (b"IDAT", b"IEND"):  # text chunks come before the image data in matplotlib's files
            return False
        at += 12 + length
    return False


def read_text(path: str | Path, flag: str, fix: str) -> str:
    """The UTF-8 text of the file a flag names, or a one-line ValueError ending in `fix`: no regular file, unreadable,
    not UTF-8, or binary that decodes as UTF-8 (NUL bytes: a .bin of token ids, an archive)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{flag} {path}: {not_a_file(path)}; {fix}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path} is not UTF-8 text ({e.reason} at byte {e.start}); {fix}") from None
    except OSError as e:
        raise ValueError(f"{flag} {path} cannot be read ({e.strerror or e}); pass a readable file.") from None
    if "\x00" in text:
        raise ValueError(f"{flag} {path} holds NUL bytes, so it is binary, not text; {fix}")
    return text


def refuse_empty(values, flag: str, fix: str) -> None:
    """Refuses an empty (or blank) path among `values` (one or several), which would be read as the working directory
    ("."): one line "FLAG is empty; pass FIX", naming its place among several."""
    values = [values] if isinstance(values, str) else list(values or ())
    if empty := [i for i, value in enumerate(values, 1) if not str(value).strip()]:
        where = "" if len(values) == 1 else (f" {' '.join(v if str(v).strip() else repr(v) for v in values)}: path "
                                             f"{empty[0]} of {len(values)}")
        raise ValueError(f"{flag}{where} is empty; pass {fix}.")


def refuse_repeats(names, flag: str, what: str) -> None:
    """Refuses a path given twice (also spelt two ways, ./a.txt and a.txt), which would be read twice: one line
    "FLAG NAME is given twice; pass each WHAT once" (`flag` "" for a positional argument)."""
    seen = {}
    for name in names:
        path = Path(name).resolve()
        if path in seen:
            also = "" if str(seen[path]) == str(name) else f" (as {seen[path]} and {name})"
            raise ValueError(f"{flag + ' ' if flag else ''}{name} is given twice{also}; pass each {what} once.")
        seen[path] = name


def read_tokenizer_file(path: str, flag: str, what: str | None = None) -> bytes:
    """The bytes of a tokenizer's file given as `flag` (GPT-2's by default, else `what`); one line if it is not a
    file."""
    if not Path(path).is_file():
        what = what or ("GPT-2's encoder.json" if flag == "--vocab-file" else "GPT-2's vocab.bpe")
        raise ValueError(f"{flag} {path}: {not_a_file(path)}; pass the path to {what} (or drop --vocab-file and "
                         "--merge-file to use the byte-level tokenizer).")
    return Path(path).read_bytes()
