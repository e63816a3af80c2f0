"""mtx.devices: simulated CPU devices, checked in fresh processes (this one's backends started long ago)."""

import os
import subprocess
import sys
import textwrap

import pytest

from mtx.devices import cpu_devices_flag, simulate_cpu_devices

SHARES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # JAX's GPU memory share, its older name


def _run(code: str, xla_flags: str | None = None, args=()) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", *SHARES)}
    env["JAX_PLATFORMS"] = "cpu"
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env, capture_output=True,
                          text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_sets_the_count_before_the_backends_start_even_after_import_jax():
    out = _run("""
        import sys
        from mtx.devices import simulate_cpu_devices
        print("jax" in sys.modules)  # the module itself never imports jax
        import jax  # importing is fine: XLA reads the flag at the first device query
        print(simulate_cpu_devices(3), jax.device_count())
    """)
    assert out == ["False", "True", "3"]


def test_an_existing_count_wins():
    out = _run("""
        import jax
        from mtx.devices import simulate_cpu_devices
        print(simulate_cpu_devices(5), jax.device_count())
    """, xla_flags=cpu_devices_flag(2))
    assert out == ["False", "2"]


def test_too_late_is_an_error_not_a_silent_single_device():
    out = _run("""
        import jax
        from mtx.devices import simulate_cpu_devices
        jax.devices()  # the backends start here, with one CPU device
        try:
            simulate_cpu_devices(4)
        except RuntimeError as e:
            print("too" in str(e), jax.device_count())
    """)
    assert out == ["True", "1"]


def test_flag_and_bad_counts():
    assert cpu_devices_flag(8) == "--xla_force_host_platform_device_count=8"
    with pytest.raises(ValueError, match="at least one"):
        simulate_cpu_devices(0)


def test_gpus_left_unused_are_reported(monkeypatch):
    """A host with GPUs whose JAX runs on CPU (a jaxlib without CUDA) gets a warning naming the install; none when
    there are no GPUs or JAX_PLATFORMS=cpu says the CPU is meant."""
    import mtx.devices as devices

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(devices, "visible_gpus", lambda: ["/dev/nvidia0", "/dev/nvidia1"])
    warning = devices.check_accelerator()
    assert "this host has 2 GPU(s)" in warning and "pip install -e '.[cuda12]'" in warning
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert devices.check_accelerator() is None
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(devices, "visible_gpus", lambda: [])
    assert devices.check_accelerator() is None


@pytest.mark.parametrize("env, said", [
    ({"JAX_PLATFORMS": "nosuchplatform"}, "JAX cannot start the backend of JAX_PLATFORMS=nosuchplatform ("),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=0"}, "asks for no CPU devices; pass a count from 1 to"),
    # XLA's own abort (its whole flag list), a traceback, and a count that named the first of two flags, once
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=abc"}, "=abc asks for no usable count of CPU devices"),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=-2"}, "=-2 asks for no usable count"),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_force_host_platform_device_count=3"},
     "3 devices (XLA_FLAGS --xla_force_host_platform_device_count=3) are not divisible"),
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "90%"}, "XLA_PYTHON_CLIENT_MEM_FRACTION=90% is not a share of GPU memory"),
    # (jaxlib's GPU options refuse both; JAX only logs its plugin's error)
    ({"XLA_CLIENT_MEM_FRACTION": "0.8", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.8"}, "are both set; unset"),
])
def test_a_backend_jax_cannot_start_is_one_line(env, said):
    """JAX_PLATFORMS naming a platform this install lacks, or no CPU devices: train.py says so in one line, exit
    status 2, before anything else (was a traceback from the first jax.devices())."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, os.path.join(root, "train.py"), "--train-iters", "1"], capture_output=True,
                         text=True, env={**os.environ, "XLA_FLAGS": "", **env}, timeout=120)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2 and len(errors) == 1 and said in errors[0], run.stderr[-2000:]
    assert "Traceback" not in run.stderr


def test_the_gpu_memory_share_is_set_before_the_backends_start():
    """mtx's 0.9 of each GPU (JAX's own 0.75 makes XLA recompute large steps to fit), set before the first device
    query under the name JAX reads; once the backends run, the share they started with is what is in force."""
    out = _run("""
        import os
        from mtx.devices import use_memory_fraction
        print(use_memory_fraction(), os.environ["XLA_CLIENT_MEM_FRACTION"])
        import jax
        jax.devices()
        print(use_memory_fraction(), use_memory_fraction(0.9), use_memory_fraction(0.5))  # (on the CPU nothing refused)
    """)
    assert out == ["0.9", "0.9", "0.9", "0.9", "0.9"]


def test_a_multi_process_run_sets_the_share_before_joining(tmp_path):
    """Joining the other processes (jax.distributed) starts JAX's backends: a share set after it would be ignored."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = _run(f"""
        import os, sys
        import jax
        import mtx.run, train

        def prepare(cfg):  # where train.py's own work would start: the share, and the backends started
            from mtx.devices import _backends_started
            print(os.environ.get("XLA_CLIENT_MEM_FRACTION"), _backends_started(), jax.process_count())
            raise ValueError("stop here")

        mtx.run.prepare = prepare
        print(train.main(["--gpu-memory-fraction", "0.8", "--coordinator-address", "127.0.0.1:{port}",
                          "--num-processes", "1", "--process-id", "0", "--run-dir", sys.argv[1]]))
    """, args=[str(tmp_path / "run")])
    assert out == ["0.8", "True", "1", "2"]


def test_gpu_memory_shares_asked_for(monkeypatch):
    import mtx.devices as devices

    for name in SHARES:  # (recorded first, so that the end restores this process's environment)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(devices, "_backends_started", lambda: False)
    assert devices.use_memory_fraction(0.8) == 0.8 and os.environ["XLA_CLIENT_MEM_FRACTION"] == "0.8"
    assert devices.use_memory_fraction(0.8) == 0.8  # (now the environment's, which agrees)
    with pytest.raises(ValueError, match=r"^--gpu-memory-fraction 0.7 contradicts XLA_CLIENT_MEM_FRACTION=0.8; "
                                         "pass one of them.$"):
        devices.use_memory_fraction(0.7)
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # JAX's older name, still read
    assert devices.use_memory_fraction() == 0.6 and devices.share_set() == ("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.6)
    for bad in ("0", "1.5", "nan", "90%"):
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", bad)
        with pytest.raises(ValueError, match="is not a share of GPU memory; set it to a number in"):
            devices.use_memory_fraction()
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "")  # empty: unset, as JAX reads it
    assert devices.share_set() is None
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    for bad in (0.0, 1.5, float("nan")):  # (the config's range check, before the share reaches JAX)
        with pytest.raises(ValueError, match=r"^--gpu-memory-fraction must be in \(0, 1\], got"):
            devices.use_memory_fraction(bad)
    assert not any(name in os.environ for name in SHARES)
    # Too late: the share the backends started with is in force; on a GPU another one asked for is refused.
    import jax

    monkeypatch.setattr(devices, "_backends_started", lambda: True)
    assert devices.use_memory_fraction() == 0.75 and devices.use_memory_fraction(0.5) == 0.75  # (the CPU's)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert devices.use_memory_fraction() == 0.75 and devices.use_memory_fraction(0.75) == 0.75
    with pytest.raises(ValueError, match="--gpu-memory-fraction 0.5 comes too late: JAX has already started its "
                                         "backends with a share of 0.75"):
        devices.use_memory_fraction(0.5)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.8")  # what they started with
    assert devices.use_memory_fraction() == 0.8
    with pytest.raises(ValueError, match="with a share of 0.8; set XLA_CLIENT_MEM_FRACTION before"):
        devices.use_memory_fraction(0.9)


@pytest.mark.parametrize("name, value, said", [
    ("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda-async", 'must be one of "default", "platform", "bfc", "cuda_async"'),
    ("XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB", "64MB", "invalid literal for int()"),
])
def test_gpu_settings_jax_would_refuse_are_one_line(monkeypatch, name, value, said):
    """jaxlib's GPU options refuse these, and JAX only logs its plugin's error (by its source); mtx refuses them, naming
    what is set, where the host has GPUs (elsewhere the plugin never reads them)."""
    import mtx.devices as devices

    for share in SHARES:  # (recorded, so that a share set here is taken back at the end)
        monkeypatch.setenv(share, "")
        monkeypatch.delenv(share)
    monkeypatch.setenv(name, value)
    assert devices.use_memory_fraction() is not None  # no GPUs here: nothing to refuse
    monkeypatch.setattr(devices, "visible_gpus", lambda: ["/dev/nvidia0"])
    with pytest.raises(ValueError, match=r"^JAX's GPU plugin refuses this environment \(.*") as refused:
        devices.use_memory_fraction()
    assert said in str(refused.value) and f"set: {name}={value}" in str(refused.value)
    assert str(refused.value).endswith("fix or unset that variable.") and "\n" not in str(refused.value)
