"""Beyond one host: JAX's multi-controller runtime, one process per host over the same global mesh.

Every process runs the same program on its own devices; `jax.devices()` then lists the devices of all processes
and the collectives inside the shard_map cross hosts. `initialize` must run before anything asks JAX for a device
(mtx.run.prepare calls jax.devices()), so train.py and eval.py call it right after parsing their flags.
Only process 0 writes logs, metrics, config.json and prints; every process takes part in checkpoints (orbax).
"""

from __future__ import annotations

import jax


def initialize(coordinator_address: str | None, num_processes: int | None = None, process_id: int | None = None,
               *, heartbeat_timeout: int = 100, timeout_minutes: int | None = None) -> None:
    """Joins the processes of one run; a no-op without a coordinator address (one process, the default).

    "auto" lets JAX read the launcher's environment (SLURM, Open MPI, TPU pods). A process that stops answering
    for `heartbeat_timeout` seconds makes every other process exit with an error instead of waiting forever: the
    coordination service aborts them, unless a collective with the dead process fails first, with a Python error
    that train.py reports in one line (`lost_peer`). `timeout_minutes` (Megatron's --distributed-timeout-minutes)
    is how long the processes wait for each other to join: jax.distributed.initialize's initialization_timeout.
    JAX has no timeout for a collective itself (Megatron's NCCL timeout); the heartbeat stands in for it.
    """
    if coordinator_address is None:
        return
    # CPU collectives across processes go through gloo (XLA's default CPU runtime has none); GPUs and TPUs ignore it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    joining = 60 * timeout_minutes if timeout_minutes else max(heartbeat_timeout, 60)
    timeouts = dict(initialization_timeout=joining, heartbeat_timeout_seconds=heartbeat_timeout,
                    shutdown_timeout_seconds=max(heartbeat_timeout, 10))
    if coordinator_address == "auto":
        jax.distributed.initialize(**timeouts)
    else:
        if num_processes is None or process_id is None:
            raise ValueError("--coordinator-address needs --num-processes and --process-id (this process's rank, "
                             "0 .. num-processes - 1); or pass --coordinator-address auto under SLURM/MPI/TPU.")
        jax.distributed.initialize(coordinator_address, num_processes, process_id, **timeouts)


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
    first = (str(error).strip().splitlines() or [""])[0][:160]
    if jax.process_count() == 1 or not any(marker in str(error) for marker in _PEER_LOST):
        return None
    resume = f"resume with --load {save} once every host is back" if save else "restart it once every host is back"
    return f"another process of this run stopped answering ({first}); this one stops too: {resume}."
