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
from mtx.config import Config
from mtx.files import RUN_LOCK, check_run_dir
from mtx.presets import load_preset
from mtx.run import prepare, train
from mtx.run_lock import RunLock, check_free

TINY = Config().replace(**load_preset("configs/tiny.toml")).replace(train_iters=2, log_interval=1)


def _lock(run_dir, pid, host=None, age=0.0):
    run_dir.mkdir(exist_ok=True)
    path = run_dir / RUN_LOCK
    path.write_text(json.dumps({"host": host or socket.gethostname(), "pid": pid, "started": "then", "token": "x"}))
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def _beat_while_watched(monkeypatch, path):
    """The other run's heartbeat, landing while check_free watches the lock (at its first wait, whatever the load)."""
    sleep, beats = time.sleep, [path]

    def watched(seconds):
        while beats:
            os.utime(beats.pop())
        sleep(seconds)
    monkeypatch.setattr(time, "sleep", watched)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_second_run_into_a_directory_in_use_is_refused_before_device_work(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _lock(run, os.getppid())  # a live process of this host: the run in progress
    with pytest.raises(ValueError, match=rf"--save {run} is in use by another run \(pid {os.getppid()} on "):
        prepare(TINY.replace(save=str(run)))
    check_run_dir(run, "--save")  # the lock is mtx's own file: no "files mtx did not write"


@pytest.mark.parametrize("by_pid", [True, False])
def test_a_lock_told_by_its_age_is_watched_until_it_is_touched_or_stale(tmp_path, monkeypatch, capsys, by_pid):
    """Another host's lock (or any, with several processes) younger than STALE_S: refused once it is touched (its
    run lives); taken over once stale (a job requeued after its node was lost starts instead of being refused)."""
    monkeypatch.setattr(run_lock, "WATCH_S", 0.02)
    monkeypatch.setattr(run_lock, "STALE_S", 30.0)
    run = tmp_path / "run"
    path = _lock(run, 1, host="elsewhere", age=10.0)
    _beat_while_watched(monkeypatch, path)
    with pytest.raises(ValueError, match="in use by another run .*pid 1 on elsewhere"):
        check_free(run, "--run-dir", by_pid=by_pid)
    assert "held by a run on elsewhere (pid 1), last alive 10 s ago; watching for up to 20 s" in capsys.readouterr().err
    monkeypatch.setattr(run_lock, "STALE_S", 10.3)
    _lock(run, 1, host="elsewhere", age=10.0)  # silent from here: stale in 0.3 s
    started = time.monotonic()
    check_free(run, "--run-dir", by_pid=by_pid, quiet=True)
    assert 0.2 < time.monotonic() - started < 5 and not capsys.readouterr().err


@pytest.mark.parametrize("where", ["this host, its process gone", "another host, silent too long"])
def test_a_lock_whose_run_is_gone_is_taken_over(tmp_path, capsys, where):
    run = tmp_path / "run"
    _lock(run, _dead_pid()) if where.startswith("this") else _lock(run, 1, host="elsewhere", age=run_lock.STALE_S + 1)
    check_free(run, "--save", by_pid=True)
    lock = RunLock(run, "--save", by_pid=True).acquire()
    assert "of a run that is gone" in capsys.readouterr().err
    assert json.loads((run / RUN_LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (run / RUN_LOCK).exists()


def test_the_first_of_two_racing_runs_holds_the_lock_and_only_its_own_is_removed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    first = RunLock(run, "--save", by_pid=True).acquire()
    with pytest.raises(ValueError, match="in use by another run"):  # (by age: by pid, this process's lock is stale)
        RunLock(run, "--save", by_pid=False).acquire()
    second = RunLock(run, "--save", by_pid=True)
    second.release()  # never acquired: nothing to remove
    assert (run / RUN_LOCK).exists()
    first.release()
    first.release()
    assert not (run / RUN_LOCK).exists()


def test_the_lock_lives_while_the_run_writes_and_is_kept_alive(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    run = tmp_path / "run"
    run.mkdir()
    lock = RunLock(run, "--save", by_pid=True).acquire()
    os.utime(run / RUN_LOCK, (0, 0))
    time.sleep(0.3)
    assert time.time() - (run / RUN_LOCK).stat().st_mtime < 5  # touched again by the heartbeat
    lock.release()
    seen, release = [], RunLock.release
    monkeypatch.setattr(RunLock, "release", lambda self: (seen.append(self.path.exists()), release(self)))
    train(TINY.replace(save=str(run)), progress=False)  # held to the end, then removed
    assert seen == [True] and sorted(p.name for p in run.iterdir()) == ["2", "config.json", "metrics.jsonl"]


def test_whose_lock_is_stale(tmp_path, monkeypatch):
    """This very process's (a container restarted in place reuses ids) and a damaged one at once; with several
    processes (by_pid False, all deciding alike) only the age counts, even for a process gone on this host."""
    run = tmp_path / "run"
    _lock(run, os.getpid())
    check_free(run, "--save", by_pid=True)
    path = _lock(run, _dead_pid())
    _beat_while_watched(monkeypatch, path)  # alive, whatever the pid says
    with pytest.raises(ValueError, match="in use by another run"):
        check_free(run, "--save", by_pid=False, quiet=True)
    (run / RUN_LOCK).unlink()
    (run / RUN_LOCK).mkdir()  # made by hand while a run looked: refused (unlinking it once raised IsADirectoryError)
    with pytest.raises(ValueError, match=f"{RUN_LOCK} is a directory, not a lock mtx wrote; remove it"):
        RunLock(run, "--save", by_pid=True).acquire()
    (run / RUN_LOCK).rmdir()
    _lock(run, 1, host="elsewhere", age=-3600)  # a clock an hour ahead: refused, not watched for an hour
    with pytest.raises(ValueError, match="was last touched 3600 s ahead of this host's clock; set the clocks right"):
        check_free(run, "--save", by_pid=True)
    (run / RUN_LOCK).write_text("")
    check_free(run, "--save", by_pid=False)


def test_a_run_that_lost_the_race_for_the_lock_is_one_line_and_leaves_the_other_alone(tmp_path, monkeypatch, capsys):
    import train as train_script
    from mtx import run as mtx_run

    run = tmp_path / "run"
    holder = _lock(run, os.getppid())  # taken between this run's checks and its start
    monkeypatch.setattr(mtx_run, "check_free", lambda *args, **kwargs: None)
    assert train_script.main(["--config", "configs/tiny.toml", "--train-iters", "2", "--save", str(run)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is in use by another run" in errors[0]  # a traceback once
    assert sorted(p.name for p in run.iterdir()) == [RUN_LOCK] and holder.exists()  # its lock kept, once deleted


def test_a_failure_before_the_loop_lets_the_lock_go_and_takes_back_the_new_directory(tmp_path, monkeypatch):
    from mtx import run as mtx_run

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while W&B starts, say

    monkeypatch.setattr(mtx_run, "MetricsLogger", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(TINY.replace(save=str(tmp_path / "run")), progress=False)
    assert not (tmp_path / "run").exists()  # once: its config and a live lock, which refused the next run
