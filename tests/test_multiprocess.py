"""Multi-host training, simulated: 2 processes of 4 CPU devices each (jax.distributed over localhost, gloo
collectives) train exactly like one process of 8 devices, share checkpoints with it both ways, and fail fast when a
peer dies. Each run is a real `python train.py` subprocess, as a cluster launcher would start it."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mtx.devices import cpu_devices_flag

ROOT = Path(__file__).resolve().parents[1]
# lr decay fixed at 20 steps, so a 10-step run resumed to 12 follows the schedule of a 12-step run.
FLAGS = ["--config", "configs/tiny.toml", "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--lr-decay-iters", "20", "--save-interval", "10"]
TIMEOUT = 120  # seconds any one run may take before the test fails (CI never hangs)


def _env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_devices_flag(devices), PYTHONPATH=str(ROOT))
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start(flags, devices, **kw):
    return subprocess.Popen([sys.executable, "train.py", *FLAGS, *flags], cwd=ROOT, env=_env(devices),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _launch(flags, processes=2):
    """`processes` processes of 4 devices each, ranks 0..n-1, joined through a localhost coordinator."""
    dist = ["--coordinator-address", f"localhost:{_free_port()}", "--num-processes", str(processes),
            "--distributed-timeout", "5"]
    return [_start([*flags, *dist, "--process-id", str(i)], 4) for i in range(processes)]


def _wait(procs, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a run did not finish within {timeout} s")
        outs.append(out)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


def _await_steps(procs, metrics: Path, lines: int):
    """Waits until `metrics` holds `lines` lines (the processes keep running)."""
    deadline = time.monotonic() + TIMEOUT
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= lines):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            pytest.fail(f"the 2-process run did not log {lines} lines:\n" + procs[0].communicate()[0][-3000:])
        time.sleep(0.2)


def _losses(run_dir) -> dict[int, float]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().split("\n")[:-1]  # complete lines only
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def _close(a: dict, b: dict, steps, what):
    x, y = np.array([a[s] for s in steps]), np.array([b[s] for s in steps])
    np.testing.assert_allclose(x, y, rtol=1e-5, err_msg=what)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process of 8 devices: 12 steps, checkpoints at 10 and 12."""
    d = tmp_path_factory.mktemp("mp") / "one"
    _wait([_start(["--train-iters", "12", "--save", str(d), "--tensor-model-parallel-size", "4"], 8)])
    return d


def test_two_processes_train_like_one_and_their_checkpoint_restores_in_one(reference, tmp_path):
    two = tmp_path / "two"
    outs = _wait(_launch(["--train-iters", "10", "--save", str(two), "--tensor-model-parallel-size", "4"]))
    assert "mesh data=2 pipeline=1 model=4 on 8 cpu device(s)" in outs[0]
    assert "mtx:" not in outs[1]  # only process 0 prints
    ref = _losses(reference)
    _close(_losses(two), ref, range(1, 11), "2 processes, mesh (2, 1, 4)")
    assert sorted(int(p.name) for p in two.iterdir() if p.name.isdigit()) == [10]
    # The 2-process checkpoint resumes in one process of 8 devices on another mesh, exactly.
    _wait([_start(["--train-iters", "12", "--load", str(two), "--save", str(two),
                   "--tensor-model-parallel-size", "2"], 8)])
    _close(_losses(two), ref, range(1, 13), "resumed in 1 process from a 2-process checkpoint")


def test_two_processes_on_a_2x2x2_mesh_train_like_one(reference, tmp_path):
    """Data and pipeline both cross the two processes; tensor parallelism stays inside each."""
    run = tmp_path / "piped"
    outs = _wait(_launch(["--train-iters", "10", "--run-dir", str(run), "--tensor-model-parallel-size", "2",
                          "--pipeline-model-parallel-size", "2", "--generate-tokens", "8", "--eval-interval", "10",
                          "--eval-iters", "2"]))
    assert "mesh data=2 pipeline=2 model=2 on 8 cpu device(s)" in outs[0]
    _close(_losses(run), _losses(reference), range(1, 11), "2 processes, mesh (2, 2, 2)")
    # The end-of-run actions across both processes: the final validation, the sample (decoding).
    assert "step 10: validation loss" in outs[0] and "--- sample (8 tokens) ---" in outs[0]


def test_sigterm_to_one_process_stops_both_after_the_same_step_with_a_checkpoint(tmp_path):
    run = tmp_path / "stopped"
    procs = _launch(["--train-iters", "200", "--save", str(run), "--save-interval", "1000",
                     "--tensor-model-parallel-size", "4"])
    _await_steps(procs, run / "metrics.jsonl", 2)
    procs[1].send_signal(signal.SIGTERM)  # a scheduler preempts one host
    outs = _wait(procs)  # both exit 0
    last = max(_losses(run))
    assert f"stopped after step {last} (another process was asked to stop); checkpoint saved in {run}" in outs[0]
    assert max(int(p.name) for p in run.iterdir() if p.name.isdigit()) == last < 200


def test_one_process_checkpoint_resumes_on_two_with_pipeline_and_a_dead_peer_stops_the_run(reference, tmp_path):
    run = tmp_path / "resumed"
    procs = _launch(["--train-iters", "200", "--load", str(reference), "--ckpt-step", "10", "--save", str(run),
                     "--save-interval", "1000", "--pipeline-model-parallel-size", "2",
                     "--tensor-model-parallel-size", "2"])
    _await_steps(procs, run / "metrics.jsonl", 3)
    _close(_losses(run), _losses(reference), [11, 12], "2 processes, mesh (2, 2, 2), resumed from 1 process")
    procs[1].kill()  # a host dies mid-run
    error = _survivor_says(procs[0], dead=1)
    assert f"resume with --load {run} once every host is back" in error


def _survivor_says(survivor, dead: int) -> str:
    """The one line a process says when process `dead` of its run has died, checked: it stops within 60 s with
    status 1 and exactly one error line (the peer watch noticed the silence, --distributed-timeout 5, or a collective
    with the dead process failed first), not JAX's abort from C++."""
    t0 = time.monotonic()
    try:
        out, _ = survivor.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        survivor.kill()
        pytest.fail(f"a process kept running 60 s after process {dead} died")
    assert survivor.returncode == 1, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    said = (f"process {dead} of this run has not answered for 5 s", "another process of this run stopped answering")
    assert len(errors) == 1 and any(m in errors[0] for m in said), out[-3000:]
    assert "Check failed" not in out and "terminate called" not in out, out[-3000:]
    print(f"{time.monotonic() - t0:.1f} s after process {dead} died: {errors[0]}")
    return errors[0]


def test_when_process_0_dies_the_others_stop_in_one_line_and_its_service_process_ends(tmp_path):
    """Process 0 hosts JAX's coordination service in a child process, which outlives it: process 1 then sees process
    0 fall silent like any other peer (one line, status 1, not JAX's abort), and the child ends after serving."""
    run = tmp_path / "run"
    procs = _launch(["--train-iters", "200", "--save", str(run), "--save-interval", "1000",
                     "--tensor-model-parallel-size", "4"])
    service = []
    try:
        _await_steps(procs, run / "metrics.jsonl", 2)
        service = _children(procs[0].pid)
        assert len(service) == 1, "process 0 runs its coordination service in one child process"
        procs[0].kill()
        assert f"resume with --load {run} once every host is back" in _survivor_says(procs[1], dead=0)
        procs[0].communicate()
        deadline = time.monotonic() + 60  # it serves for --distributed-timeout + 10 s (15 s), then exits
        while _alive(service[0]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _alive(service[0]), "the coordination service process outlived the run"
    finally:  # nothing left running if an assertion failed
        for p in procs:
            p.kill()
        for pid in service:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return status != "Z"


def test_eval_runs_on_two_processes_like_on_one(reference, tmp_path):
    """eval.py's scoring and generation with several processes: the same JSON as one process of 8 devices."""
    (tmp_path / "wiki.txt").write_text("= Title =\n the cat sat on the mat , and the dog sat on the log . \n" * 6)
    tasks = [["wikitext", "--data-path", str(tmp_path / "wiki.txt"), "--overlapping-eval", "8"],
             ["generate", "--prompt", "The ", "--max-new-tokens", "6", "--temperature", "0"]]
    for task in tasks:
        argv = [sys.executable, "eval.py", *task, "--load", str(reference), "--tensor-model-parallel-size", "2"]
        one = subprocess.run(argv, cwd=ROOT, env=_env(8), capture_output=True, text=True, timeout=TIMEOUT)
        dist = ["--coordinator-address", f"localhost:{_free_port()}", "--num-processes", "2"]
        procs = [subprocess.Popen([*argv, *dist, "--process-id", str(i)], cwd=ROOT, env=_env(4),
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for i in range(2)]
        outs = _wait(procs)
        assert one.returncode == 0, one.stderr[-2000:]
        json_lines = lambda out: [line for line in out.splitlines() if line.startswith("{")]  # (gloo logs too)
        expected, got = json.loads(one.stdout), json.loads(json_lines(outs[0])[-1])
        assert json_lines(outs[1]) == []  # one process prints
        if task[0] == "wikitext":
            assert got.pop("loss") == pytest.approx(expected.pop("loss"), rel=1e-5)
            got.pop("ppl"), expected.pop("ppl"), got.pop("adjusted_ppl"), expected.pop("adjusted_ppl")
        assert got == expected


def test_tensor_parallelism_must_stay_inside_a_process():
    from mtx.parallel.mesh import check_tensor_parallel_fits

    check_tensor_parallel_fits(8, 4, 1)  # one process: the usual device-count checks apply instead
    check_tensor_parallel_fits(2, 4, 2)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 8 does not fit the 4 devices of one process"):
        check_tensor_parallel_fits(8, 4, 2)


def test_the_service_process_refuses_a_taken_port_and_jaxs_other_calls_stay_in_process(monkeypatch):
    """A coordinator port already in use is one line naming the flag; a call of the service factory in a form mtx
    does not know (mutual TLS on, other arguments) goes to JAX's own in-process service unchanged."""
    from mtx import distributed

    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::", 0))
        taken.listen()
        with pytest.raises(ValueError, match=r"did not start on \[::\]:\d+ .*is the port of --coordinator-address"):
            distributed.ServiceProcess(f"[::]:{taken.getsockname()[1]}", 2, 20, 10, 5)

    calls = []

    class Library:
        def get_distributed_runtime_service(self, *args, **kwargs):
            calls.append((args, kwargs))
            return "in-process"

    library = Library()
    monkeypatch.setattr(distributed, "_runtime_library", lambda: library)
    with distributed._service_in_child_process(linger=15):
        start = library.get_distributed_runtime_service
        tls = dict(heartbeat_timeout=20, shutdown_timeout=10, recoverable=False, mtls_cert_file="cert.pem")
        assert start("[::]:1", 2, **tls) == "in-process"
        assert start("[::]:1", 2, 20, 10) == "in-process"  # positional timeouts: a form mtx does not know
    assert calls == [(("[::]:1", 2), tls), (("[::]:1", 2, 20, 10), {})]
    assert library.get_distributed_runtime_service.__name__ == "get_distributed_runtime_service"  # restored
