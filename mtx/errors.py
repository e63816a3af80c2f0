"""Error text for mtx's one-line messages, and how a command line tool ends."""

from __future__ import annotations

import errno
import importlib.util
import os
import select
import sys
from typing import Callable, NoReturn, Sequence


def first_line(error: BaseException, limit: int | None = 200) -> str:
    """The first line of an exception's message (at most `limit` characters, None: all of it; tensorstore's trailing
    "See full error" pointer cut), or its type's name when it has no message."""
    lines = str(error).strip().splitlines()
    text = lines[0].split(" See full")[0][:limit].rstrip() if lines else ""
    return text or type(error).__name__


def out_of_memory(error: BaseException, fixes: Sequence[str]) -> str | None:
    """The one-line message of a device running out of memory (XLA's RESOURCE_EXHAUSTED), naming `fixes` (what would
    make the work fit), or None for any other error."""
    if "RESOURCE_EXHAUSTED" not in str(error):
        return None
    return f"a device ran out of memory ({first_line(error)}); try " + ", ".join(fixes[:-1]) + f" or {fixes[-1]}."


def training_memory_fixes(cfg) -> list[str]:
    """What would make a training run fit: a smaller batch or sequence, more recomputation, a larger share of each
    GPU where the run's is below mtx's 0.9, more model parallelism."""
    import jax

    from mtx.devices import DEFAULT_GPU_MEMORY_FRACTION, JAX_MEMORY_FRACTION, share_set

    t, m, p = cfg.training, cfg.model, cfg.parallel
    fixes = [f"a smaller --micro-batch-size (now {t.micro_batch_size}) or --seq-length (now {m.seq_length})"]
    if t.recompute_granularity != "full":
        fixes.append("--recompute-granularity full")
    elif t.recompute_method == "block" and t.recompute_num_layers < max(cfg.stage_layer_counts()):
        fixes.append(f"more recomputed layers (--recompute-num-layers, now {t.recompute_num_layers} with "
                     "--recompute-method block)")
    held = share_set()  # (the run's share: set before its backends started, or JAX's own)
    share = JAX_MEMORY_FRACTION if held is None else held[1]
    if share < DEFAULT_GPU_MEMORY_FRACTION and jax.default_backend() == "gpu":
        where = held[0] if held and t.gpu_memory_fraction is None else "--gpu-memory-fraction"
        fixes.append(f"a larger share of each GPU ({where}, now {share:g})")
    return fixes + [more_devices(p.tensor_model_parallel_size, p.pipeline_model_parallel_size)]


def more_devices(tp: int, pp: int) -> str:
    """The fix of a run or evaluation out of memory that spreads the model wider, naming the sizes it has."""
    return (f"the model spread over more devices (--tensor-model-parallel-size, now {tp}; "
            f"--pipeline-model-parallel-size, now {pp})")


class UsageError(ValueError):
    """A command line that a tool's parser refuses (mtx.cli.OneLineParser): one line, exit status 2."""


def exit_with(main: Callable[[], object]) -> NoReturn:
    """A command line tool's end: `sys.exit` with the status `main()` returns (0 if it returns what it wrote, or
    None). A command line its parser refuses that `main` did not catch is one "error: ..." line, exit status 2; a
    reader of its output that went away (`| head`, a `tee` that was stopped) ends it with one line on stderr and exit
    status 141 (a shell's "killed by SIGPIPE"), not a traceback; a full disk (its output's, or a file's it writes) is
    one "error: ..." line, status 1, and a path with a name too long for the file system one line, status 2 (a bad
    input, as the tools' own refusals). The tool's own cleanup has run on the way (a training run lets its run
    directory go)."""
    try:
        try:
            status = main()
            status = status if isinstance(status, int) and not isinstance(status, bool) else 0
        except SystemExit as e:  # argparse's --help, or a tool's own exit: its status, flushed below all the same
            status = e.code
        if sys.stdout is not None:  # (None: the tool was started with its standard output closed)
            sys.stdout.flush()  # what a pipe's buffer still holds, written here, not at the interpreter's exit
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        status = 2
    except BrokenPipeError:
        if not _stdout_gone():  # another pipe (a worker's): not about the output
            raise
        _quiet_stdout()
        try:
            print(f"note: {os.path.basename(sys.argv[0])} stopped: the reader of its output went away (a closed pipe).",
                  file=sys.stderr, flush=True)
        except OSError:  # stderr went the same way
            pass
        status = 141
    except OSError as e:
        if e.errno not in _ONE_LINE:
            raise
        _quiet_stdout()  # (it may be the full one)
        try:
            print(f"error: {e.strerror}{f' ({e.filename})' if e.filename else ''}; {_ONE_LINE[e.errno]}.",
                  file=sys.stderr)
        except OSError:  # stderr on the same full disk
            pass
        status = 2 if e.errno == errno.ENAMETOOLONG else 1  # (a path given, as the tools' own refusals: 2)
    sys.exit(status)


# The system's refusals a tool ends on in one line (status 1; 2 for a name too long, a bad path given), whichever
# of its paths met them: the fix of each.
_ONE_LINE = {errno.ENOSPC: "free some space, or write the output elsewhere", errno.EDQUOT: "free some space, or write "
             "the output elsewhere", errno.ENAMETOOLONG: "choose a shorter name (at most 255 bytes a component)"}


def _quiet_stdout() -> None:
    """Standard output pointed at /dev/null: what is left in its buffer would fail again at the interpreter's exit."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):
        pass


def _stdout_gone() -> bool:
    """Whether standard output is a pipe whose reading end is closed (the system reports an error on it)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no stdout, or not a file
        return False


def script_needs(module: str, install: str, name: str) -> None:
    """A script (`name`: its __name__, "__main__" when run as one) that `module` is missing from ends in one line,
    exit status 2, `install` saying how to get it (a traceback once, even for --help); imported, nothing is done."""
    if name == "__main__" and importlib.util.find_spec(module) is None:
        print(f"error: {os.path.basename(sys.argv[0])} needs {module} ({install}).", file=sys.stderr)
        sys.exit(2)
