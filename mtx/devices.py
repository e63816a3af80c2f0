"""Simulated CPU devices: how mtx runs its multi-device programs on a machine without an accelerator.

XLA's CPU platform makes `--xla_force_host_platform_device_count=N` devices when JAX starts its backends (the first
device query or computation), not when jax is imported. Only the CPU platform reads the flag, so on a GPU host
`jax.devices()` still lists the GPUs. This module imports nothing of JAX at import, so entry points call it first.
And if the host has GPUs but JAX runs on CPU (a jaxlib without CUDA: `pip install -e .` alone), `check_accelerator`
says so loudly instead of letting a run train on simulated devices. `use_compilation_cache` points JAX's persistent
compilation cache at a directory, so that the second start of a program skips XLA's compilation, and
`use_memory_fraction` gives JAX's GPU allocator 0.9 of each card instead of JAX's 0.75.
"""

from __future__ import annotations

import glob
import os
import re
import sys
from pathlib import Path

_FLAG = "xla_force_host_platform_device_count"
MAX_CPU_DEVICES = 4096  # simulated devices: more is a typo (each is a thread pool XLA creates)


def cpu_devices_flag(n: int) -> str:
    """The XLA flag that makes the CPU platform expose n devices, e.g. for the XLA_FLAGS of a subprocess."""
    if n < 1:
        raise ValueError(f"need at least one simulated CPU device, got {n}.")
    return f"--{_FLAG}={n}"


def simulate_cpu_devices(n: int = 8) -> bool:
    """Appends the flag for n CPU devices to $XLA_FLAGS unless it already names a device count (the caller's choice
    wins); returns whether it did.

    Importing jax before this call is fine. Once JAX has started its backends the flag can no longer take effect,
    so a call that would set it then raises RuntimeError instead of being silently ignored.
    """
    flag = cpu_devices_flag(n)
    flags = os.environ.get("XLA_FLAGS", "")
    if _FLAG in flags:
        return False
    if _backends_started():
        raise RuntimeError(f"simulate_cpu_devices({n}) came too late: JAX has already started its backends, so XLA "
                           "will not read the new XLA_FLAGS; call it before the first jax.devices() or computation.")
    os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
    return True


def devices() -> list:
    """jax.devices(), or a one-line ValueError naming the environment setting when JAX cannot start its backend
    (JAX_PLATFORMS naming a platform this install lacks; XLA_FLAGS asking for 0 CPU devices). Other errors (a peer
    lost in a multi-process run's first device query, say) are raised as they are."""
    import jax

    if (count := _count_flag()) is not None and not _backends_started():  # XLA would abort the process on it
        value = count.split("=", 1)[1] if "=" in count else ""
        if not re.fullmatch(r"[0-9]+", value) or not 1 <= int(value) <= MAX_CPU_DEVICES:
            raise ValueError(f"XLA_FLAGS {count} asks for {'no' if value.strip('0') == '' else 'no usable count of'} "
                             f"CPU devices; pass a count from 1 to {MAX_CPU_DEVICES} (mtx sets 8 when XLA_FLAGS names "
                             "none).")
    try:
        return jax.devices()
    except (RuntimeError, AssertionError) as e:
        text = str(e).strip()
        platforms = os.environ.get("JAX_PLATFORMS", "").strip()
        if not platforms or not (isinstance(e, AssertionError) or "Unable to initialize backend" in text):
            raise
        reason = text.splitlines()[0].split(" (set JAX_PLATFORMS")[0][:200] if text else "its plugin did not load"
        raise ValueError(f"JAX cannot start the backend of JAX_PLATFORMS={platforms} ({reason}); unset "
                         "JAX_PLATFORMS (or set it to cpu), or install jax for that platform.") from None


def _count_flag() -> str | None:
    """The simulated CPU device count flag in $XLA_FLAGS, if it names one (the last, which XLA takes)."""
    return next((flag for flag in reversed(os.environ.get("XLA_FLAGS", "").split()) if _FLAG in flag), None)


def count_source() -> str:
    """Where a simulated CPU device count came from, for a message about the count: " (XLA_FLAGS
    --xla_force_host_platform_device_count=N)" when that flag sets it and JAX runs on the CPU, else ""."""
    flag = _count_flag()
    if flag is None or "jax" not in sys.modules or sys.modules["jax"].default_backend() != "cpu":
        return ""
    return f" (XLA_FLAGS {flag})"


def use_compilation_cache(path: str | None) -> Path | None:
    """Points JAX's persistent compilation cache at `path` (`~` expanded, created if missing), in a folder for the
    GPU memory share in force (use_memory_fraction), and returns that folder; None leaves JAX's setting alone; a path
    it cannot use is refused in one line. Programs that took over a second to compile are stored there (files JAX
    names by the program's hash) and a later process that compiles the same program on the same devices loads them.
    JAX's hash leaves out the allocator's share, which XLA plans the program's memory in: a program planned for a
    larger share can run out of memory under a smaller one, so each share has its own folder. Call it before the
    first compilation: JAX decides once per process whether the cache is in use."""
    if path is None:
        return None
    import jax

    from mtx.files import check_writable

    where = Path(path).expanduser().absolute()
    check_writable(where, "--compilation-cache-dir")  # refuses a file, a path through one, or no write permission
    where = where / f"gpu-memory-{use_memory_fraction()}"
    where.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(where))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    return where


MEMORY_FRACTION = "XLA_CLIENT_MEM_FRACTION"  # what JAX's GPU plugin reads (jaxlib 0.10.2 on)
OLD_MEMORY_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"  # its older name, still read
DEFAULT_GPU_MEMORY_FRACTION = 0.9  # JAX's own 0.75 leaves a quarter of each card to no one (docs/design.md)
JAX_MEMORY_FRACTION = 0.75
_GPU_SETTINGS = ("XLA_PYTHON_CLIENT_", "XLA_CLIENT_")  # the environment's settings of JAX's GPU plugin


def use_memory_fraction(fraction: float | None = None) -> float:
    """Sets the share of each GPU's memory that JAX's allocator holds ($XLA_CLIENT_MEM_FRACTION) and returns the share
    in force: `fraction` (--gpu-memory-fraction), else the environment's, else mtx's 0.9. XLA compiles a program to
    fit the allocator's share: under JAX's default 0.75 the 1.2B step at micro batch 24 on an 80 GB H100 is
    recomputed into 57 GiB and runs 1.6% slower than at 0.9, in 68 GiB (docs/benchmarks.md 19). The rest of the card
    is for what the allocator does not hold (the CUDA context, NCCL's buffers). Call it before JAX starts its
    backends (a multi-process run's join starts them), which read the share once; after, it changes nothing and
    returns the share they started with. Refused in one line: a share outside (0, 1], one the environment
    contradicts, on a GPU one asked for after the backends started with another, and the GPU settings JAX's plugin
    would refuse (`check_gpu_environment`)."""
    from mtx.schema_checks import check_field

    # The config's own check (its range, RANGES), before the share reaches JAX; the field's declared type is repeated
    # here because mtx.config imports this module.
    check_field("gpu_memory_fraction", float | None, fraction)
    held = share_set()
    check_gpu_environment()
    if _backends_started():  # the allocator is made, with the environment's share or JAX's own
        in_force = JAX_MEMORY_FRACTION if held is None else held[1]
        if fraction is not None and fraction != in_force:
            import jax

            if jax.default_backend() == "gpu":  # asked for, and would be silently ignored
                raise ValueError(f"--gpu-memory-fraction {fraction} comes too late: JAX has already started its "
                                 f"backends with a share of {in_force:g}; set {MEMORY_FRACTION} before the first "
                                 "device query.")
        return in_force
    if held is not None:
        name, value = held
        if fraction is not None and fraction != value:
            raise ValueError(f"--gpu-memory-fraction {fraction} contradicts {name}={os.environ[name]}; pass one of "
                             "them.")
        return value
    fraction = DEFAULT_GPU_MEMORY_FRACTION if fraction is None else fraction
    os.environ[MEMORY_FRACTION] = str(fraction)
    return fraction


def share_set() -> tuple[str, float] | None:
    """The share of each GPU the environment sets, as (its variable, the share), or None when neither
    $XLA_CLIENT_MEM_FRACTION nor its older name is set (JAX reads an empty one as unset). A value that is no share,
    and both names set, are refused in one line (jaxlib's GPU options refuse both names; by jax's source the plugin's
    error is only logged and JAX goes on without the GPU, not tried on one)."""
    named = [(name, text) for name in (MEMORY_FRACTION, OLD_MEMORY_FRACTION) if (text := os.environ.get(name, ""))]
    if len(named) > 1:
        raise ValueError(f"{MEMORY_FRACTION} and {OLD_MEMORY_FRACTION} are both set; unset {OLD_MEMORY_FRACTION}, "
                         "JAX's older name for the same share.")
    if not named:
        return None
    name, text = named[0]
    from mtx.schema_checks import RANGES, in_range

    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not in_range(value, RANGES["gpu_memory_fraction"]):  # (NaN fails it)
        raise ValueError(f"{name}={text} is not a share of GPU memory; set it to a number in (0, 1] such as 0.9, or "
                         "unset it.")
    return name, value


def check_gpu_environment() -> None:
    """On a host with GPUs, refuses in one line the environment's GPU settings that JAX's GPU plugin refuses
    (XLA_PYTHON_CLIENT_ALLOCATOR, XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB, the memory share): the plugin's error is
    only logged, and JAX goes on without the GPU (read from jax's source, not tried on a GPU). jaxlib's own check is
    asked (where this jaxlib has it)."""
    try:
        from jaxlib.xla_client import generate_pjrt_gpu_plugin_options as plugin_options
    except ImportError:
        return
    if not visible_gpus():
        return
    try:
        plugin_options()
    except ValueError as e:
        settings = ", ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(_GPU_SETTINGS))
        raise ValueError(f"JAX's GPU plugin refuses this environment ({str(e).strip()}; set: {settings}); fix or "
                         "unset that variable.") from None


def _backends_started() -> bool:
    """Whether JAX has created its backends (after which XLA_FLAGS is no longer read). JAX has no public query, so
    this asks its internal module where it is loaded; without it (an unknown JAX version) the answer is False."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    started = getattr(bridge, "backends_are_initialized", None)
    return bool(started and started())


def visible_gpus() -> list[str]:
    """The GPUs this host's drivers expose (NVIDIA device nodes; AMD's ROCm interface), whatever JAX uses."""
    return sorted(glob.glob("/dev/nvidia[0-9]*")) + (["/dev/kfd"] if os.path.exists("/dev/kfd") else [])


def check_accelerator() -> str | None:
    """A warning when the host has GPUs but JAX runs on CPU without being told to (JAX_PLATFORMS), else None."""
    import jax

    gpus = visible_gpus()
    if not gpus or jax.default_backend() != "cpu" or os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        return None
    return (f"mtx: WARNING: this host has {len(gpus)} GPU(s) ({', '.join(gpus[:4])}) but JAX runs on the CPU (a "
            "jaxlib without GPU support), so this run uses simulated CPU devices. Install the CUDA build: pip install "
            "-e '.[cuda12]' (or '.[cuda13]'); set JAX_PLATFORMS=cpu to mean the CPU.")

