"""The (data, pipeline, model) device mesh.

"model" is the innermost axis, so consecutive devices (one NVLink node on a GPU host) form a tensor-parallel
group, as Megatron places tensor parallelism inside a node and data parallelism across nodes (paper, app. B.1).
With several processes (one per host, mtx.distributed) the mesh spans the devices of all of them, ordered by
process, so that each "model" group lies inside one process and only "data" and "pipeline" cross hosts.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from mtx.devices import count_source

AXES = ("data", "pipeline", "model")
DATA, PIPELINE, MODEL = AXES
BATCH = P(DATA)  # a batch's layout (tokens, targets, masks: rows first): rows split over "data", whole on each stage


def resolve_sizes(data: int, pipeline: int, model: int, num_devices: int) -> tuple[int, int, int]:
    """Returns (data, pipeline, model) with data == -1 replaced by all devices left over; refuses bad sizes."""
    for name, size in (("--tensor-model-parallel-size", model), ("--pipeline-model-parallel-size", pipeline)):
        if size < 1:
            raise ValueError(f"{name} must be >= 1, got {size}.")
    if data == -1:
        if num_devices % (pipeline * model):  # (a count XLA_FLAGS chose is named with it)
            raise ValueError(
                f"{num_devices} devices{count_source()} are not divisible by --tensor-model-parallel-size {model} x "
                f"--pipeline-model-parallel-size {pipeline}; choose sizes whose product divides {num_devices}."
            )
        data = num_devices // (pipeline * model)
    if data < 1:
        raise ValueError(f"data-parallel size must be >= 1 or -1 (all remaining devices), got {data}.")
    if data * pipeline * model > num_devices:
        raise ValueError(
            f"the mesh data x pipeline x model = {data} x {pipeline} x {model} needs {data * pipeline * model} "
            f"devices but only {num_devices} exist{count_source()}; lower the parallel sizes."
        )
    return data, pipeline, model


def check_tensor_parallel_fits(model: int, local_devices: int, processes: int) -> None:
    """Refuses a "model" group that would cross processes (hosts): tensor parallelism stays inside a host."""
    if processes > 1 and local_devices % model:
        raise ValueError(
            f"--tensor-model-parallel-size {model} does not fit the {local_devices} devices of one process: tensor "
            f"parallelism stays inside a host; choose a divisor of {local_devices}.")


def make_mesh(data: int = -1, pipeline: int = 1, model: int = 1, devices=None) -> jax.sharding.Mesh:
    """Builds the ("data", "pipeline", "model") mesh; data=-1 takes all devices not used by pipeline x model."""
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_sizes(data, pipeline, model, len(devices))
    n = int(np.prod(shape))
    axis_types = (jax.sharding.AxisType.Explicit,) * 3
    if jax.process_count() > 1:
        check_tensor_parallel_fits(model, jax.local_device_count(), jax.process_count())
        if n != len(devices):
            raise ValueError(f"with {jax.process_count()} processes the mesh must use all {len(devices)} devices, "
                             f"not {n}; use --data-parallel-size -1.")
        # Process-major order: consecutive devices, hence each "model" group, share a process.
        devices = sorted(devices, key=lambda d: (d.process_index, d.id))
        return jax.sharding.Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=axis_types)
    if n == len(jax.devices()) and devices == list(jax.devices()):
        # jax.make_mesh orders devices so that the innermost axis gets the fastest links.
        return jax.make_mesh(shape, AXES, axis_types=axis_types)
    return jax.sharding.Mesh(np.asarray(devices[:n]).reshape(shape), AXES, axis_types=axis_types)
