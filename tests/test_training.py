"""End to end: the mesh does not change the math, training learns, checkpoints resume exactly on any mesh."""

import json
import math
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from mtx.cli import parse_config
from mtx.config import Config
from mtx.parallel.mesh import make_mesh
from mtx.parallel.sharded import init_sharded
from mtx.presets import load_preset
from mtx.run import train
from mtx.sharded_model import build_model

TINY = Config().replace(**load_preset("configs/tiny.toml"))
EXACT = dict(hidden_dropout=0.0, attention_dropout=0.0)  # fp32 is the default compute dtype


def run(tmp_path, name, **flags):
    where = {} if "save" in flags else {"run_dir": str(tmp_path / name)}  # --save is the run directory then
    return train(TINY.replace(**where, **flags), progress=False)


def losses(result, steps):
    return np.array([result.losses[s] for s in steps])


# (data, model) meshes; with global batch 16 and micro batch 2, data=1 accumulates 8 microbatches, data=8 one.
MESHES = [(1, 1), (8, 1), (1, 8), (2, 4), (4, 2)]


def test_loss_is_the_same_on_every_mesh(tmp_path):
    curves = {}
    for dp, tp in MESHES:
        r = run(tmp_path, f"mesh{dp}x{tp}", train_iters=10, log_interval=5, data_parallel_size=dp,
                tensor_model_parallel_size=tp, **EXACT)
        curves[(dp, tp)] = losses(r, range(1, 11))
    for mesh, curve in curves.items():
        np.testing.assert_allclose(curve, curves[(1, 1)], rtol=1e-5, err_msg=f"mesh (data, model) = {mesh}")
    assert curves[(1, 1)][-1] < curves[(1, 1)][0]  # and it is learning, not constant


def test_parameters_are_bit_identical_on_every_mesh():
    make = build_model(TINY)
    reference = None
    for dp, tp in MESHES:
        _, state = init_sharded(make, make_mesh(dp, 1, tp, devices=jax.devices()[: dp * tp]))
        leaves = [np.asarray(x) for x in jax.tree.leaves(state)]
        if reference is None:
            reference = leaves
        for a, b in zip(leaves, reference):
            assert a.dtype == b.dtype and np.array_equal(a, b)


def test_initialization_follows_the_paper():
    _, state = init_sharded(build_model(TINY.replace(num_layers=8, hidden_size=256)), make_mesh(1, 1, 1))
    p = nnx.to_pure_dict(state)
    assert abs(np.std(np.asarray(p["layers"]["mlp"]["fc1"]["kernel"])) - 0.02) < 1e-3
    residual_std = 0.02 / math.sqrt(2 * 8)
    for w in (p["layers"]["mlp"]["fc2"]["kernel"], p["layers"]["attention"]["proj"]["kernel"]):
        assert abs(np.std(np.asarray(w)) - residual_std) < 1e-3 * residual_std * 50
    assert np.all(np.asarray(p["layers"]["ln1"]["scale"]) == 1.0)
    assert np.all(np.asarray(p["layers"]["attention"]["qkv"]["bias"]) == 0.0)


def test_tiny_model_learns_the_builtin_corpus(tmp_path):
    r = run(tmp_path, "learn", train_iters=150, lr=3e-3, min_lr=3e-4, log_interval=50)
    first, last = r.losses[1], np.mean(losses(r, range(141, 151)))
    assert first > 5.0  # ~ln(257): uniform over bytes
    assert last < 0.55 * first, (first, last)


def test_recomputation_does_not_change_the_math(tmp_path):
    base = losses(run(tmp_path, "none", train_iters=3, **EXACT), [1, 2, 3])
    for granularity in ("full", "selective", "matmuls"):
        again = losses(run(tmp_path, granularity, train_iters=3, recompute_granularity=granularity, **EXACT),
                       [1, 2, 3])
        np.testing.assert_allclose(again, base, rtol=1e-6)


def test_unrolled_layers_are_the_scanned_layers(tmp_path):
    base = losses(run(tmp_path, "scan", train_iters=3, **EXACT), [1, 2, 3])
    again = losses(run(tmp_path, "unrolled", train_iters=3, scan_layers=False, recompute_granularity="matmuls",
                       **EXACT), [1, 2, 3])
    np.testing.assert_allclose(again, base, rtol=1e-6)


def test_bf16_and_fp16_train(tmp_path):
    for flag in ("bf16", "fp16"):
        r = run(tmp_path, flag, train_iters=20, lr=3e-3, **{flag: True})
        curve = losses(r, range(1, 21))
        assert np.all(np.isfinite(curve)) and curve[-1] < curve[0] - 0.3, (flag, curve)


def test_resuming_with_another_precision_starts_the_loss_scale_afresh(tmp_path, capsys):
    """fp32 -> --fp16 takes --initial-loss-scale (the saved scale 1 was kept once); --fp16 -> bf16 scale 1 (the saved
    65,536 scaled a loss that was never unscaled: grad norm 160,000 against 2.5, every step clipped)."""
    ckpt = tmp_path / "ckpt"
    run(tmp_path, "fp32", train_iters=2, save=str(ckpt), lr_decay_iters=4)  # (resumed to 4 steps: one schedule)
    scales = lambda: [json.loads(line)["loss_scale"] for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    norms = lambda: [json.loads(line)["grad_norm"] for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    run(tmp_path, "fp16", train_iters=3, log_interval=1, load=str(ckpt), save=str(ckpt), fp16=True,
        initial_loss_scale=1024.0, lr_decay_iters=4)
    assert "trained without --fp16 and this run is: the loss scale starts at 1024" in capsys.readouterr().out
    assert scales()[-1] == 1024.0
    run(tmp_path, "bf16", train_iters=4, log_interval=1, load=str(ckpt), save=str(ckpt), bf16=True, lr_decay_iters=4)
    assert "trained with --fp16 and this run is not: the loss scale starts at 1" in capsys.readouterr().out
    assert scales()[-1] == 1.0 and norms()[-1] < 10 * norms()[-2], norms()


def test_resume_continues_the_same_trajectory_on_any_mesh(tmp_path):
    """Dropout on: the RNG stream must resume too. Saved on (data, model) = (2, 4), resumed on 3 meshes."""
    ckpt = str(tmp_path / "ckpt")
    full = run(tmp_path, "full", train_iters=8, save=ckpt, save_interval=4, data_parallel_size=2,
               tensor_model_parallel_size=4)
    with open(tmp_path / "ckpt" / "metrics.jsonl") as fh:
        assert [json.loads(line)["step"] for line in fh if "loss" in line][-1] == 8
    for dp, tp in [(2, 4), (8, 1), (1, 2)]:
        resumed = run(tmp_path, f"resume{dp}x{tp}", train_iters=8, load=ckpt, ckpt_step=4, data_parallel_size=dp,
                      tensor_model_parallel_size=tp)
        assert min(resumed.losses) == 5
        np.testing.assert_allclose(losses(resumed, range(5, 9)), losses(full, range(5, 9)), rtol=1e-5,
                                   err_msg=f"resumed on (data, model) = ({dp}, {tp})")


def test_data_parallel_gradient_accumulation_matches_one_big_batch(tmp_path):
    one = run(tmp_path, "micro16", train_iters=3, micro_batch_size=16, data_parallel_size=1,
              tensor_model_parallel_size=1, **EXACT)
    many = run(tmp_path, "micro1", train_iters=3, micro_batch_size=1, data_parallel_size=2,
               tensor_model_parallel_size=2, **EXACT)
    np.testing.assert_allclose(losses(many, [1, 2, 3]), losses(one, [1, 2, 3]), rtol=1e-5)


def test_metrics_and_config_are_written(tmp_path):
    r = run(tmp_path, "metrics", train_iters=6, log_interval=3, eval_interval=3, eval_iters=2, split="90,10,0")
    records = [json.loads(line) for line in (r.run_dir / "metrics.jsonl").read_text().splitlines()]
    train_records = [x for x in records if "loss" in x]
    assert [x["step"] for x in train_records] == [3, 6]
    for key in ("step", "loss", "lr", "grad_norm", "loss_scale", "step_time_s", "tokens_per_s", "tflops_per_device",
                "mfu", "batch_make_s", "batch_wait_s"):
        assert key in train_records[-1]
    assert 0 < train_records[-1]["batch_make_s"] and 0 <= train_records[-1]["batch_wait_s"]
    assert train_records[-1]["mfu"] is None  # CPU: no known peak
    assert train_records[-1]["tokens_per_s"] > 0
    assert [x["step"] for x in records if "val_loss" in x] == [3, 6]
    saved = Config.from_dict(json.loads((r.run_dir / "config.json").read_text()))
    assert saved.model.vocab_size == 257 and saved.model.num_layers == 2


def test_tensorboard_events(tmp_path):
    pytest.importorskip("tensorboard")
    run(tmp_path, "tb", train_iters=2, log_interval=1, tensorboard_dir=str(tmp_path / "tb"))
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


# ---- bad input: one line naming the fix, exit code 2, nothing touched ----

def main(argv):
    sys.path.insert(0, ".")
    import train as train_script

    return train_script.main(argv)


@pytest.mark.parametrize("flags,needle", [
    (["--global-batch-size", "10"], "--global-batch-size 10 is not divisible"),
    (["--hidden-size", "96", "--num-attention-heads", "12", "--tensor-model-parallel-size", "8"],
     "--tensor-model-parallel-size"),
    (["--data-path", "no/such/file.txt"], "no/such/file.txt"),
    (["--fp16", "--bf16"], "--fp16 and --bf16"),
    (["--load", "no/such/ckpt"], "holds no checkpoint"),
])
def test_bad_input_is_one_line(flags, needle, tmp_path, capsys):
    assert main(["--config", "configs/tiny.toml", "--run-dir", str(tmp_path / "r"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and err.startswith("error: ") and "\n" not in err
    assert not (tmp_path / "r").exists()  # no run directory was created


def test_vocab_file_that_is_not_gpt2(tmp_path, capsys, shared_data):
    argv = ["--config", "configs/tiny.toml", "--run-dir", str(tmp_path / "r"), "--data-path",
            str(shared_data / "tinyshakespeare" / "input.txt"), "--vocab-file", str(shared_data / "bert" / "vocab.txt"),
            "--merge-file", str(shared_data / "gpt2" / "vocab.bpe")]
    assert main(argv) == 2
    assert "GPT-2" in capsys.readouterr().err


def test_incompatible_checkpoint_and_foreign_save_dir_are_refused(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    run(tmp_path, "first", train_iters=2, save=str(ckpt))
    before = sorted(p.relative_to(ckpt) for p in ckpt.rglob("*"))
    metrics = (ckpt / "metrics.jsonl").read_text()
    # a second run aimed at the same --save without --load
    assert main(["--config", "configs/tiny.toml", "--save", str(ckpt), "--train-iters", "4"]) == 2
    assert "already holds checkpoints of another run" in capsys.readouterr().err
    # loading it into a different architecture
    assert main(["--config", "configs/tiny.toml", "--load", str(ckpt), "--hidden-size", "128",
                 "--run-dir", str(tmp_path / "other")]) == 2
    assert "hidden_size=64" in capsys.readouterr().err
    assert sorted(p.relative_to(ckpt) for p in ckpt.rglob("*")) == before
    assert (ckpt / "metrics.jsonl").read_text() == metrics


def test_default_run_parses_and_prints_a_sample(tmp_path):
    """The embedded default's flags with fewer steps: it trains with TP and DP and prints a generated sample."""
    cfg = parse_config(["--train-iters", "3", "--run-dir", str(tmp_path / "d"), "--generate-tokens", "8"])
    assert cfg.parallel.tensor_model_parallel_size == 2
    r = train(cfg, progress=False)
    assert r.sample is not None and len(r.sample) >= 8


def test_run_directories_that_are_not_mtx_runs_or_cannot_be_written_are_refused(tmp_path, capsys):
    """--save / --run-dir never writes over a file mtx did not create, and bad paths fail before any device work."""
    user = tmp_path / "mine"
    user.mkdir()
    (user / "config.json").write_text('{"my": "own config"}\n')
    (user / "notes.txt").write_text("keep me\n")
    (tmp_path / "file").write_text("a file\n")
    for flag, path, needle in [("--save", user, "holds files mtx did not write (config.json, notes.txt)"),
                               ("--run-dir", user, "holds files mtx did not write"),
                               ("--save", tmp_path / "file", "is a file, not a directory"),
                               ("--save", tmp_path / "file" / "sub", "is a file, not a directory"),
                               ("--tensorboard-dir", tmp_path / "file" / "tb", "is a file, not a directory")]:
        argv = ["--config", "configs/tiny.toml", "--train-iters", "1", flag, str(path)]
        if flag == "--tensorboard-dir":
            argv += ["--run-dir", str(tmp_path / "fresh")]
        assert main(argv) == 2, (flag, path)
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err, err
    assert (user / "config.json").read_text() == '{"my": "own config"}\n' and len(list(user.iterdir())) == 2
    assert not (tmp_path / "fresh").exists()


def test_metrics_hold_each_step_once_after_a_resume(tmp_path):
    """Killed after logging steps past its last checkpoint (step 6's save removed here), a run resumed from step 4
    re-runs steps 5 and 6: metrics.jsonl keeps each step's record once, the resumed run's."""
    import shutil

    ckpt = tmp_path / "ckpt"
    run(tmp_path, "first", train_iters=6, save=str(ckpt), save_interval=4, log_interval=1)
    shutil.rmtree(ckpt / "6")
    resumed = run(tmp_path, "resumed", train_iters=6, save=str(ckpt), load=str(ckpt), log_interval=1)
    records = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records if r["step"] > 4 and "loss" in r] == [resumed.losses[5], resumed.losses[6]]


def test_a_process_builds_and_places_only_the_rows_its_devices_hold():
    """With the data ranks of a (2, 1, 4) mesh split over two hosts (devices 0-3, 4-7) each host holds one half of
    the batch, and the blocks its devices ask for are found in that half alone; one process holds every row."""
    from mtx.sharded_model import HostRows, rows_held
    from mtx.step import TrainStep

    model = TrainStep.build(Config().replace(**load_preset("configs/tiny.toml"), data_parallel_size=2,
                                             tensor_model_parallel_size=4), make_mesh(2, 1, 4)).model
    halves = [rows_held(model.batch_sharding, 16, lambda d, host=host: d.id // 4 == host) for host in (0, 1)]
    assert halves == [HostRows(0, 8, 16), HostRows(8, 16, 16)]
    assert model.host_rows(16) == HostRows(0, 16, 16)
    batch = np.arange(16 * 5).reshape(16, 5)
    second = halves[1]
    for index in [(slice(8, 16), slice(None)), (slice(12, None), slice(1, 3)), (slice(8, 12),)]:
        np.testing.assert_array_equal(second.block(batch[second.slice], index), batch[index])
    placed = model.put_batch(batch.astype(np.int32), HostRows(0, 16, 16))
    np.testing.assert_array_equal(np.asarray(placed), batch)


def test_the_cpu_never_queues_more_than_max_in_flight_steps_or_batches(tmp_path, monkeypatch):
    """With a long log interval (or many evaluation batches) every step was dispatched before one wait, and XLA's
    CPU collectives aborted the process (rc 134) with 100 or more queued: the loop waits every MAX_IN_FLIGHT steps,
    evaluation every MAX_IN_FLIGHT parts of its batches."""
    import mtx.run

    monkeypatch.setattr(mtx.run, "MAX_IN_FLIGHT", 4)
    waits, fetched = [], []
    block, get = jax.block_until_ready, jax.device_get
    monkeypatch.setattr(jax, "block_until_ready", lambda x: (waits.append(1), block(x))[1])
    monkeypatch.setattr(jax, "device_get", lambda x: (fetched.append(len(x) if isinstance(x, list) else 1), get(x))[1])
    r = run(tmp_path, "queued", train_iters=10, log_interval=100, eval_interval=5, eval_iters=9)
    assert len(r.losses) == 10
    # the initial state's and the first step's waits, one a step from the 4th queued on (7), one before evaluating
    # at step 5 (at step 10 the interval's logging has waited for every step); each evaluation's 9 global batches are
    # 18 parts of micro batch x data-parallel size (8 of 16 rows), waited for every 4th: validation at steps 5 and
    # 10, and the test split's once training ends
    assert len(waits) == 2 + 7 + 1 + 3 * (18 // 4), len(waits)
    assert fetched[-4:] == [9, 10, 9, 9], fetched  # each evaluation's 9 losses at once, the interval's 10 steps
