"""The persistent compilation cache (`--compilation-cache-dir`, used on GPUs): a second process compiling the same
program loads it from the directory, and a path it cannot use is refused in one line before any device work."""

import os
import subprocess
import sys
import textwrap

import pytest

from mtx.devices import use_compilation_cache

PROGRAM = textwrap.dedent("""
    import sys, time
    import jax, jax.numpy as jnp
    from mtx.devices import use_compilation_cache
    use_compilation_cache(sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # store even this quick program
    hits = []  # programs this process loaded from the cache instead of compiling them
    jax.monitoring.register_event_listener(
        lambda event, **_: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None)
    step = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
    print(float(step(jnp.ones((32, 32)))), len(hits))
""")


def test_a_second_process_loads_the_compiled_program(tmp_path):
    first, second = [_compile(tmp_path / "xla") for _ in range(2)]
    cache = tmp_path / "xla" / "gpu-memory-0.9"  # created by the first process: the programs of mtx's GPU memory share
    entries = sorted(p.name for p in cache.iterdir())
    assert any(name.startswith("jit__lambda") for name in entries), entries
    # the same value; the first compiled the step (no hit), the second loaded it and wrote nothing new
    assert first[0] == second[0] and first[1] == "0" and int(second[1]) >= 1, (first, second)
    assert sorted(p.name for p in cache.iterdir()) == entries


def test_each_gpu_memory_share_has_its_programs(tmp_path):
    """JAX's cache key leaves out the allocator's share; a program planned for 0.95 of a card, loaded under 0.9,
    could run out of memory, so the shares' programs live apart: a second share compiles anew."""
    assert _compile(tmp_path)[1] == "0"
    assert _compile(tmp_path, share="0.5")[1] == "0" and _compile(tmp_path, share="0.5")[1] != "0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-memory-0.5", "gpu-memory-0.9"]


def _compile(cache, share: str | None = None) -> list[str]:
    """PROGRAM in a new process -> its output (the value, the cache hits), under mtx's share or `share`."""
    names = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # JAX's share, its older name
    env = {k: v for k, v in os.environ.items() if k not in names} | ({} if share is None else {names[0]: share})
    return subprocess.run([sys.executable, "-c", PROGRAM, str(cache)], capture_output=True, text=True, env=env,
                          check=True).stdout.split()


def test_a_path_the_cache_cannot_use_is_refused(tmp_path):
    (tmp_path / "file").write_text("a user's file")
    for path in (tmp_path / "file", tmp_path / "file" / "xla"):
        with pytest.raises(ValueError, match=r"^--compilation-cache-dir .*: .*file is a file, not a directory"):
            use_compilation_cache(str(path))  # refused before JAX's setting is touched
    assert (tmp_path / "file").read_text() == "a user's file"
    assert use_compilation_cache(None) is None
