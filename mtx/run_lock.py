"""One run at a time in a run directory: the lock file `files.RUN_LOCK` that a training run holds while it writes.

Two runs started into one --save would otherwise both pass the checks of mtx.run.prepare (they see only what is on
disk, and a directory in use looks free until its first metrics line or checkpoint) and then write over each other's
config, metrics and checkpoints. The run's main process puts the lock in place before it writes anything (written
whole under a name of its own, then linked to `RUN_LOCK`, which fails if one is there: never seen half written) and
removes it when the run ends, however it ends short of being killed; while the run lives a thread touches the file
every `HEARTBEAT_S` seconds.

A lock is stale, and taken over with a notice, when its run is gone. A process of one host on its own (`by_pid`) asks
the system about the process the lock names when it was written on this host: gone, or this very process (a
container restarted in place reuses process ids), the lock is stale at once; alive, it holds whatever its age (a run
stopped with SIGSTOP, a file system that failed a touch). Otherwise (another host's lock, or several processes, which
must all decide alike and cannot all see that process) a lock untouched for `STALE_S` seconds is stale; a younger one
is watched until it is touched (its run lives: refused) or grows stale (taken over), so that a job requeued after
its node was lost starts once the lock has gone quiet long enough, instead of being refused. So a run killed
outright (SIGKILL, a lost node) can be resumed at once by a single process on its own host, and within `STALE_S`
seconds anywhere.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from mtx.files import RUN_LOCK, new_temporary

HEARTBEAT_S = 30.0
STALE_S = 300.0
WATCH_S = 1.0  # how often a lock of undecided age is looked at again


class InUse(ValueError):
    """The run directory is held by another run (one line, naming it)."""


def _holder(path: Path) -> tuple[dict | None, float] | None:
    """(what the lock says, or None if it is not a lock mtx wrote, when it was last touched); None when there is
    none."""
    try:
        touched = path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        said = json.loads(path.read_text())
    except (OSError, ValueError):
        said = None
    return (said if isinstance(said, dict) else None), touched


def _told_by_pid(said: dict, by_pid: bool) -> bool:
    """Whether a lock's life is told by asking the system about its process (else by its age)."""
    return by_pid and said.get("host") == socket.gethostname() and isinstance(said.get("pid"), int)


def _alive(said: dict | None, touched: float, by_pid: bool) -> bool:
    if said is None:  # damaged (mtx's locks are written whole): no run to wait for
        return False
    if _told_by_pid(said, by_pid):
        if said["pid"] == os.getpid():
            return False
        try:
            os.kill(said["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, another user's
            pass
        return True
    return time.time() - touched <= STALE_S


def _in_use(path: Path, flag: str, said: dict) -> InUse:
    return InUse(f"{flag} {path.parent} is in use by another run (pid {said.get('pid')} on {said.get('host')}, "
                 f"started {said.get('started')}); wait for it to end, or choose another directory (a run killed "
                 f"outright is taken over {STALE_S:.0f} s after its last sign of life in {path.name}).")


def check_free(run_dir: str | Path, flag: str, *, by_pid: bool, quiet: bool = False) -> None:
    """Refuses (InUse, one line) a run directory that a live run holds: before any device work. `by_pid`: this is
    the run's only process, which may ask the system whether the lock's process lives (module docstring). A lock told
    by its age and not yet stale is watched (a line first, unless `quiet`: the other processes of a run) until it is
    touched, gone or stale."""
    path = Path(run_dir) / RUN_LOCK
    if not ((holder := _holder(path)) and _alive(*holder, by_pid)):
        return
    said, touched = holder
    if _told_by_pid(said, by_pid):
        raise _in_use(path, flag, said)
    if (ahead := touched - time.time()) > HEARTBEAT_S:  # another host's clock ahead of this one's: no age to go by
        raise InUse(f"{flag} {path.parent}: {path.name} of a run on {said.get('host')} was last touched {ahead:.0f} s "
                    "ahead of this host's clock; set the clocks right, or remove it if no run uses the directory.")
    if not quiet:
        age = max(time.time() - touched, 0.0)
        print(f"mtx: {flag} {path.parent} is held by a run on {said.get('host')} (pid {said.get('pid')}), last alive "
              f"{age:.0f} s ago; watching for up to {STALE_S - age:.0f} s whether it still lives (its lock is "
              f"touched every {HEARTBEAT_S:.0f} s) before taking it over.", file=sys.stderr, flush=True)
    while (holder := _holder(path)) and _alive(*holder, by_pid):
        if holder[1] != touched:  # touched since (or another run's lock in its place)
            raise _in_use(path, flag, holder[0] or said)
        time.sleep(WATCH_S)


class RunLock:
    """The lock of `run_dir` (which exists), held from `acquire` to `release` by this process."""

    def __init__(self, run_dir: str | Path, flag: str, *, by_pid: bool):
        self.path, self.flag, self.by_pid = Path(run_dir) / RUN_LOCK, flag, by_pid
        self._token = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
        self._stop = threading.Event()
        self._thread = None

    def acquire(self) -> RunLock:
        """Puts the lock in place, or takes over a stale one (a notice); InUse if a live run holds it."""
        written = new_temporary(self.path)
        Path(written).write_text(json.dumps({
            "host": socket.gethostname(), "pid": os.getpid(), "token": self._token,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": sys.argv}))
        try:
            for _ in range(3):  # a stale lock removed, or a race with another run's acquire, then again
                try:
                    os.link(written, self.path)
                except FileExistsError:
                    if self.path.is_dir():  # (made there by hand while this run looked: no lock of mtx's)
                        raise InUse(f"{self.flag} {self.path.parent}: {self.path.name} is a directory, not a lock "
                                    "mtx wrote; remove it, or choose another directory.") from None
                    holder = _holder(self.path)
                    if holder and _alive(*holder, self.by_pid):
                        raise _in_use(self.path, self.flag, holder[0]) from None
                    if holder:
                        said = holder[0] or {}
                        print(f"mtx: {self.path} of a run that is gone ({said.get('host', '?')} pid "
                              f"{said.get('pid', '?')}, last alive {time.time() - holder[1]:.0f} s ago): taken over.",
                              file=sys.stderr)
                    self.path.unlink(missing_ok=True)
                    continue
                self._thread = threading.Thread(target=self._beat, name="mtx-run-lock", daemon=True)
                self._thread.start()
                return self
        finally:
            os.unlink(written)
        raise InUse(f"{self.flag} {self.path.parent}: another run keeps taking its lock; wait for it to end, or "
                    "choose another directory.")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except FileNotFoundError:  # removed (the run directory taken back, or by hand): nothing to keep alive
                return
            except OSError:  # a file system that failed this touch (NFS): the next one may land
                pass

    def release(self) -> None:
        """Removes the lock if it is still this run's (idempotent)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        holder = _holder(self.path)
        if holder and holder[0] and holder[0].get("token") == self._token:
            self.path.unlink(missing_ok=True)
