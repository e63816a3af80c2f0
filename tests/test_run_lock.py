"""One run at a time in a run directory (mtx/run_lock.py): a second run into a directory in use is refused before
any device work; a lock whose run is gone is taken over; the lock goes when the run ends."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from mtx import run_lock
from mtx.config import Config, load_preset
from mtx.files import RUN_LOCK, check_run_dir
from mtx.run import prepare, train
from mtx.run_lock import RunLock, check_free

TINY = Config().replace(**load_preset("configs/tiny.toml")).replace(train_iters=2, log_interval=1)


def _lock(run_dir, pid, host=None, age=0.0):
    run_dir.mkdir(exist_ok=True)
    path = run_dir / RUN_LOCK
    path.write_text(json.dumps({"host": host or socket.gethostname(), "pid": pid, "started": "then", "token": "x"}))
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_second_run_into_a_directory_in_use_is_refused_before_device_work(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _lock(run, os.getpid())  # a live process of this host: the run in progress
    with pytest.raises(ValueError, match=rf"--save {run} is in use by another run \(pid {os.getpid()} on "):
        prepare(TINY.replace(save=str(run)))
    monkeypatch.setattr(run_lock, "STALE_S", 60.0)
    _lock(run, 1, host="elsewhere", age=10.0)  # another host's run, alive 10 s ago
    with pytest.raises(ValueError, match="in use by another run .*pid 1 on elsewhere"):
        check_free(run, "--run-dir")
    check_run_dir(run, "--save")  # the lock is mtx's own file: no "files mtx did not write"


@pytest.mark.parametrize("where", ["this host, its process gone", "another host, silent too long"])
def test_a_lock_whose_run_is_gone_is_taken_over(tmp_path, capsys, where):
    run = tmp_path / "run"
    _lock(run, _dead_pid()) if where.startswith("this") else _lock(run, 1, host="elsewhere", age=run_lock.STALE_S + 1)
    check_free(run, "--save")
    lock = RunLock(run, "--save").acquire()
    assert "of a run that is gone" in capsys.readouterr().err
    assert json.loads((run / RUN_LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (run / RUN_LOCK).exists()


def test_the_first_of_two_racing_runs_holds_the_lock_and_only_its_own_is_removed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    first = RunLock(run, "--save").acquire()
    with pytest.raises(ValueError, match="in use by another run"):
        RunLock(run, "--save").acquire()
    second = RunLock(run, "--save")
    second.release()  # never acquired: nothing to remove
    assert (run / RUN_LOCK).exists()
    first.release()
    first.release()
    assert not (run / RUN_LOCK).exists()


def test_the_lock_lives_while_the_run_writes_and_is_kept_alive(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    run = tmp_path / "run"
    run.mkdir()
    lock = RunLock(run, "--save").acquire()
    os.utime(run / RUN_LOCK, (0, 0))
    time.sleep(0.3)
    assert time.time() - (run / RUN_LOCK).stat().st_mtime < 5  # touched again by the heartbeat
    lock.release()
    seen, release = [], RunLock.release
    monkeypatch.setattr(RunLock, "release", lambda self: (seen.append(self.path.exists()), release(self)))
    train(TINY.replace(save=str(run)), progress=False)  # held to the end, then removed
    assert seen == [True] and sorted(p.name for p in run.iterdir()) == ["2", "config.json", "metrics.jsonl"]
