"""Bad input to the benchmark tools (bench.py, compile_probe.py, suite.py, profile_summary.py): one "error: " line
naming the fix, exit status 2, before any work; and no flag that would silently do nothing."""

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench, compile_probe, profile_summary, suite  # noqa: E402
from mtx.cli import OneLineParser, build_parser  # noqa: E402
from mtx.config import STEP_FIELDS  # noqa: E402


def _refused(main, argv, capsys) -> str:
    """main(argv)'s one error line; it must exit with status 2 (returned, or raised as argparse does)."""
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.startswith("error: ") and "\n" not in err, (status, err)
    return err


def _bench(argv, capsys, monkeypatch):
    """bench.py's command line with `argv` after the tiny preset -> (its one error line or None, what it measured)."""
    measured = []
    monkeypatch.setattr(bench, "measure", lambda cfg, **kw: measured.append((cfg, kw)) or {})
    status = bench.main(["--config", "configs/tiny.toml", *argv])
    err = capsys.readouterr().err.strip()
    assert (status == 2) == bool(err) and "\n" not in err, err
    return err or None, measured


@pytest.mark.parametrize("argv", [
    ["--train-iters", "5"], ["--eval-interval", "3"], ["--exit-interval", "3"], ["--num-workers", "2"],
    ["--tokenizer-type", "byte"], ["--vocab-file", "/nonexistent"], ["--save-interval", "5"],
    ["--keep-last-n-checkpoints", "2"], ["--generate-tokens", "3"], ["--no-profile"], ["--profile-step-start", "3"],
    ["--coordinator-address", "h:1"], ["--train-iters=5"]])
def test_bench_refuses_train_flags_it_does_not_use(capsys, monkeypatch, argv):
    """train.py flags of the run, not of its step: refused by name (they were accepted and ignored)."""
    err, measured = _bench(argv, capsys, monkeypatch)
    assert err and f"error: {argv[0].split('=')[0]} is a train.py flag the benchmark does not use" in err
    assert not measured


def test_bench_refuses_every_train_flag_outside_the_step():
    """The refused set is derived (every train.py flag whose field the step does not read), not a hand list: each one
    is refused, with any value, before the config is built."""
    steps = set(STEP_FIELDS)
    for action in build_parser()._actions:
        if action.dest in steps or action.dest in ("config", "help"):
            continue
        for flag in action.option_strings:
            argv = [flag] + ([] if action.nargs == 0 else ["1"])
            with pytest.raises(ValueError, match=f"^{flag} is a train.py flag the benchmark does not use"):
                bench.parse_flags(OneLineParser(prog="bench.py", add_help=False), argv, uses=steps)


def test_bench_takes_the_flags_of_the_step(capsys, monkeypatch):
    err, measured = _bench(["--hidden-size", "128", "--swiglu", "--no-scan-layers", "--lr", "0.5", "--seed", "3",
                            "--data-parallel-size", "-1", "--compilation-cache-dir", "none", "--steps", "2",
                            "--warmup", "1"], capsys, monkeypatch)
    cfg, kw = measured[0]
    assert err is None and (cfg.model.hidden_size, cfg.model.swiglu, cfg.training.scan_layers) == (128, True, False)
    assert (cfg.optimizer.lr, cfg.training.seed, cfg.training.compilation_cache_dir) == (0.5, 3, None)
    assert cfg.parallel.data_parallel_size == -1
    assert (kw["steps"], kw["warmup"]) == (2, 1)


def test_bench_and_compile_probe_help_list_their_own_flags(capsys):
    for main, own in ((bench.main, ("--steps", "--warmup", "--json", "--profile DIR")),
                      (compile_probe.main, ("OUT_DIR", "--top"))):
        with pytest.raises(SystemExit) as e:
            main(["--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and all(flag in out for flag in (*own, "--hidden-size", "--config")), out
        assert "--train-iters" not in out and "--save" not in out and "--data-path" not in out


@pytest.mark.parametrize("argv, fix", [
    (["--save", "/nonexistent/zzz"], "--save is a train.py flag the benchmark does not use"),
    (["--data-path", "/nope"], "--data-path is a train.py flag the benchmark does not use"),
    (["--compilation-cache-dir", "/x"], "--compilation-cache-dir is a train.py flag"),  # the probe compiles afresh
    (["--top", "x"], "argument --top: invalid int value: 'x'"),  # argparse's usage block, once
    (["--layer-calls"], "--layer-calls is a train.py flag the benchmark does not use"),  # one program probed
])
def test_compile_probe_refuses_flags_it_does_not_use(tmp_path, capsys, argv, fix):
    err = _refused(compile_probe.main, [str(tmp_path / "t"), "--config", "configs/tiny.toml", *argv], capsys)
    assert fix in err and not (tmp_path / "t").exists()


def test_compile_probe_of_a_preset_with_layer_calls_probes_the_fused_step(tmp_path, capsys, monkeypatch):
    """A preset's --layer-calls (the 1.2B one's) is left out, saying so: the probe compiles the fused step."""
    seen = []
    monkeypatch.setattr(compile_probe, "probe", lambda cfg, out, top: seen.append(cfg) or
                        {"trace_lower_s": 1.0, "compile_s": 1.0, "custom_calls": {}, "events": []})
    preset = tmp_path / "p.toml"
    preset.write_text(Path("configs/tiny.toml").read_text() + "layer_calls = true\n")
    assert compile_probe.main([str(tmp_path / "t"), "--config", str(preset)]) == 0
    assert not seen[0].training.layer_calls and "preset's --layer-calls left out" in capsys.readouterr().err


def test_suite_baseline_of_another_shape_is_one_line(tmp_path, capsys, monkeypatch):
    """bench.py's --json records are no suite records: the file, line and what a record needs (a KeyError, once)."""
    monkeypatch.setattr(suite, "run_row", lambda *a: pytest.fail("a row ran"))
    results = tmp_path / "b.jsonl"
    results.write_text(json.dumps({"step_s": 1.0, "tokens_per_s": 5.0}) + "\n")
    err = _refused(suite.main, ["--table-only", "--baseline", str(results)], capsys)
    assert f"--baseline {results} line 1 is not a suite record (name, gpus, script, model, result" in err
    results.write_text(json.dumps({"name": "x", "gpus": 1, "script": "benchmarks/bench.py", "model": "m",
                                   "result": {"step_s": 1.0}}) + "\n")  # a result of no numbers
    assert "line 1 is not a suite record" in _refused(suite.main, ["--table-only", "--baseline", str(results)], capsys)


@pytest.mark.parametrize("argv, fix", [
    (["--table-only"], "--table-only tabulates --baseline records; pass --baseline FILE"),  # an empty table, once
    (["--list", "--only", "zzz"], "no row of --rows 1gpu matches --only zzz"),  # once listed every row
    (["--list", "--plot", "x.png"], "--plot only acts with --table-only or when rows run; leave it out."),
    (["--list", "--steps", "3"], "--steps only acts when rows run; leave it out."),
    (["--table-only", "--baseline", "docs/scaling.jsonl", "--out", "x.jsonl"], "--out only acts when rows run;"),
    (["--rows", "1gpu", "--skip", "zzz"], "no row of --rows 1gpu matches --skip zzz"),  # a typo would run the rows
    (["--rows", "bogus"], "suite.py: argument --rows: invalid choice: 'bogus'"),  # argparse's usage block, once
])
def test_suite_refuses_requests_that_do_nothing(monkeypatch, capsys, argv, fix):
    monkeypatch.setattr(suite, "run_row", lambda *a: pytest.fail("a row ran"))
    assert fix in _refused(suite.main, argv, capsys)


def test_suite_list_lists_the_rows_selected(capsys):
    assert suite.main(["--list", "--rows", "2gpu", "--only", "DP 2", "--skip", "GPipe"]) == 0
    assert capsys.readouterr().out.splitlines() == ["2gpu: 1.2B, DP 2"]


def _trace(path: Path, data) -> Path:
    path.mkdir(parents=True)
    with gzip.open(path / "perfetto_trace.json.gz", "wt") as fh:
        json.dump(data, fh)
    return path


def _cpu_trace(path: Path) -> Path:
    """A CPU trace as JAX writes it: one /host:CPU process; each XLA thunk an event whose args name its device."""
    thunk = lambda name, ts, dur, device: {"ph": "X", "pid": 7, "tid": 1, "name": name, "ts": ts, "dur": dur,
                                           "args": {"device_ordinal": str(device), "hlo_op": name}}
    return _trace(path, {"traceEvents": [
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 7, "tid": 2, "name": "ThunkExecutor::Execute", "ts": 0, "dur": 900},  # no device: host
        thunk("dot.1", 0, 300, 0), thunk("all-reduce.2", 300, 100, 0), thunk("copy.3", 0, 50, 1)]})


def test_profile_summary_reads_a_cpu_trace(tmp_path, capsys):
    """On CPU the XLA thunks of each simulated device stand in for its kernels (it said 0.0 ms busy, once)."""
    s = profile_summary.summarize(_cpu_trace(tmp_path / "t"), steps=1)
    assert s["busy_ms"] == pytest.approx(0.4) and s["by_class_ms"] == pytest.approx({"matmul": 0.3, "collective": 0.1})
    assert profile_summary.summarize(tmp_path / "t", device=1)["busy_ms"] == pytest.approx(0.05)
    err = _refused(profile_summary.main, [str(tmp_path / "t"), "--device", "5"], capsys)
    assert "--device 5: the trace holds devices [0, 1]; pass one of them." in err


def test_profile_capture_of_a_cpu_step_is_busy(tmp_path):
    """bench.py --profile on CPU: the traced steps' busy time against their own wall time (0% once)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((256, 256))
    step = jax.jit(lambda a: (a @ a).sum())
    step(x).block_until_ready()
    s = profile_summary.capture(lambda: step(x).block_until_ready(), tmp_path / "p", steps=2)
    assert s["events"] > 0 and 0 < s["busy_ms"] <= s["step_ms"]
    assert f"of {s['step_ms']:.1f} ms" in profile_summary.format_summary(s, s["step_ms"])


@pytest.mark.parametrize("data, fix", [
    ({"traceEvents": 5}, "is JSON but not a profiler trace"),  # a TypeError, once
    ([1, 2], "is JSON but not a profiler trace"),  # an AttributeError, once
    ({"traceEvents": [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}}]},
     "holds no device events"),
])
def test_profile_summary_of_no_trace_is_one_line(tmp_path, capsys, data, fix):
    assert fix in _refused(profile_summary.main, [str(_trace(tmp_path / "t", data))], capsys)


@pytest.mark.parametrize("argv, fix", [
    (["--devices", "3", "4"], "--devices only acts with --ticks"),
    (["--cycle", "2"], "--cycle only acts with --calls REGEX"),
    (["--segments", "2"], "--segments only acts with --calls REGEX"),
    (["--ticks", "--device", "1"], "--device only acts without --ticks"),
    (["--calls", "dot", "--top", "3"], "--top only acts in the summary and with --ticks"),
    (["--calls", "dot", "--ticks"], "--ticks only acts without --calls"),
    (["--ticks", "--devices", "0", "0"], "--devices 0 0 names a device twice"),
    (["--ticks", "--devices", "0", "5"], "--devices 5: the trace holds devices [0, 1]"),
    (["--ticks"], "--ticks: the trace holds no shifts (collective-permutes)"),  # a table of zeros, once
    (["--top", "x"], "profile_summary.py: argument --top: invalid int value: 'x'"),  # argparse's usage block, once
])
def test_profile_summary_refuses_flags_that_do_nothing(tmp_path, capsys, argv, fix):
    assert fix in _refused(profile_summary.main, [str(_cpu_trace(tmp_path / "t")), *argv], capsys)


def test_a_script_missing_a_module_ends_in_one_line(capsys, monkeypatch):
    """torch_gpt.py and torch_llama.py without torch (CI's case): a traceback once, even for --help."""
    from mtx.errors import script_needs

    script_needs("no_such_module_of_mtx", "pip install it", "benchmarks.torch_gpt")  # imported: nothing done
    monkeypatch.setattr(sys, "argv", ["benchmarks/torch_gpt.py", "--help"])
    with pytest.raises(SystemExit) as exited:
        script_needs("no_such_module_of_mtx", "pip install it", "__main__")
    assert exited.value.code == 2
    assert capsys.readouterr().err == "error: torch_gpt.py needs no_such_module_of_mtx (pip install it).\n"
    for script in ("torch_gpt.py", "torch_llama.py"):
        source = (Path(__file__).resolve().parents[1] / "benchmarks" / script).read_text()
        assert source.index('script_needs("torch"') < source.index("import torch")
    for script in ("train.py", "eval.py"):  # a Python without mtx's requirements (the system's): jax, before mtx's
        source = (Path(__file__).resolve().parents[1] / script).read_text()
        imports = [line for line in source.splitlines() if line.startswith("from mtx.") and "mtx.errors" not in line]
        assert source.index('script_needs("jax"') < source.index(imports[0]), script
