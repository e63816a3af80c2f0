"""The benchmark scripts run on CPU (so CI keeps them working), and the plain-JAX baseline is the same model as mtx."""

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtx.config import Config
from mtx.errors import UsageError
from mtx.parallel.mesh import make_mesh
from mtx.presets import load_preset
from mtx.step import TrainStep

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench, compile_probe, plain_gpt  # noqa: E402
from helpers import status_and_errors  # noqa: E402

TINY = Config().replace(**load_preset("configs/tiny.toml"), hidden_dropout=0.0, attention_dropout=0.0)


def _plain_params(params):
    """mtx's parameter tree -> plain_gpt's dict (same arrays, renamed)."""
    p = jax.tree.map(np.asarray, nnx.to_pure_dict(params))
    layers = p["layers"]
    return {
        "wte": p["embedding"]["embedding"], "wpe": p["position_embeddings"],
        "layers": {
            "ln1_scale": layers["ln1"]["scale"], "ln1_bias": layers["ln1"]["bias"],
            "qkv_kernel": layers["attention"]["qkv"]["kernel"], "qkv_bias": layers["attention"]["qkv"]["bias"],
            "out_kernel": layers["attention"]["proj"]["kernel"], "out_bias": layers["attention"]["proj"]["bias"],
            "ln2_scale": layers["ln2"]["scale"], "ln2_bias": layers["ln2"]["bias"],
            "fc1_kernel": layers["mlp"]["fc1"]["kernel"], "fc1_bias": layers["mlp"]["fc1"]["bias"],
            "fc2_kernel": layers["mlp"]["fc2"]["kernel"], "fc2_bias": layers["mlp"]["fc2"]["bias"],
        },
        "lnf_scale": p["final_layernorm"]["scale"], "lnf_bias": p["final_layernorm"]["bias"],
    }


@pytest.mark.parametrize("tp", [1, 4])
def test_plain_baseline_is_the_same_model(tp):
    """The baseline's loss and gradients equal mtx's (fp32) for the same weights: it measures the same math."""
    cfg = TINY.replace(vocab_size=300, global_batch_size=4, micro_batch_size=4, data_parallel_size=1,
                       tensor_model_parallel_size=tp).validate(tp)
    train_step = TrainStep.build(cfg, make_mesh(1, 1, tp, devices=jax.devices()[:tp]))
    state = train_step.init_state()
    tokens = np.random.default_rng(0).integers(0, 300, (4, cfg.model.seq_length + 1)).astype(np.int32)
    loss, grads = train_step.loss_and_grads(state.params, train_step.model.put_batch(tokens), state.step)

    plain_loss = lambda p: plain_gpt.loss_fn(p, jnp.asarray(tokens), heads=cfg.model.num_attention_heads,
                                             dtype=jnp.float32, flash=False, recompute=None, vocab_size=300)
    ref_loss, ref_grads = jax.value_and_grad(plain_loss)(_plain_params(state.params))
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    mine = _plain_params(grads)
    for path, ref in jax.tree_util.tree_leaves_with_path(ref_grads):
        got = mine
        for k in path:
            got = got[k.key]
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * float(np.abs(ref).max()),
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("sequence_parallel,scan", [(False, False), (True, False), (True, True)])
def test_gspmd_baseline_splits_the_same_program(sequence_parallel, scan):
    """plain_gpt --gspmd runs the one-device program over 2 devices from sharding annotations alone: the same loss
    after the same steps (fp32); the step hands back its state laid out as it took it; and the layout is Megatron's:
    only activations (rows of width D) and token ids are ever gathered, never a weight or the logits, no all-to-all
    reshuffles heads, and no collective carries the vocabulary dimension (the loss sums (B, S) scalars)."""
    cfg = TINY.replace(vocab_size=300, global_batch_size=4, micro_batch_size=4, data_parallel_size=1, bf16=False,
                       tensor_model_parallel_size=2, sequence_parallel=sequence_parallel, scan_layers=scan,
                       recompute_granularity="matmuls")
    one = plain_gpt.measure(cfg, steps=2, warmup=1)
    two = plain_gpt.measure(cfg, steps=2, warmup=1, gspmd=True)
    assert (one["devices"], two["devices"], two["impl"]) == (1, 2, "plain-jax-gspmd")
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-5)

    layout = plain_gpt.make_layout(cfg)
    init, optimizer, step = plain_gpt.make_step(cfg, layout)
    params, opt_state = plain_gpt.init_state(init, optimizer, layout, seed=0)
    tokens = jnp.zeros((4, cfg.model.seq_length + 1), jnp.int32)
    hlo = step.lower(params, opt_state, tokens).compile().as_text()
    new_params, new_opt_state, _ = step(params, opt_state, tokens)
    for before, after in zip(jax.tree.leaves((params, opt_state)), jax.tree.leaves((new_params, new_opt_state))):
        assert after.sharding.is_equivalent_to(before.sharding, after.ndim)
    b, seq, d, v = 4, cfg.model.seq_length, cfg.model.hidden_size, cfg.model.padded_vocab_size
    assert len({seq, d, v}) == 3  # so that a shape tells what it holds
    counts = plain_gpt.count_collectives(hlo)
    assert counts["all-to-all"] == 0
    assert (counts["all-gather"] >= 2) == sequence_parallel  # the LayerNorm outputs before QKV and fc1
    for op, arrays in _collective_shapes(hlo):
        for dims in arrays:
            assert v not in dims, (op, dims)
            if op == "all-gather":  # activations, their position-embedding gradient (S, D), or token ids
                assert dims in [(b, seq, d), (seq, d), (b, seq, 1), (b, seq)], dims


def _collective_shapes(hlo: str):
    """(op, [dims of each array it produces]) for every all-gather, all-reduce and reduce-scatter in HLO text."""
    for line in hlo.splitlines():
        m = re.search(r"=\s+(.+?)\s+(all-gather|all-reduce|reduce-scatter)(?:-start)?\(", line)
        if m:
            yield m.group(2), [tuple(int(x) for x in dims.split(",") if x)
                               for dims in re.findall(r"\[([\d,]*)\]", m.group(1))]


def test_bench_and_plain_baseline_run_on_cpu(tmp_path):
    cfg = TINY.replace(global_batch_size=8, micro_batch_size=2, tensor_model_parallel_size=2,
                       recompute_granularity="matmuls")
    mtx = bench.measure(cfg, steps=2, warmup=1)
    plain = plain_gpt.measure(cfg.replace(micro_batch_size=8, scan_layers=False), steps=2, warmup=1)
    for r in (mtx, plain):
        assert r["tokens_per_s"] > 0 and np.isfinite(r["loss"]) and r["step_s_min"] <= r["step_s"]
        assert r["params"] == cfg.model.num_params() and r["recompute"] == "matmuls"
    assert 0 < mtx["step_s_dispatched"]  # the same steps dispatched back to back, as train.py runs them
    assert mtx["mesh"] == {"data": 4, "pipeline": 1, "model": 2} and mtx["microbatches"] == 1
    # both start from N(0, 0.02) weights on random tokens: the loss is ~ln(V) after a few small steps
    assert abs(mtx["loss"] - plain["loss"]) < 0.5


def test_suite_runs_rows_and_tabulates_scaling(tmp_path):
    from benchmarks import suite

    rows = [suite.mtx("tiny, 1 GPU", 1, "tiny", 1, 1, 1, 2, 4, fast=False),
            suite.mtx("tiny, TP 2 (strong)", 2, "tiny", 1, 1, 2, 2, 4, fast=False),
            suite.mtx("tiny, bad", 1, "tiny", 1, 1, 3, 2, 4, fast=False),  # 8 heads on TP 3: refused
            suite.plain("tiny, plain JAX", "tiny", 4),
            suite.plain("tiny, TP 2 (strong), GSPMD", "tiny", 4, *suite.SP, gpus=2)]
    records = [suite.run_row(r, steps=2, warmup=1, timeout=300) for r in rows]
    ok, strong, bad, plain, gspmd = (r["result"] for r in records)
    assert ok["mesh"] == {"data": 1, "pipeline": 1, "model": 1} and strong["mesh"]["model"] == 2
    assert "--tensor-model-parallel-size" in bad["error"]
    assert (gspmd["impl"], gspmd["devices"], gspmd["sequence_parallel"]) == ("plain-jax-gspmd", 2, True)
    text = suite.table(records)
    assert f"strong {strong['tokens_per_s'] / ok['tokens_per_s']:.2f}x" in text
    assert f"strong {gspmd['tokens_per_s'] / plain['tokens_per_s']:.2f}x" in text  # GSPMD against plain JAX
    assert text.count("\n") == 2 + len(rows) - 1 and "| tiny, bad | 1 |" in text


def test_suite_row_that_times_out_says_how_far_it_got(monkeypatch):
    from benchmarks import suite

    def slow(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"], stderr=b"plain_gpt: state initialized in 95 s\n***\n")

    monkeypatch.setattr(suite.subprocess, "run", slow)
    record = suite.run_row(suite.plain("tiny, plain JAX", "tiny", 4), steps=2, warmup=1, timeout=7)
    assert record["result"]["error"] == "timed out after 7 s; last: plain_gpt: state initialized in 95 s"


@pytest.mark.parametrize("group", sorted(__import__("benchmarks.suite", fromlist=["ROWS"]).ROWS))
def test_every_suite_row_is_a_valid_run_on_its_gpu_count(group):
    """Each row's flags parse and validate for exactly its GPU count (the 8-GPU rows wait for an 8-GPU host)."""
    from benchmarks import suite
    from mtx.cli import parse_config

    for row in suite.ROWS[group]:
        if row["script"].startswith("benchmarks/torch_"):  # torch_gpt.py, torch_llama.py: flags of their own
            continue
        args = [a for a in row["args"] if a != "--gspmd"]  # plain_gpt's own flag
        cfg = parse_config(args).validate(row["gpus"])
        p = cfg.parallel
        dp = cfg.data_parallel_size(row["gpus"])
        assert dp * p.pipeline_model_parallel_size * p.tensor_model_parallel_size == row["gpus"], row["name"]
        # the 1.2B preset unrolls its layers: a row said to scan them must say so itself (it once did not), and the
        # table finds scanned rows by that flag
        scanned = "scanned" in row["name"] or row["script"] == "benchmarks/plain_gpt.py"
        assert cfg.training.scan_layers == scanned == ("--scan-layers" in row["args"]), row["name"]


def test_collectives_benchmark_moves_the_right_data_and_reports_bus_bandwidth():
    """benchmarks/collectives.py: each collective gives what mtx's layers expect (checked on simulated devices), and
    the bus bandwidth follows nccl-tests' factors."""
    from benchmarks import collectives

    n = 4
    mesh = make_mesh(1, 1, n, devices=jax.devices()[:n])
    x = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3)
    expected = {"all_gather": np.tile(x, (n, 1)), "reduce_scatter": n * x, "all_reduce": np.tile(n * x, (n, 1)),
                "ppermute": np.roll(x, 8 // n, axis=0)}
    for name, want in expected.items():
        fn, split = collectives.collective_fn(name, mesh)
        placed = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P("model") if split else jax.P()))
        np.testing.assert_array_equal(np.asarray(fn(placed)), want, err_msg=name)
        # Timed as 5 chained calls in one program: all 5 survive compilation (none merged or dropped; the pattern
        # is CPU HLO's, where collectives are synchronous)...
        chained = collectives.collective_fn(name, mesh, 5)[0]
        hlo = chained.lower(placed).compile().as_text()
        op = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_reduce": "all-reduce",
              "ppermute": "collective-permute"}[name]
        assert len(re.findall(rf"= \S+ {op}(-start)?\(", hlo)) == 5, (name, hlo)
        if name in ("all_reduce", "reduce_scatter"):  # ...and each sums the element the one before produced
            # From ones, element [0, 0] of rank 0 grows call by call: all-reduce v -> n v (every rank holds v);
            # reduce-scatter v -> v + (n - 1) n (the other ranks hold their own first row's sum, n).
            ones = jax.device_put(jnp.ones_like(x), placed.sharding)
            want = n ** 5 if name == "all_reduce" else n + 4 * (n - 1) * n
            assert float(np.asarray(chained(ones))[0, 0]) == want, name

    results = collectives.main(["--devices", str(n), "--sizes-mb", "0.05", "--iters", "2", "--repeats", "1"])
    assert [r["collective"] for r in results] == list(collectives.COLLECTIVES)
    for r in results:
        if r["collective"] in collectives.PEER_WIDTH:  # the peer-memory kernels: the line says why they cannot run
            assert "Hopper" in r["error"], r
            continue
        assert r["devices"] == n and r["time_us"] > 0
        factor = {"all_gather": 0.75, "reduce_scatter": 0.75, "all_reduce": 1.5, "ppermute": 1.0}[r["collective"]]
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor, abs=0.11)
    with pytest.raises(UsageError, match="--devices: must be >= 2, got 1"):  # (exit_with: one line, status 2)
        collectives.main(["--devices", "1"])


def test_suite_env_adds_to_every_row(tmp_path, monkeypatch):
    """--env KEY=VALUE reaches each row's process (XLA_FLAGS added to the row's own flags) and names the row."""
    from benchmarks import suite

    seen = []
    monkeypatch.setattr(suite.subprocess, "run", lambda cmd, env, **kw: seen.append(env) or
                        type("P", (), {"returncode": 1, "stdout": "", "stderr": "stub"})())
    monkeypatch.setitem(suite.ROWS, "test", [suite.mtx("tiny, TP 2", 2, "tiny", 1, 1, 2, 2, 4, xla_flags="--a=1")])
    suite.main(["--rows", "test", "--env", "NCCL_PROTO=Simple", "XLA_FLAGS=--b=2", "--out", str(tmp_path / "r.jsonl")])
    assert seen[0]["NCCL_PROTO"] == "Simple" and seen[0]["XLA_FLAGS"].endswith("--a=1 --b=2")
    rec = json.loads((tmp_path / "r.jsonl").read_text())
    assert rec["name"] == "tiny, TP 2, NCCL_PROTO=Simple, XLA_FLAGS=--b=2"
    assert rec["command"].startswith("XLA_FLAGS='--a=1 --b=2' NCCL_PROTO=Simple python ")  # pastes into a shell
    # The scaling column still finds the 1-GPU baseline under an added setting.
    result = {"params": 1e6, "global_batch": 4, "step_s": 1.0, "tflops_per_device": 1.0, "mfu": None, "peak_mem_gib": 1}
    one, two = ({**rec, "name": f"tiny, {n}, NCCL_PROTO=Simple", "base_name": f"tiny, {n}", "gpus": g,
                 "result": {**result, "tokens_per_s": t}} for n, g, t in (("1 GPU", 1, 100.0), ("TP 2", 2, 150.0)))
    assert "strong 1.50x" in suite.table([one, two])
    # A row with scanned layers scales against the 1-GPU row with scanned layers (by its flags), never the unrolled one.
    scan1, scan2 = ({**rec, "name": f"tiny, {n}, scanned layers", "base_name": f"tiny, {n}, scanned layers", "gpus": g,
                     "args": [*rec["args"], "--scan-layers"], "result": {**result, "tokens_per_s": t}}
                    for n, g, t in (("1 GPU", 1, 80.0), ("TP 2", 2, 140.0)))
    assert "strong 1.75x" in suite.table([one, scan1, scan2]) and "strong" not in suite.table([one, scan2])
    with pytest.raises(SystemExit):
        suite.main(["--rows", "test", "--env", "NCCL_PROTO"])


def test_bench_bad_flag_is_one_line(capsys):
    """A mistyped train.py flag given to a benchmark: one line naming it, exit status 2, nothing measured."""
    measured = []
    assert bench.run_cli(lambda cfg, **kw: measured.append(cfg), ["--hiden-size", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--hiden-size" in err and "--hidden-size" in err and not measured


@pytest.mark.parametrize("argv, fix", [
    (["--steps", "0"], "argument --steps: must be in [1, 10000], got 0"),
    (["--warmup", "-1"], "argument --warmup: must be in [0, 10000], got -1"),
    (["--steps", "100000000000000000000"], "argument --steps: must be in [1, 10000]"),  # once ran until killed
    (["--data-parallel-size", "16"], "lower the parallel sizes"),
    (["--json", "/proc/version/out.jsonl"], "choose another path"),
    (["--json", "/"], "pass a file to append the results to"),
    (["--json", "README.md"], "exists and is not a JSON-lines file of this tool"),  # was appended to
    (["--json", ""], "--json is empty; pass a file to append the results to, or drop --json."),  # once ignored
    (["--profile", " "], "--profile is empty; pass a directory for the trace, or drop --profile."),  # once ignored
    (["--load", "/nonexistent"], "--load is a train.py flag the benchmark does not use"),  # once timed random weights
    (["--steps", "abc"], "argument --steps: invalid int value: 'abc'"),  # argparse's usage, three lines, once
    (["--json"], "argument --json: expected one argument"),
    (["--step", "3"], "unknown flag --step; did you mean --steps?"),  # once --ckpt-step, a train.py flag
    (["--data-path", "corpus.txt"], "--data-path is a train.py flag the benchmark does not use"),
])
def test_bench_bad_requests_are_one_line(capsys, argv, fix):
    """Bad benchmark flags, and a mesh larger than the devices there are: one line naming the fix, exit status 2,
    before anything is measured."""
    measured = []
    assert bench.run_cli(lambda cfg, **kw: measured.append(cfg), ["--config", "configs/tiny.toml", *argv],
                         check=bench.check_mesh) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and fix in err and not measured


@pytest.mark.parametrize("script, argv, fix", [
    ("pipeline_bubble", ["--steps", "0", "--schedules", "gpipe"], "argument --steps: must be in [1, 10000], got 0"),
    ("pipeline_bubble", ["--pp", "0"], "argument --pp: must be >= 2, got 0"),  # the config check's traceback, once
    ("pipeline_bubble", ["--microbatches", "0"], "argument --microbatches: must be in [1, 10000], got 0"),
    ("pipeline_bubble", ["--virtual", "-1"], "argument --virtual: must be >= 2, got -1"),  # once accepted
    ("pipeline_bubble", ["--virtual", "3"], "--virtual 3 is for the interleaved schedule"),
    ("pipeline_bubble", ["--pp", "16", "--", "--config", "configs/tiny.toml", "--num-layers", "16"],
     "--pp 16, --microbatches 2, gpipe: the mesh data x pipeline x model = 1 x 16 x 1 needs 16 devices"),
    ("pipeline_bubble", ["--schedules", "interleaved", "--", "--config", "configs/tiny.toml"], "interleaved: --num"),
    ("collectives", ["--iters", "0", "--sizes-mb", "0.01"], "argument --iters: must be in [1, 10000], got 0"),
    ("collectives", ["--sizes-mb", "-1"], "argument --sizes-mb: must be in (0, 100000], got -1"),  # once ran
    ("collectives", ["--width", "0"], "argument --width: must be in [1, 1000000], got 0"),
    ("collectives", ["--out", ""], "--out is empty"),
    ("attention", ["--seq", "0", "--repeats", "1"], "argument --seq: must be >= 1, got 0"),  # every row an error
    ("attention", ["--rate", "1.5"], "argument --rate: must be in [0, 1), got 1.5"),  # once accepted
    ("attention", ["--causal", "2"], "argument --causal: must be in [0, 1], got 2"),
    ("attention", ["--blocks", "64,64"], "argument --blocks: '64,64' is not q,k,big,small,warps,warps_backward"),
    ("gpu_checks", ["--slack", "-1"], "argument --slack: must be >= 0, got -1"),
    ("bert_layernorm", ["--train-iters", "x"], "bert_layernorm.py: argument --train-iters: invalid"),  # (argparse: a
    ("collective_matmul", ["--iters", "0"], "collective_matmul.py: argument --iters: must be"),  # usage block, once)
    ("pipeline_bubble", ["--hidden-size", "8"], "unknown flag --hidden-size; pipeline_bubble.py --help lists"),
    ("suite", ["--steps", "0", "--rows", "1gpu", "--out", "X.jsonl"], "argument --steps: must be in [1, 10000]"),
    ("suite", ["--warmup", "-1"], "argument --warmup: must be in [0, 10000], got -1"),
    ("suite", ["--timeout", "0"], "argument --timeout: must be in [1, 1000000], got 0"),
    ("suite", ["--rows", "1gpu", "--only", "nomatch"], "no row of --rows 1gpu matches --only nomatch; python "
     "benchmarks/suite.py --rows 1gpu --list prints the row names."),  # once an empty table, exit 0
])
def test_benchmark_bad_flags_are_one_line(monkeypatch, capsys, script, argv, fix):
    """A benchmark script's bad flag (every number is range-checked) or request: one error line naming it, exit
    status 2, before anything is measured."""
    module = importlib.import_module(f"benchmarks.{script}")
    for target, name in ((bench, "measure"), (module, "measure"), (module, "run_row"), (module, "timed")):
        if hasattr(target, name):
            monkeypatch.setattr(target, name, lambda *a, **kw: pytest.fail("measured"))
    status, errors = status_and_errors(module.main, argv, capsys)
    assert status == 2 and len(errors) == 1 and fix in errors[0], errors


def test_benchmarks_that_measured_nothing_fail(monkeypatch, capsys, tmp_path):
    """A benchmark whose every measurement failed exits with status 1 and says so; never 0."""
    from benchmarks import attention, collectives, suite

    monkeypatch.setattr(attention, "timed", lambda *a: 1 / 0)
    shape = ["--batch", "1", "--seq", "8", "--heads", "1", "--head-dim", "8", "--blocks"]
    assert status_and_errors(attention.main, shape, capsys) == (1, ["error: no variant ran; see each line's error."])
    monkeypatch.setattr(collectives, "measure", lambda *a, **kw: [{"error": "cannot run here"}])
    assert status_and_errors(collectives.cli, ["--collectives", "peer_all_gather"], capsys) == (
        1, ["error: no collective was measured; each line says why."])
    monkeypatch.setattr(suite, "run_row", lambda row, *a: {**row, "result": {"error": "out of memory"}})
    assert status_and_errors(suite.main, ["--rows", "1gpu", "--only", "1.2B, 1 GPU, mb 24"], capsys) == (
        1, ["error: every row failed; the table says why."])


def test_bench_appends_to_an_existing_json_file(tmp_path):
    """--json appends: a file of earlier results is accepted (and kept), not refused."""
    out = tmp_path / "results.jsonl"
    out.write_text('{"step_s": 2.0}\n')
    measured = []
    assert bench.run_cli(lambda cfg, **kw: measured.append(cfg) or {"step_s": 1.0},
                         ["--config", "configs/tiny.toml", "--json", str(out)]) == 0
    assert len(measured) == 1 and out.read_text().splitlines() == ['{"step_s": 2.0}', '{"step_s": 1.0}']


def test_gpu_checks_pass_the_fallback_and_catch_a_wrong_fused_path(monkeypatch, capsys):
    """benchmarks/gpu_checks.py (run on GPUs against cuDNN) passes XLA's fallback here, and fails a fused path that
    ignores BERT's padding."""
    from benchmarks import gpu_checks
    shape = ["--batch", "4", "--seq", "32", "--heads", "2", "--head-dim", "8"]
    assert gpu_checks.main(shape) == 0
    assert "not a GPU: cuDNN's attention, and the peer-memory kernels, do not run" in capsys.readouterr().err
    unmasked = lambda q, k, v, *, mask_BS=None, causal=True: gpu_checks.attention_core(q, k, v, causal=causal)
    monkeypatch.setattr(gpu_checks, "fused_attention", unmasked)
    assert gpu_checks.main(shape) == 1
    checks = {c["check"]: c for c in map(json.loads, capsys.readouterr().out.splitlines()[-3:])}
    assert "out_real" in checks["bert_padding"]["failed"] and checks["collective_matmul"]["failed"] == []
    assert checks["bert_padding"]["fused_path"] == "xla (no cuDNN attention here)"


def test_gpu_checks_of_the_flash_kernel_pass_it_interpreted_and_catch_wrong_masks(monkeypatch, capsys):
    """The kernel checks of benchmarks/gpu_checks.py, the kernel interpreted on the host: they pass it, and fail a
    kernel that draws other dropout masks than XLA's attention."""
    from benchmarks import gpu_checks
    from mtx.kernels import flash_attention as flash
    monkeypatch.setattr(flash, "INTERPRET", True)
    shape = ["--batch", "2", "--seq", "64", "--heads", "2", "--head-dim", "16"]
    assert gpu_checks.main(shape) == 0
    checks = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [c["check"] for c in checks] == ["bert_padding", *["flash_dropout"] * 2, "gemm_epilogue",
                                            "collective_matmul"]
    real = flash.flash_attention
    other_masks = lambda *a, hashes, **kw: real(*a, hashes=(hashes[0] + 1, hashes[1]), **kw)
    monkeypatch.setattr(flash, "flash_attention", other_masks)
    assert gpu_checks.main(shape) == 1
    failed = [json.loads(line)["failed"] for line in capsys.readouterr().out.splitlines()]
    assert failed[0] == [] and "out" in failed[1] and "out" in failed[2]


def test_compile_probe_splits_the_start_of_a_step(tmp_path):
    """Tracing + lowering and XLA's compile timed apart, the compile's own events summed (no Python frames), for a
    BERT batch (a dict) too; a bad --top is one line and exit status 2."""
    r = compile_probe.probe(TINY.replace(model_type="bert", num_layers=1, data_parallel_size=8,
                                         tensor_model_parallel_size=1), tmp_path / "trace", top=5)
    assert r["trace_lower_s"] > 0 and r["compile_s"] > 0 and r["custom_calls"] == {}
    assert len(r["events"]) == 5 and not any(name.startswith("$") for name, _, _ in r["events"])
    assert all(s > 0 and n >= 1 for _, s, n in r["events"])
    assert compile_probe.main([str(tmp_path / "t2"), "--top", "0", "--config", "configs/tiny.toml"]) == 2
    assert compile_probe.main([str(tmp_path / "t2"), "--config", "configs/tiny.toml", "--global-batch-size", "3"]) == 2


def test_gpu_checks_training_curves_run_from_any_directory(monkeypatch, tmp_path):
    """The loss-curve checks read their model from the repository's configs/ wherever they are started (run from
    benchmarks/, they once looked for configs/tiny.toml there)."""
    from types import SimpleNamespace

    from benchmarks import gpu_checks
    from mtx import run

    seen = []
    monkeypatch.setattr(run, "train", lambda cfg, **kw: seen.append(cfg) or SimpleNamespace(losses={1: 2.0, 2: 1.0}))
    monkeypatch.chdir(tmp_path)
    assert gpu_checks._loss_curves(2, 1, plain={}) == {"plain": [2.0, 1.0]}
    assert seen[0].model.num_layers == 4 and seen[0].training.train_iters == 2
