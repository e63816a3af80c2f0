"""Experiment tracking: metrics records with tokens and wall time, Megatron-style log lines for batch jobs, tqdm on a
terminal, W&B beside TensorBoard, and missing tracker packages refused before any device work."""

import json
import re
import sys
import time

import pytest

from mtx.config import Config
from mtx.metrics import Progress
from mtx.presets import load_preset
from mtx.run import train

# a fixed decay: a run resumed to more steps keeps its schedule (mtx/resume.py)
TINY = Config().replace(**load_preset("configs/tiny.toml"), lr_decay_iters=10)
LINE = re.compile(r" iteration +(\d+)/ +4 \| consumed samples: +(\d+) \| elapsed time per iteration \(ms\): [\d.]+ \|"
                  r" throughput per GPU \(TFLOP/s/GPU\): [\d.]+ \| learning rate: (\S+) \| global batch size: +16 \|"
                  r" lm loss: (\S+) \| loss scale: 1\.0 \| grad norm: [\d.]+ \| number of skipped iterations: +0 \|")


def records(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_batch_jobs_get_megatron_lines_and_records_carry_tokens_and_wall_time(tmp_path, capsys):
    """stdout is not a terminal here (captured): one plain line per logged interval and no carriage returns; each
    record's tokens count from step 0 and keep counting after a resume."""
    before = time.time()
    train(TINY.replace(train_iters=4, log_interval=2, save_interval=2, save=str(tmp_path / "run")))
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if line.startswith(" iteration")]
    logged = [r for r in records(tmp_path / "run") if "loss" in r]
    assert len(lines) == 2 and "\r" not in out + err
    for line, record in zip(lines, logged):
        step, samples, lr, loss = LINE.fullmatch(line).groups()
        assert (int(step), int(samples)) == (record["step"], record["step"] * 16)
        assert float(lr) == pytest.approx(record["lr"], rel=1e-6) and float(loss) == pytest.approx(record["loss"])
    assert [(r["step"], r["tokens"]) for r in logged] == [(2, 2 * 16 * 32), (4, 4 * 16 * 32)]
    assert before < logged[0]["wall_time"] < logged[1]["wall_time"] < time.time()
    train(TINY.replace(train_iters=6, log_interval=2, load=str(tmp_path / "run"), save=str(tmp_path / "run")),
          progress=False)
    assert [r["tokens"] for r in records(tmp_path / "run")] == [1024, 2048, 3072]


def test_a_terminal_gets_the_progress_bar(capsys, monkeypatch):
    record = {"step": 2, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "loss_scale": 1.0, "skipped_steps": 0,
              "step_time_s": 0.1, "tokens_per_s": 5120.0, "tflops_per_device": 0.1, "mfu": None}
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    bar = Progress(0, 4, 16)
    bar.update(record, 2)
    bar.close()
    out, err = capsys.readouterr()
    assert bar.mode == "bar" and out == "" and "\r" in err and "2/4" in err and "loss=5.000" in err
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    lines = Progress(0, 4, 16)
    lines.update(record, 2)
    assert lines.mode == "lines" and LINE.fullmatch(capsys.readouterr().out.rstrip("\n"))
    Progress(0, 4, 16, enabled=False).update(record, 2)
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("flag,package", [("--wandb-project", "wandb"), ("--tensorboard-dir", "tensorboard")])
def test_a_missing_tracker_package_is_one_line_before_any_device_work(tmp_path, capsys, monkeypatch, flag, package):
    monkeypatch.syspath_prepend(".")
    import train as train_script

    monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    argv = ["--config", "configs/tiny.toml", "--run-dir", str(tmp_path / "r"), flag, str(tmp_path / "x")]
    assert train_script.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {flag} needs the {package} package, which is not installed: pip install 'mtx[{package}]'."
    assert not (tmp_path / "r").exists()


def test_wandb_offline_logs_the_tensorboard_scalars(tmp_path, monkeypatch):
    """W&B (offline) gets exactly the scalars TensorBoard gets, at the same steps, in a run named as asked."""
    pytest.importorskip("wandb", reason="wandb is an optional extra: pip install 'mtx[wandb]'")
    pytest.importorskip("tensorboard", reason="compared with TensorBoard's events: pip install 'mtx[tensorboard]'")
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    for name, value in dict(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONSOLE="off",
                            WANDB_CONFIG_DIR=str(tmp_path / "cfg"), WANDB_CACHE_DIR=str(tmp_path / "cache"),
                            WANDB_DATA_DIR=str(tmp_path / "data")).items():
        monkeypatch.setenv(name, value)
    from wandb.sdk.wandb_run import Run

    logged, runs = {}, []
    log = Run.log

    def spy(self, data, step=None, **kw):
        runs.append(self)
        logged.update({(step, k): v for k, v in data.items()})
        return log(self, data, step=step, **kw)

    monkeypatch.setattr(Run, "log", spy)
    train(TINY.replace(train_iters=4, log_interval=2, eval_interval=4, eval_iters=1, split="90,10,0",
                       run_dir=str(tmp_path / "run"), tensorboard_dir=str(tmp_path / "tb"),
                       wandb_project="mtx-tests", wandb_exp_name="tiny", wandb_save_dir=str(tmp_path / "wb")),
          progress=False)
    events = [e for f in (tmp_path / "tb").iterdir() for e in LegacyEventFileLoader(str(f)).Load()]
    board = {(e.step, v.tag): v.simple_value for e in events for v in e.summary.value}
    assert {"loss", "lr", "tokens", "val_loss", "val_ppl"} <= {k for _, k in board}
    assert logged.keys() == board.keys(), (logged.keys(), board.keys())
    assert {k: (logged[k], board[k]) for k in board if logged[k] != pytest.approx(board[k])} == {}
    assert (runs[0].project, runs[0].name) == ("mtx-tests", "tiny")
    assert len(list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))) == 1


def test_a_resumed_run_logs_into_the_same_wandb_run(tmp_path, monkeypatch):
    """--load of a run directory goes on in the W&B run that directory started (its id kept beside the metrics); a
    new run directory starts a new W&B run."""
    pytest.importorskip("wandb", reason="wandb is an optional extra: pip install 'mtx[wandb]'")
    for name, value in dict(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONSOLE="off",
                            WANDB_CONFIG_DIR=str(tmp_path / "cfg"), WANDB_CACHE_DIR=str(tmp_path / "cache"),
                            WANDB_DATA_DIR=str(tmp_path / "data")).items():
        monkeypatch.setenv(name, value)
    import wandb

    ids, init = [], wandb.init

    def spy(*args, **kw):
        run = init(*args, **kw)
        ids.append((run.id, kw.get("resume")))
        return run

    monkeypatch.setattr(wandb, "init", spy)
    cfg = TINY.replace(log_interval=1, eval_interval=0, wandb_project="mtx-tests", save_interval=2)
    train(cfg.replace(train_iters=2, save=str(tmp_path / "run")), progress=False)
    train(cfg.replace(train_iters=3, save=str(tmp_path / "run"), load=str(tmp_path / "run")), progress=False)
    train(cfg.replace(train_iters=1, save=str(tmp_path / "other")), progress=False)
    assert ids[1] == (ids[0][0], "allow") and ids[2][0] != ids[0][0] and ids[2][1] is None
    assert (tmp_path / "run" / "wandb_run_id").read_text().strip() == ids[0][0]


def test_wandb_files_and_steps_being_deleted_count_as_mtx_files(tmp_path):
    """W&B's folder (its default place is the run directory), --profile's trace folder and a step left half-deleted
    by --keep-last-n-checkpoints do not make a run directory foreign; a file named wandb still does."""
    from mtx.files import check_run_dir

    (tmp_path / "wandb").mkdir()
    (tmp_path / "profile").mkdir()
    (tmp_path / "3.deleting").mkdir()
    check_run_dir(tmp_path, "--save")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "wandb").write_text("mine")
    with pytest.raises(ValueError, match=r"holds files mtx did not write \(wandb\)"):
        check_run_dir(tmp_path / "other", "--save")


def test_wandb_that_will_not_start_is_one_line(tmp_path, capsys, monkeypatch):
    """wandb.init failing (not logged in, no network) ends train.py with one line naming the fix, exit status 2,
    before the device work (no state initialized or compiled)."""
    wandb = pytest.importorskip("wandb", reason="wandb is an optional extra: pip install 'mtx[wandb]'")
    monkeypatch.syspath_prepend(".")
    import train as train_script
    from mtx.step import TrainStep

    monkeypatch.setattr(TrainStep, "init_state", lambda self: pytest.fail("device work before W&B started"))

    def refuse(**kw):
        raise wandb.errors.UsageError("api_key not configured (no-tty)\ncall wandb.login(key=...)")

    monkeypatch.setattr(wandb, "init", refuse)
    argv = ["--config", "configs/tiny.toml", "--run-dir", str(tmp_path / "r"), "--train-iters", "1",
            "--wandb-project", "p"]
    assert train_script.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert err == ["error: --wandb-project p: W&B did not start (UsageError: api_key not configured (no-tty)); run "
                   "`wandb login`, or set WANDB_MODE=offline to keep the run on disk."]
    assert not (tmp_path / "r").exists()  # the run directory it made is taken back (its config.json was left once)


def test_a_diverged_loss_is_written_as_strict_json(tmp_path):
    """A NaN or infinite loss (a run that diverged) goes into metrics.jsonl as null (json_line, which eval's and
    bench's result lines use too): Python's NaN is not JSON, and strict readers (jq, JavaScript) refused the file."""
    from mtx.files import json_line
    from mtx.metrics import MetricsLogger

    def strict(line):
        return json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} written"))

    nan, inf = float("nan"), float("inf")
    assert strict(json_line({"loss": nan, "ppl": [inf, 1.5, (-inf,)], "n": 3, "s": "nan"})) == {
        "loss": None, "ppl": [None, 1.5, [None]], "n": 3, "s": "nan"}
    logger = MetricsLogger(tmp_path, tokens_per_step=4)
    returned = logger.log({"step": 1, "loss": nan})["loss"]
    assert returned != returned  # the record returned keeps its NaN (the console line, the trackers)
    assert strict((tmp_path / "metrics.jsonl").read_text())["loss"] is None


def test_throughput_mfu_and_perplexity_by_value(monkeypatch):
    """MFU = tokens/s x FLOPs per token / devices / the device's peak (989 TFLOP/s dense bf16 on an H100 or H200);
    None where mtx knows no peak (the CPU); the perplexity logged beside a loss is exp(loss), inf past a float's."""
    import math
    import types

    from mtx import metrics
    from mtx.evaluation import perplexity

    card = types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")
    assert metrics.peak_flops_per_device(card) == 989e12
    assert metrics.peak_flops_per_device(types.SimpleNamespace(device_kind="cpu")) is None
    monkeypatch.setattr(metrics, "peak_flops_per_device", lambda device=None: 1e12)
    assert metrics.throughput(1000, 2.0, 6e9, 4) == {"tokens_per_s": 500.0, "tflops_per_device": 0.75, "mfu": 0.75}
    monkeypatch.setattr(metrics, "peak_flops_per_device", lambda device=None: None)
    assert metrics.throughput(1000, 2.0, 6e9, 4)["mfu"] is None
    assert perplexity(2.0) == math.exp(2.0) and perplexity(800.0) == math.inf and math.isnan(perplexity(math.nan))


def test_trackers_get_steps_between_records_and_memory_where_the_devices_report_it(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="read back from TensorBoard's events: pip install 'mtx[tensorboard]'")
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    from mtx import metrics
    from mtx.cli import parse_config

    run = train(TINY.replace(train_iters=6, log_interval=3, tensorboard_log_interval=2, eval_interval=0,
                             run_dir=str(tmp_path / "run"), tensorboard_dir=str(tmp_path / "tb")), progress=False)
    events = [e for f in (tmp_path / "tb").iterdir() for e in LegacyEventFileLoader(str(f)).Load()]
    board = {(e.step, v.tag): v.simple_value for e in events for v in e.summary.value}
    assert sorted(s for s, tag in board if tag == "loss") == [2, 4, 6]  # every 2nd step's, as Megatron's
    assert {tag for s, tag in board if s in (2, 4)} == {"loss", "lr", "grad_norm", "loss_scale"}  # a step's own
    assert {"tokens", "step_time_s"} <= {tag for s, tag in board if s == 6}  # a record's, on the interval
    assert [board[s, "loss"] for s in (2, 4)] == pytest.approx([run.losses[2], run.losses[4]])
    with pytest.raises(ValueError, match="--tensorboard-log-interval .*--tensorboard-dir or --wandb-project"):
        parse_config(["--tensorboard-log-interval", "5"]).validate()

    with pytest.raises(ValueError, match="--log-memory-to-tensorboard: the cpu devices report no memory statistics"):
        train(TINY.replace(log_memory_to_tensorboard=True), progress=False)
    devices = [{"bytes_in_use": 5, "peak_bytes_in_use": 9, "bytes_limit": 20, "pool_bytes": 12},
               {"bytes_in_use": 7, "peak_bytes_in_use": 8, "bytes_limit": 20, "bytes_reserved": 3}]
    monkeypatch.setattr(metrics, "_memory_stats", lambda: devices)  # as a GPU's allocator reports them
    train(TINY.replace(train_iters=2, log_interval=1, eval_interval=0, log_memory_to_tensorboard=True,
                       run_dir=str(tmp_path / "mem")), progress=False)
    record = records(tmp_path / "mem")[-1]  # the fullest device's (the most bytes in use)
    assert [record[k] for k in ("mem_allocated_bytes", "mem_max_allocated_bytes", "mem_reserved_bytes",
                                "mem_limit_bytes")] == [7, 8, 3, 20]


def test_trackers_get_steps_in_order_when_evaluations_fall_between_records(tmp_path, monkeypatch):
    """W&B drops a step older than one it has: an evaluation inside a logging interval waits for the steps before it
    (which come with the next record), and the last one is written when the run ends."""
    pytest.importorskip("tensorboard", reason="its writer is spied on: pip install 'mtx[tensorboard]'")
    from mtx import metrics

    written = []
    monkeypatch.setattr(metrics._TensorBoard, "scalars", lambda self, step, values: written.append((step, *values)))
    train(TINY.replace(train_iters=5, log_interval=3, eval_interval=2, eval_iters=1, split="90,10,0",
                       run_dir=str(tmp_path / "run"), tensorboard_dir=str(tmp_path / "tb")), progress=False)
    steps = [step for step, *_ in written]
    assert steps == sorted(steps) and {1, 2, 3, 4, 5} <= set(steps)
    assert [step for step, *tags in written if "val_loss" in tags] == [2, 4, 5]  # the last one after the last record
