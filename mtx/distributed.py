"""Beyond one host: JAX's multi-controller runtime, one process per host over the same global mesh.

Every process runs the same program on its own devices; `jax.devices()` then lists the devices of all processes
and the collectives inside the shard_map cross hosts. `initialize` must run before anything asks JAX for a device
(mtx.run.prepare calls jax.devices()), so train.py and eval.py call it right after parsing their flags.
Only process 0 writes logs, metrics, config.json and prints; every process takes part in checkpoints (orbax).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax

from mtx.errors import first_line


def initialize(coordinator_address: str | None, num_processes: int | None = None, process_id: int | None = None,
               *, heartbeat_timeout: int = 100, timeout_minutes: int | None = None) -> None:
    """Joins the processes of one run; a no-op without a coordinator address (one process, the default).

    "auto" lets JAX read the launcher's environment (SLURM, Open MPI, TPU pods). A process that stops answering
    for `heartbeat_timeout` seconds makes every other process exit in one line instead of waiting forever
    (`PeerWatch`, or `lost_peer` when a collective with it fails first); JAX's own heartbeat, which would abort them
    with a stack of C++ logs, is set to twice that as a backstop. `timeout_minutes` (Megatron's
    --distributed-timeout-minutes) is how long the processes wait for each other to join: jax.distributed.initialize's
    initialization_timeout. JAX has no timeout for a collective itself (Megatron's NCCL timeout); the peer watch
    stands in for it. Process 0 hosts JAX's coordination service in a child process (`ServiceProcess`), so that the
    service outlives process 0 when it dies and the others can stop in one line too.
    """
    check_coordinator(coordinator_address, num_processes, process_id)
    if coordinator_address is None:
        return
    # CPU collectives across processes go through gloo (XLA's default CPU runtime has none); GPUs and TPUs ignore it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    joining = 60 * timeout_minutes if timeout_minutes else max(heartbeat_timeout, 60)
    timeouts = dict(initialization_timeout=joining, heartbeat_timeout_seconds=2 * heartbeat_timeout + 10,
                    shutdown_timeout_seconds=max(heartbeat_timeout, 10))
    with _service_in_child_process(linger=heartbeat_timeout + 10), _joined_within(joining):
        if coordinator_address == "auto":
            jax.distributed.initialize(**timeouts)
        else:
            jax.distributed.initialize(coordinator_address, num_processes, process_id, **timeouts)
    global _watch
    if jax.process_count() > 1:
        _watch = PeerWatch(heartbeat_timeout)


@contextlib.contextmanager
def _joined_within(seconds: int):
    """Ends the process in one line, a second before JAX's own deadline, when the others have not joined by then:
    at the deadline JAX's client aborts from C++ (a fatal log and a stack, exit status 134)."""
    def give_up():
        print(f"error: the other processes did not join within {seconds} s (--distributed-timeout-minutes); start "
              "every process with the same --coordinator-address and --num-processes, each with its own "
              "--process-id.", file=sys.stderr, flush=True)
        os._exit(2)  # not sys.exit: the main thread is inside JAX's join

    timer = threading.Timer(max(seconds - 1, 1), give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def check_coordinator(address: str | None, num_processes: int | None, process_id: int | None) -> None:
    """The multi-process flags before any joining: a coordinator given as HOST:PORT with the process count and rank
    (or auto, where the launcher gives them), and a count or rank only with a coordinator (they were ignored without
    one; one process of rank 0 is what no flags mean anyway)."""
    if address is None:
        if num_processes not in (None, 1) or process_id not in (None, 0):
            raise ValueError("--num-processes and --process-id join processes through --coordinator-address "
                             "HOST:PORT (process 0's); pass it too, or leave them out for one process.")
        return
    if address == "auto":
        return
    host, _, port = address.rpartition(":")
    ipv6_unbracketed = ":" in host and not (host.startswith("[") and host.endswith("]"))
    if not (host and not ipv6_unbracketed and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"--coordinator-address {address} is not HOST:PORT (a port 1-65535, e.g. 10.0.0.1:1234 or "
                         "[::1]:1234); pass process 0's address and a free port, or auto under SLURM/MPI/TPU.")
    if num_processes is None or process_id is None:
        raise ValueError("--coordinator-address needs --num-processes and --process-id (this process's rank, "
                         "0 .. num-processes - 1); or pass --coordinator-address auto under SLURM/MPI/TPU.")
    if process_id >= num_processes:
        raise ValueError(f"--process-id {process_id} must be below --num-processes {num_processes} (ranks are "
                         f"0 .. {num_processes - 1}).")


def _runtime_library():
    """The jaxlib module whose `get_distributed_runtime_service` jax.distributed calls (None if this JAX has none)."""
    from jax._src import distributed

    library = getattr(distributed, "_jax", None) or getattr(distributed, "xla_extension", None)
    return library if hasattr(library, "get_distributed_runtime_service") else None


@contextlib.contextmanager
def _service_in_child_process(linger: int):
    """While jax.distributed.initialize runs, process 0's coordination service starts as a `ServiceProcess` instead of
    inside this process, serving `linger` seconds after process 0 is gone. Called in any other way than jax 0.11's
    (bind address, process count, heartbeat and shutdown timeouts; mutual TLS and recoverability off), the service
    is JAX's own, inside this process."""
    library = _runtime_library()
    if library is None:
        yield
        return
    in_process = library.get_distributed_runtime_service
    timeouts = {"heartbeat_timeout", "shutdown_timeout"}

    def start(*args, **kwargs):
        others = [value for key, value in kwargs.items() if key not in timeouts]  # JAX's mTLS, recoverability
        if len(args) != 2 or not timeouts <= kwargs.keys() or any(others):
            return in_process(*args, **kwargs)
        return ServiceProcess(*args, kwargs["heartbeat_timeout"], kwargs["shutdown_timeout"], linger)

    library.get_distributed_runtime_service = start
    try:
        yield
    finally:
        library.get_distributed_runtime_service = in_process


class ServiceProcess:
    """JAX's coordination service (the key-value store and heartbeats every process's client talks to), run in a
    child process of process 0 rather than inside it.

    Hosted inside process 0, the service died with it, and JAX's client on every other process then aborted from
    C++ at once, before the peer watch could say anything. In its own process it outlives process 0: the others
    see process 0 fall silent like any other peer and stop in one line. The child ignores SIGINT and SIGTERM (the
    run's processes stop on them, and need the service while they save), is told to shut down by a normal
    `jax.distributed.shutdown`, and otherwise (process 0 killed, or stopped by its peer watch) keeps serving for
    `linger` seconds (the peer timeout plus 10 s: the others' time to notice and stop), then exits and frees the
    coordinator's port.
    """

    def __init__(self, bind_address: str, num_processes: int, heartbeat_timeout: int, shutdown_timeout: int,
                 linger: int):
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                          env.get("PYTHONPATH")]))
        args = [bind_address, str(num_processes), str(heartbeat_timeout), str(shutdown_timeout), str(linger)]
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from mtx.distributed import serve; serve(sys.argv[1:])", *args],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            start_new_session=True)
        started = select.select([self.process.stdout], [], [], 120)[0]  # a Python start and a bind: seconds
        said = self.process.stdout.readline().strip() if started else "no answer in 120 s"
        self.process.stdout.close()
        if said != "serving":
            self.process.kill()
            raise ValueError(f"JAX's coordination service did not start on {bind_address} ({said or 'it exited'}); "
                             "is the port of --coordinator-address free? (a run's service frees it "
                             "--distributed-timeout + 10 s after the run stops)")

    def shutdown(self):
        with contextlib.suppress(OSError):
            self.process.stdin.write("shutdown\n")
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def serve(argv: list[str]) -> None:
    """The child of `ServiceProcess`: starts the service, says "serving", and waits for process 0's order to shut
    down; if process 0 is gone instead (its end of the pipe closes without the order), it serves the others for
    `linger` seconds first."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    bind_address, num_processes, heartbeat_timeout, shutdown_timeout, linger = argv[0], *map(int, argv[1:])
    try:
        service = _runtime_library().get_distributed_runtime_service(
            bind_address, num_processes, heartbeat_timeout=heartbeat_timeout, shutdown_timeout=shutdown_timeout)
    except Exception as e:
        print(first_line(e, 200), flush=True)
        return
    print("serving", flush=True)
    if sys.stdin.readline().strip() != "shutdown":
        time.sleep(linger)
    service.shutdown()


def initialize_from(p) -> None:
    """`initialize` with a ParallelConfig's multi-host flags (--coordinator-address, --num-processes, --process-id,
    --distributed-timeout, --distributed-timeout-minutes)."""
    initialize(p.coordinator_address, p.num_processes, p.process_id, heartbeat_timeout=p.distributed_timeout,
               timeout_minutes=p.distributed_timeout_minutes)


def is_main_process() -> bool:
    """True on the one process that logs, prints and writes run files (process 0)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Waits for every process to reach `name` (a no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


_PEER_LOST = ("Gloo", "Connection reset", "Connection refused", "UNAVAILABLE", "heartbeat", "DEADLINE_EXCEEDED",
              "NCCL", "Socket closed")


def lost_peer(error: Exception, save: str | None) -> str | None:
    """The one-line message for a collective that failed because another process went away (None for any other
    error, and with one process): what happened and how to resume."""
    first = first_line(error, 160)
    if jax.process_count() == 1 or not any(marker in str(error) for marker in _PEER_LOST):
        return None
    resume = f"resume with --load {save} once every host is back" if save else "restart it once every host is back"
    return f"another process of this run stopped answering ({first}); this one stops too: {resume}."


class PeerWatch:
    """Ends this process with one line (exit status 1) when another process of the run stops answering.

    A thread beats a counter into the coordination service's key-value store every `timeout` / 5 seconds and reads
    every peer's: a peer whose counter has not moved for `timeout` seconds, or a store that no longer answers (the
    service process of process 0 that hosts it is gone), ends the process with `os._exit` (a normal exit would wait
    at JAX's shutdown barrier for the process that is gone). A process that finishes (`finish`) says so first, so
    the others do not mistake its silence; one that fails stops beating without saying so, and the others stop too,
    process 0 included (the service runs in a process of its own, `ServiceProcess`).
    """

    def __init__(self, timeout: float):
        self.timeout, self.hint = timeout, "restart it once every host is back"
        self.me, self.peers = jax.process_index(), [i for i in range(jax.process_count()) if i != jax.process_index()]
        from jax._src.distributed import global_state

        self.store, self.stopped = global_state.client, threading.Event()
        self.thread = threading.Thread(target=self._run, name="mtx-peer-watch", daemon=True)
        self.thread.start()
        atexit.register(self.stop)  # after jax.distributed's own atexit shutdown is registered: runs before it

    def _run(self):
        seen = {peer: (None, time.monotonic()) for peer in self.peers}
        beat = 0
        while not self.stopped.wait(self.timeout / 5):
            try:
                beat += 1
                self.store.key_value_set(f"mtx/peers/beat/{self.me}", str(beat), allow_overwrite=True)
                said = dict(self.store.key_value_dir_get("mtx/peers/"))
            except Exception as e:  # the store is gone (process 0's child that hosts it was killed)
                if not self.stopped.is_set():
                    self._end(f"the run's coordination service stopped answering ({type(e).__name__})")
                return
            for peer in self.peers:
                value, (last, since) = said.get(f"mtx/peers/beat/{peer}"), seen[peer]
                if f"mtx/peers/done/{peer}" in said:
                    continue
                if value != last:
                    seen[peer] = (value, time.monotonic())
                elif time.monotonic() - since > self.timeout and not self.stopped.is_set():
                    self._end(f"process {peer} of this run has not answered for {self.timeout:g} s")

    def _end(self, what: str):
        print(f"error: {what}; this process stops too: {self.hint}.", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)

    def finish(self):
        """This process is done: the others stop watching it."""
        if not self.stopped.is_set():
            self.store.key_value_set(f"mtx/peers/done/{self.me}", "1", allow_overwrite=True)
        self.stop()

    def stop(self):
        self.stopped.set()
        self.thread.join(timeout=1.0)  # a call into a store that is gone may hang: the thread is a daemon


_watch: PeerWatch | None = None


def watch_peers(save: str | None = None) -> PeerWatch | None:
    """The running peer watch (multi-process runs; None with one process), told how the run resumes: with --load of
    its --save directory, if it has one."""
    if _watch is not None and save:
        _watch.hint = f"resume with --load {save} once every host is back"
    return _watch
