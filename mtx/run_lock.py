"""One run at a time in a run directory: the lock file `files.RUN_LOCK` that a training run holds while it writes.

Two runs started into one --save would otherwise both pass the checks of mtx.run.prepare (they see only what is on
disk, and a directory in use looks free until its first metrics line or checkpoint) and then write over each other's
config, metrics and checkpoints. The run's main process creates the lock exclusively before it writes anything and
removes it when the run ends, however it ends short of being killed; while the run lives a thread touches the file
every `HEARTBEAT_S` seconds. A lock is stale, and taken over with a notice, when its run is gone: the process it
names is not alive on this host, or (from another host, which cannot see that process) the file has not been
touched for `STALE_S` seconds. So a run killed outright (SIGKILL, a lost node) can be resumed at once on its own
host and after `STALE_S` seconds anywhere.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from mtx.files import RUN_LOCK

HEARTBEAT_S = 30.0
STALE_S = 300.0


def _holder(path: Path) -> tuple[dict | None, float] | None:
    """(what the lock says, or None if it cannot be read yet, its age in seconds); None when there is no lock."""
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        said = json.loads(path.read_text())
        said = said if isinstance(said, dict) else None
    except (OSError, ValueError):  # being written right now, or damaged
        said = None
    return said, age


def _alive(said: dict | None, age: float) -> bool:
    if age > STALE_S:
        return False
    if said and said.get("host") == socket.gethostname() and isinstance(said.get("pid"), int):
        try:
            os.kill(said["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, another user's
            return True
    return True


def _in_use(path: Path, flag: str, said: dict | None) -> str:
    who = f"pid {said.get('pid')} on {said.get('host')}, started {said.get('started')}" if said else "starting now"
    return (f"{flag} {path.parent} is in use by another run ({who}); wait for it to end, or choose another "
            f"directory (a run killed outright is taken over {STALE_S:.0f} s after its last sign of life in "
            f"{path.name}, at once on its own host).")


def check_free(run_dir: str | Path, flag: str) -> None:
    """Refuses (ValueError, one line) a run directory that a live run holds: before any device work."""
    path = Path(run_dir) / RUN_LOCK
    if (holder := _holder(path)) and _alive(*holder):
        raise ValueError(_in_use(path, flag, holder[0]))


class RunLock:
    """The lock of `run_dir` (which exists), held from `acquire` to `release` by this process."""

    def __init__(self, run_dir: str | Path, flag: str):
        self.path, self.flag = Path(run_dir) / RUN_LOCK, flag
        self._token = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
        self._stop = threading.Event()
        self._thread = None

    def acquire(self) -> RunLock:
        """Creates the lock, or takes over a stale one (a notice); ValueError if a live run holds it."""
        for _ in range(3):  # a stale lock removed, or a race with another run's acquire, then again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _holder(self.path)
                if holder and _alive(*holder):
                    raise ValueError(_in_use(self.path, self.flag, holder[0])) from None
                if holder:
                    said, age = holder
                    print(f"mtx: {self.path} of a run that is gone ({(said or {}).get('host', '?')} pid "
                          f"{(said or {}).get('pid', '?')}, last alive {age:.0f} s ago): taken over.", file=sys.stderr)
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"host": socket.gethostname(), "pid": os.getpid(), "token": self._token,
                           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": sys.argv}, f)
            self._thread = threading.Thread(target=self._beat, name="mtx-run-lock", daemon=True)
            self._thread.start()
            return self
        raise ValueError(f"{self.flag} {self.path.parent}: another run keeps taking its lock; wait for it to end, or "
                         "choose another directory.")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:  # removed by hand: nothing to keep alive
                return

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
