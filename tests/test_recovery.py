"""Recovery from broken checkpoints and from runs that stopped early: found before any device work, said in one
line, and never a dead end (mtx/checkpoint.py `problem`, mtx/resume.py `resume_point`)."""

import json
import logging
import shutil

import pytest

from mtx.checkpoint import MANIFEST, CheckpointError
from mtx.config import Config
from mtx.presets import load_preset
from mtx.run import prepare, train

# a fixed decay: a run resumed to more steps keeps its schedule (mtx/resume.py)
TINY = Config().replace(**load_preset("configs/tiny.toml")).replace(
    hidden_dropout=0.0, attention_dropout=0.0, lr_decay_iters=10)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-step run that saved steps 2 and 4 (and its losses)."""
    path = tmp_path_factory.mktemp("saved") / "run"
    result = train(TINY.replace(train_iters=4, save_interval=2, log_interval=1, save=str(path)), progress=False)
    return path, result.losses


def _data_file(step_dir):
    return max((step_dir / "state").rglob("d/*"), key=lambda f: f.stat().st_size)


def _edit_config(step_dir, edit):
    (step_dir / MANIFEST).unlink()  # a step from before the file record: only the config check can see the edit
    metadata = step_dir / "config" / "metadata"
    config = json.loads(metadata.read_text())
    edit(config)
    metadata.write_text(json.dumps(config))


DAMAGE = {  # what was done to step 4 -> what the message says
    "truncated": (lambda d: _data_file(d).write_bytes(_data_file(d).read_bytes()[:10]), "has 10 bytes"),
    "deleted": (lambda d: _data_file(d).unlink(), "is missing"),
    "emptied config": (lambda d: (d / "config" / "metadata").write_text(""), "config/metadata has 0 bytes"),
    "config item missing": (lambda d: _edit_config(d, lambda c: c["model"].pop("hidden_size")),
                            "its config lacks model.hidden_size"),
    "orbax's metadata deleted": (lambda d: (d / "_CHECKPOINT_METADATA").unlink(), "_CHECKPOINT_METADATA is missing"),
    "config section not an object": (lambda d: _edit_config(d, lambda c: c.update(training=[])),
                                     "its config is not an object of sections"),
    "seed edited": (lambda d: _edit_config(d, lambda c: c["training"].update(seed="12")),
                    "its config has a value mtx refuses: --seed must be an integer"),
    "emptied metadata, no record": (lambda d: ((d / MANIFEST).unlink(), (d / "state" / "_METADATA").write_text("")),
                                    "state/_METADATA is empty"),
    "record not an object": (lambda d: (d / MANIFEST).write_text("[]"),
                             f"its file record {MANIFEST} is not an object of file sizes in bytes"),
    "record size a string": (lambda d: (d / MANIFEST).write_text('{"state/_METADATA": "x"}'),
                             f"its file record {MANIFEST} is not an object of file sizes in bytes"),
    # a training value a resume reads (the batch sizes) or evaluation does (the micro batch), edited
    "batch size edited": (lambda d: _edit_config(d, lambda c: c["training"].update(global_batch_size="16")),
                          "its config has a value mtx refuses: --global-batch-size must be an integer"),
    "micro batch zeroed": (lambda d: _edit_config(d, lambda c: c["training"].update(micro_batch_size=0)),
                           "its config has a value mtx refuses: --micro-batch-size must be >= 1, got 0."),
    # one that only evaluation reads: the step counted as intact, then eval.py refused the flag (no fall-back)
    "layer scan edited": (lambda d: _edit_config(d, lambda c: c["training"].update(scan_layers="yes")),
                          "its config has a value mtx refuses: --scan-layers must be"),
    # fields each of a valid type and range, together impossible (no run could have saved them)
    "tokenizer pair broken": (
        lambda d: _edit_config(d, lambda c: c["data"].update(tokenizer_type="HuggingFaceTokenizer")),
        "its config has values mtx refuses together: --tokenizer-type HuggingFaceTokenizer and"),
}


def _damaged(saved, tmp_path, how):
    path = tmp_path / "run"
    shutil.copytree(saved[0], path)
    DAMAGE[how][0](path / "4")
    return path


@pytest.mark.parametrize("how", DAMAGE)
def test_a_broken_step_falls_back_to_the_newest_intact_one(saved, tmp_path, capsys, caplog, how):
    path = _damaged(saved, tmp_path, how)
    plan = prepare(TINY.replace(train_iters=6, load=str(path), save=str(path)))
    out = capsys.readouterr().out
    # orbax's own warning about the step (absl's logger) is not printed beside mtx's line
    assert not [r for r in caplog.records if r.name == "absl" and r.levelno >= logging.WARNING], caplog.text
    assert plan.load_step == 2 and plan.set_aside == (path / "4",)
    assert "step 4 is broken (" in out and DAMAGE[how][1] in out and "resuming from step 2" in out, out
    with pytest.raises(ValueError, match=r"step 4 is broken .*; pass --ckpt-step 2, the newest intact step"):
        prepare(TINY.replace(train_iters=6, load=str(path), ckpt_step=4, run_dir=str(tmp_path / "other")))


def test_resuming_past_a_broken_step_keeps_it_and_retraces_the_run(saved, tmp_path):
    """The broken step is renamed aside (not deleted); the resumed run re-trains steps 3-4 exactly as the first
    did and saves its own step 4."""
    path = _damaged(saved, tmp_path, "truncated")
    resumed = train(TINY.replace(train_iters=6, save_interval=2, log_interval=1, load=str(path), save=str(path)),
                    progress=False)
    assert [resumed.losses[s] for s in (3, 4)] == [saved[1][s] for s in (3, 4)]
    assert (path / "4.broken").is_dir() and {p.name for p in path.iterdir()} >= {"2", "4", "6", "4.broken"}


def test_no_intact_step_and_unreadable_arrays_are_one_line_errors(saved, tmp_path, caplog):
    path = _damaged(saved, tmp_path, "deleted")
    (path / "2" / "config" / "metadata").write_text("")
    with pytest.raises(ValueError, match="step 4 is broken .*no step is intact: start a new run"):
        prepare(TINY.replace(train_iters=6, load=str(path), run_dir=str(tmp_path / "a")))
    # Bytes changed in place (same size): only reading the arrays finds it, after the checks.
    path = tmp_path / "same_size"
    shutil.copytree(saved[0], path)
    data = _data_file(path / "4")
    data.write_bytes(data.read_bytes()[:10] + bytes(data.stat().st_size - 20) + data.read_bytes()[-10:])
    plan = prepare(TINY.replace(train_iters=6, load=str(path), run_dir=str(tmp_path / "b")))
    with pytest.raises(CheckpointError, match=r"step 4 could not be read \(.*\); pass --ckpt-step 2") as error:
        train(plan, progress=False)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "b").exists()  # the run directory it made for itself taken back
    plan = prepare(TINY.replace(train_iters=6, load=str(path), save=str(tmp_path / "c")))  # orbax's, too
    with pytest.raises(CheckpointError, match=r"step 4 could not be read"):
        train(plan, progress=False)
    assert not (tmp_path / "c").exists()
    # Every array's bytes changed: each read task fails, and asyncio would log each one's traceback at shutdown
    for data in (path / "4" / "state").rglob("d/*"):
        data.write_bytes(bytes(b ^ 0xFF for b in data.read_bytes()))
    plan = prepare(TINY.replace(train_iters=6, load=str(path), run_dir=str(tmp_path / "d")))
    with pytest.raises(CheckpointError, match=r"step 4 could not be read"):
        train(plan, progress=False)
    assert not [r for r in caplog.records if r.name == "asyncio"]


def test_one_step_given_as_the_checkpoint_directory_is_named_so(saved, tmp_path):
    """--load RUN/2 once said "holds no checkpoint": every tool that reads --load names the directory and the step."""
    from mtx.evaluation import checkpoint_config

    step = saved[0] / "2"
    said = f"--load {step} is step 2 of the checkpoints in {saved[0]}; pass --load {saved[0]} --ckpt-step 2."
    for read in (lambda: prepare(TINY.replace(load=str(step), save=str(tmp_path / "new"))),
                 lambda: checkpoint_config(str(step))):
        with pytest.raises(ValueError) as e:
            read()
        assert str(e.value) == said


def test_a_run_killed_in_its_first_save_restarts_with_load(saved, tmp_path):
    """Killed while writing its first checkpoint, a run leaves its config, metrics and orbax's unfinished step: a new
    run is refused the directory (naming --load), and --load restarts it from step 0."""
    path = tmp_path / "run"
    path.mkdir()
    for name in ("config.json", "metrics.jsonl"):
        shutil.copy(saved[0] / name, path / name)
    shutil.copytree(saved[0] / "2" / "config", path / "2.orbax-checkpoint-tmp-1" / "config")
    with pytest.raises(ValueError, match=f"pass --load {path} to resume it"):
        prepare(TINY.replace(train_iters=2, save=str(path)))
    config = json.loads((path / "config.json").read_text())
    for edit, said in ((lambda c: c["model"].pop("hidden_size"), "its config lacks model.hidden_size"),
                       (lambda c: c.update(training=[]), "its config is not an object of sections"),
                       (lambda c: c["training"].update(seed="12"), "its config has a value mtx refuses")):
        edited = json.loads(json.dumps(config))
        edit(edited)
        (path / "config.json").write_text(json.dumps(edited))  # checked as a checkpoint's config is (once: not)
        with pytest.raises(ValueError, match=f"--load {path}: {said}.*config.json of its unfinished run"):
            prepare(TINY.replace(train_iters=2, load=str(path), save=str(path), use_checkpoint_args=True))
    began = json.loads(json.dumps(config))
    began["training"].update(load="elsewhere")  # a run that itself resumed (or fine-tuned) from another checkpoint
    (path / "config.json").write_text(json.dumps(began))
    with pytest.raises(ValueError, match="its run began from --load elsewhere .a restart from step 0 would drop"):
        prepare(TINY.replace(train_iters=2, load=str(path), save=str(path)))  # (it restarted from random weights)
    began["training"].update(load=str(path))  # a restart like this one, killed before its first save: restarts
    (path / "config.json").write_text(json.dumps(began))
    assert prepare(TINY.replace(train_iters=2, load=str(path), save=str(path))).load_step is None
    (path / "config.json").write_text(json.dumps(config))
    restarted = train(TINY.replace(train_iters=2, log_interval=1, load=str(path), save=str(path)), progress=False)
    assert [restarted.losses[s] for s in (1, 2)] == [saved[1][s] for s in (1, 2)]
    steps = [json.loads(line)["step"] for line in (path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2] and (path / "2").is_dir()


def test_a_finished_run_without_checkpoints_is_not_restarted(saved, tmp_path):
    """A run directory of --run-dir alone (a finished run's config and metrics, no --save) is no unfinished
    checkpointing run: --load refuses it rather than restart it over its records (it replaced them once)."""
    path = tmp_path / "metrics_only"
    path.mkdir()
    config = json.loads((saved[0] / "config.json").read_text())
    config["training"].update(save=None, run_dir=str(path))
    (path / "config.json").write_text(json.dumps(config))
    shutil.copy(saved[0] / "metrics.jsonl", path / "metrics.jsonl")
    before = {f.name: f.read_bytes() for f in path.iterdir()}
    for save in (path, tmp_path / "new"):
        with pytest.raises(ValueError, match=f"--load {path} holds no checkpoint: its run wrote metrics only"):
            prepare(TINY.replace(train_iters=2, seed=7, load=str(path), save=str(save)))
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before and not (tmp_path / "new").exists()


def test_an_emptied_step_is_set_aside_like_a_broken_one(saved, tmp_path, capsys):
    """A step directory emptied since: resumed from the newest intact step, it is said to be broken and set aside
    (the run-directory check then called it a file mtx did not write, refusing the resume it had just announced)."""
    path = tmp_path / "run"
    shutil.copytree(saved[0], path)
    shutil.rmtree(path / "4")
    (path / "4").mkdir()
    plan = prepare(TINY.replace(train_iters=6, load=str(path), save=str(path)))
    assert plan.load_step == 2 and plan.set_aside == (path / "4",)
    assert "step 4 is broken (" in capsys.readouterr().out
    (path / "config.json").write_text("{")  # the run's own config, damaged: named as such, not as a user's file
    with pytest.raises(ValueError, match="its config.json is not the one mtx wrote .damaged or replaced., beside"):
        prepare(TINY.replace(train_iters=6, load=str(path), save=str(path)))


def test_load_and_save_spelt_two_ways_resume(saved, tmp_path, monkeypatch, capsys):
    """--load and --save naming one directory through a link or a relative path resume it (were "--save holds
    checkpoints of another run; pass --load"); a --profile window that began before the resumed step traces what is
    left of it, or nothing, and says so (a requeued command line was refused)."""
    path = tmp_path / "run"
    shutil.copytree(saved[0], path)
    (tmp_path / "link").symlink_to(path)
    monkeypatch.chdir(tmp_path)
    for load, save in ((tmp_path / "link", path), (path, "run")):
        assert prepare(TINY.replace(train_iters=6, load=str(load), save=str(save))).load_step == 4
    capsys.readouterr()
    for end, traced in ((6, (True, 4)), (4, (False, 3))):  # the same command line requeued after the window began
        plan = prepare(TINY.replace(train_iters=20, load=str(path), save=str(path), profile=True, profile_step_start=3,
                                    profile_step_end=end))
        assert (plan.cfg.training.profile, plan.cfg.training.profile_step_start) == traced
    out = capsys.readouterr().out
    assert "--profile's steps 4..6 begin before step 4, where this run resumes: tracing steps 5..6." in out
    assert "--profile's steps 4..4 begin before step 4, where this run resumes: no trace." in out


def test_signals_and_exit_flags_stop_after_a_step_with_a_checkpoint(saved, tmp_path, monkeypatch, capsys):
    """SIGTERM mid-run, --exit-interval and --exit-duration-in-mins each stop after the step, save it, and say how to
    resume; resuming continues the same trajectory."""
    import os
    import signal

    from mtx.step import TrainStep

    call = TrainStep.__call__
    calls = []

    def preempted(self, state, batch):  # the scheduler's SIGTERM arrives during the second step
        calls.append(None)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return call(self, state, batch)

    monkeypatch.setattr(TrainStep, "__call__", preempted)
    path = tmp_path / "run"
    r = train(TINY.replace(train_iters=4, log_interval=1, save=str(path)), progress=False)
    monkeypatch.setattr(TrainStep, "__call__", call)
    assert r.stopped == "SIGTERM received" and int(r.state.step) == 2 and (path / "2").is_dir()
    assert f"stopped after step 2 (SIGTERM received); checkpoint saved in {path}: resume with --load" in \
        capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler lives as long as the run
    resumed = train(TINY.replace(train_iters=4, log_interval=1, save=str(path), load=str(path), exit_interval=3),
                    progress=False)
    assert resumed.stopped == "--exit-interval 3" and [resumed.losses[3]] == [saved[1][3]] and (path / "3").is_dir()
    r = train(TINY.replace(train_iters=4, exit_duration_in_mins=1e-9, run_dir=str(tmp_path / "d")), progress=False)
    assert r.stopped == "--exit-duration-in-mins 1e-09" and int(r.state.step) == 1
    assert "no --save, so nothing was saved" in capsys.readouterr().out


def test_kill_9_at_random_moments_resumes_to_the_uninterrupted_run_bitwise(tmp_path):
    """Fault injection: `python train.py` killed with SIGKILL three times (once while a checkpoint is being written,
    twice at random moments; the seed fixes them) and resumed with --load each time ends with the loss curve and,
    bitwise, the training state of a run never interrupted."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import jax
    import numpy as np

    from mtx.checkpoint import Checkpointer
    from mtx.devices import cpu_devices_flag
    from mtx.parallel.mesh import make_mesh
    from mtx.step import TrainStep

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_devices_flag(8), PYTHONPATH=str(root))
    flags = ["--config", "configs/tiny.toml", "--train-iters", "10", "--save-interval", "2", "--log-interval", "1"]

    def start(path, resume):
        return subprocess.Popen([sys.executable, "train.py", *flags, "--save", str(path),
                                 *(["--load", str(path)] if resume else [])],
                                cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def logged(path):
        metrics = path / "metrics.jsonl"
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    reference, killed = tmp_path / "reference", tmp_path / "killed"
    assert start(reference, False).wait(timeout=180) == 0
    rng = np.random.default_rng(0)
    for attempt, moment in enumerate(["during a save", "random", "random"]):
        proc = start(killed, resume=attempt > 0)
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline:
            saving = any(".orbax-checkpoint-tmp" in p.name for p in killed.glob("*"))
            if (saving if moment == "during a save" else logged(killed) >= 2 * attempt + int(rng.integers(1, 4))):
                break
            time.sleep(0.002)
        assert proc.poll() is None, f"the run ended before kill {attempt}: {proc.stderr.read()[-2000:]}"
        time.sleep(rng.uniform(0, 0.05) if moment == "random" else 0)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    final = start(killed, resume=True)
    assert final.wait(timeout=180) == 0, final.stderr.read()[-2000:]

    def curve(path):
        records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in records if "loss" in r]

    assert curve(killed) == curve(reference) and len(curve(reference)) == 10
    cfg = Checkpointer(reference).saved_config(10)
    step = TrainStep.build(cfg, make_mesh(cfg.data_parallel_size(8), 1, cfg.parallel.tensor_model_parallel_size))
    states = [Checkpointer(path).restore(step.abstract_state(), cfg, step=10) for path in (reference, killed)]
    for a, b in zip(*(jax.tree.leaves(jax.device_get(s)) for s in states)):
        np.testing.assert_array_equal(a, b)


def test_steps_set_aside_twice_keep_both_and_stay_mtx_files(tmp_path):
    from mtx.files import check_run_dir
    from mtx.resume import set_aside

    for _ in range(2):
        (tmp_path / "4").mkdir()
        (tmp_path / "4" / "x").write_text("kept")
        set_aside(tmp_path / "4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4.broken", "4.broken1"]
    check_run_dir(tmp_path, "--save")  # what mtx set aside does not make the directory foreign


def test_out_of_memory_is_one_line_naming_the_fixes_and_takes_back_its_new_directory(tmp_path, capsys):
    """XLA's RESOURCE_EXHAUSTED in the first step was a traceback, and left the new run directory's config behind
    (a retry with --save then met an unfinished run)."""
    import train as train_script

    run = tmp_path / "run"
    code = train_script.main(["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "8",
                              "--micro-batch-size", "1", "--global-batch-size", "8", "--seq-length", "60000",
                              "--max-position-embeddings", "60000", "--train-iters", "2", "--eval-interval", "0",
                              "--save", str(run)])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1, errors
    assert errors[0].startswith("error: a device ran out of memory (RESOURCE_EXHAUSTED: ")
    assert "a smaller --micro-batch-size (now 1) or --seq-length (now 60000), --recompute-granularity full" in errors[0]
    assert not run.exists()


def test_out_of_memory_names_a_gpu_share_below_the_default(monkeypatch):
    """On a GPU whose allocator holds less than mtx's 0.9 (set so, or JAX's own 0.75 where the backends started
    first), the fixes name a larger share, by the setting that made it."""
    import jax

    from mtx.config import Config
    from mtx.errors import training_memory_fixes

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        monkeypatch.delenv(name, raising=False)
    cases = [("XLA_CLIENT_MEM_FRACTION", "0.6", None, "(XLA_CLIENT_MEM_FRACTION, now 0.6)"),
             ("XLA_CLIENT_MEM_FRACTION", "0.6", 0.6, "(--gpu-memory-fraction, now 0.6)"),
             ("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5", None, "(XLA_PYTHON_CLIENT_MEM_FRACTION, now 0.5)"),
             (None, None, None, "(--gpu-memory-fraction, now 0.75)"),
             ("XLA_CLIENT_MEM_FRACTION", "0.9", None, None), ("XLA_CLIENT_MEM_FRACTION", "0.95", 0.95, None)]
    for name, value, flag, named in cases:
        if name:
            monkeypatch.setenv(name, value)
        fixes = training_memory_fixes(Config().replace(gpu_memory_fraction=flag))
        shares = [fix for fix in fixes if fix.startswith("a larger share of each GPU")]
        assert shares == ([] if named is None else [f"a larger share of each GPU {named}"]), (name, value, fixes)
        assert fixes[-1].startswith("the model spread over more devices")
        if name:
            monkeypatch.delenv(name)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # the CPU's memory is no share
    assert not any("share" in fix for fix in training_memory_fixes(Config()))


def test_out_of_memory_in_eval_is_one_line(monkeypatch, capsys):
    import jax

    import eval as eval_script
    from mtx import eval_tasks

    def task(loaded):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 480253225752 bytes.")

    monkeypatch.setattr(eval_tasks, "prepare", lambda args: (lambda: None, task))
    for argv, fix in ((["lambada", "--load", "x", "--data-path", "y"], "a smaller --micro-batch-size or --seq-length"),
                      (["generate", "--load", "x", "--prompt", "hi"], "fewer --prompt or --max-new-tokens")):
        assert eval_script.main(argv) == 1  # a traceback once
        assert capsys.readouterr().err == (f"error: a device ran out of memory (RESOURCE_EXHAUSTED: Out of memory "
                                           f"allocating 480253225752 bytes.); try {fix} or the model spread over more "
                                           "devices (--tensor-model-parallel-size, now 1; "
                                           "--pipeline-model-parallel-size, now 1).\n")
