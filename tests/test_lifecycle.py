"""The checkpoint lifecycle: which steps --save keeps (--keep-last-n-checkpoints, --keep-checkpoint-every), saving in
the background (--async-save), and what a run takes from --load (--finetune, --no-load-optim, --no-load-rng,
--use-checkpoint-args). Tiny model, a few steps, 8 simulated CPU devices."""

import json

import jax
import numpy as np
import optax
import pytest

from mtx.checkpoint import MANIFEST, Checkpointer
from mtx.config import Config
from mtx.presets import load_preset
from mtx.run import prepare, train

TINY = Config().replace(**load_preset("configs/tiny.toml"))  # dropout on: the RNG must resume too


def run(tmp_path, name, **flags):
    where = {} if "save" in flags else {"run_dir": str(tmp_path / name)}  # --save is the run directory then
    return train(TINY.replace(**where, log_interval=1, **flags), progress=False)


def leaves(state):
    return jax.tree.leaves(jax.device_get(state))


def counts(state):
    """(Adam's step count, the lr schedule's step count) of a training state."""
    kinds = (optax.ScaleByAdamState, optax.ScaleByScheduleState)
    found = [x for x in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, kinds))
             if isinstance(x, kinds)]
    return tuple(int(next(x for x in found if isinstance(x, kind)).count) for kind in kinds)


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A 4-step run that saved steps 2 and 4: (its directory, its result)."""
    path = tmp_path_factory.mktemp("base") / "run"
    return path, train(TINY.replace(train_iters=4, save_interval=2, log_interval=1, save=str(path)), progress=False)


@pytest.fixture(scope="module")
def resumed(base, tmp_path_factory):
    """The base run resumed from step 2 with everything loaded."""
    return train(TINY.replace(train_iters=4, log_interval=1, load=str(base[0]), ckpt_step=2,
                              run_dir=str(tmp_path_factory.mktemp("resumed") / "run")), progress=False)


def test_retention_keeps_the_newest_n_and_every_kth_step(tmp_path):
    path = tmp_path / "run"
    run(tmp_path, "r", train_iters=6, save_interval=1, save=str(path), keep_last_n_checkpoints=2,
        keep_checkpoint_every=4)
    assert sorted(p.name for p in path.iterdir() if p.is_dir()) == ["4", "5", "6"]
    assert all(Checkpointer(path).problem(s) is None for s in (4, 5, 6))


def test_pruning_deletes_only_intact_steps_that_hold_nothing_but_mtx_files(tmp_path):
    """Steps 1-6 of which 2 has no file record, 3 holds a file someone added and 5 (or 6) is truncated; a leftover
    of an interrupted deletion and a folder that is no step. Keeping 1: the newest step stays, and when it is broken
    so does the newest intact one (5), which a resume would fall back to; only 1 and 4 go. Step 1 a link to a step
    kept elsewhere: kept (pruning it once renamed the link and died in rmtree mid-run)."""
    for broken, linked in ((5, False), (6, False), (5, True)):
        folder = tmp_path / f"broken{broken}{linked}"
        for s in range(1, 7):
            where = tmp_path / f"elsewhere{broken}" if linked and s == 1 else folder / str(s)
            where.mkdir(parents=True)
            if where != folder / str(s):
                folder.mkdir(parents=True)
                (folder / str(s)).symlink_to(where)
            (folder / str(s) / "a").write_text("x")
            if s != 2:
                (folder / str(s) / MANIFEST).write_text(json.dumps({"a": 1}))
        (folder / "3" / "notes.txt").write_text("mine")
        (folder / str(broken) / "a").write_text("")
        (folder / "7.deleting").mkdir()
        (folder / "notes").mkdir()
        ckpt = Checkpointer(folder, keep_last=1)
        ckpt._prune()
        left = sorted(p.name for p in folder.iterdir())
        assert left == ["1"] * linked + ["2", "3", "5", "6", "notes"], (broken, left)
        assert not linked or (tmp_path / f"elsewhere{broken}" / "a").read_text() == "x"
        assert ckpt.steps() == [int(s) for s in left if s.isdigit()]


def test_async_save_overlaps_the_next_steps_and_resumes_bitwise_like_a_sync_save(base, tmp_path, monkeypatch):
    """Each step's save is finished and recorded before the next step runs (sync) or at the next save (async);
    both stop at --exit-interval with every step recorded, the same state bit for bit, and resume identically."""
    from mtx.step import TrainStep

    call, seen = TrainStep.__call__, {}

    def watched(self, state, batch):  # which steps are recorded when each step starts
        seen.setdefault(self.model.cfg.training.save, []).append(
            sorted(int(p.parent.name) for p in (tmp_path / "runs").glob(f"{mode}/*/{MANIFEST}")))
        return call(self, state, batch)

    monkeypatch.setattr(TrainStep, "__call__", watched)
    results = {}
    for mode in ("sync", "async"):
        path = tmp_path / "runs" / mode
        results[mode] = run(tmp_path, f"run_{mode}", train_iters=4, save_interval=1, exit_interval=3,
                            save=str(path), async_save=mode == "async")
        assert results[mode].stopped == "--exit-interval 3"
        assert all(Checkpointer(path).problem(s) is None for s in (1, 2, 3))
    assert seen[str(tmp_path / "runs" / "sync")] == [[], [1], [1, 2]]
    assert seen[str(tmp_path / "runs" / "async")] == [[], [], [1]]
    monkeypatch.setattr(TrainStep, "__call__", call)
    for a, b in zip(leaves(results["sync"].state), leaves(results["async"].state)):
        np.testing.assert_array_equal(a, b)
    again = {mode: run(tmp_path, f"again_{mode}", train_iters=4, load=str(tmp_path / "runs" / mode), ckpt_step=2)
             for mode in ("sync", "async")}
    assert again["sync"].losses == again["async"].losses and set(again["sync"].losses) == {3, 4}
    for a, b in zip(leaves(again["sync"].state), leaves(again["async"].state)):
        np.testing.assert_array_equal(a, b)


def test_finetune_loads_only_the_weights(base, tmp_path, caplog):
    """At lr 0 the weights stay the loaded ones bit for bit; the step, the optimizer, the seed and the metrics
    start afresh; --finetune into --load's own directory is refused. orbax's warnings about its read-only reader
    ("Given directory is read only") are not printed."""
    import logging

    path, first = base
    r = run(tmp_path, "ft", train_iters=2, load=str(path), finetune=True, lr=0.0, min_lr=0.0, seed=7)
    assert not [x for x in caplog.records if x.name == "absl" and x.levelno >= logging.WARNING], caplog.text
    for a, b in zip(leaves(r.state.params), leaves(first.state.params)):
        np.testing.assert_array_equal(a, b)
    assert int(r.state.step) == 2 and counts(r.state) == (2, 2)
    assert [(x["step"], x["tokens"]) for x in records(r.run_dir)] == [(1, 512), (2, 1024)]
    assert json.loads((r.run_dir / "config.json").read_text())["training"]["seed"] == 7
    with pytest.raises(ValueError, match="--finetune starts again from step 0.*pass a new --save"):
        prepare(TINY.replace(load=str(path), save=str(path), finetune=True))


def test_a_resume_keeps_the_batch_and_sequence_length_a_finetune_may_change_them(base, tmp_path):
    """Data position and token counts continue by the step: a resume with another global batch or sequence length
    is refused in one line naming the flag; --finetune (a new run from step 0) may change both."""
    path, gbs, s = str(base[0]), TINY.training.global_batch_size, TINY.model.seq_length
    for flags, message in ((dict(global_batch_size=2 * gbs), f"--global-batch-size {gbs} and this run has {2 * gbs}"),
                           (dict(seq_length=s // 2), f"--seq-length {s} and this run has {s // 2}")):
        with pytest.raises(ValueError, match=f"was trained with {message}.*pass .* or --finetune"):
            prepare(TINY.replace(load=path, run_dir=str(tmp_path / "r"), **flags))
    # a shorter sequence keeps the learned position table's rows only when told to (it was refused after the
    # compile, as a step that "could not be read")
    with pytest.raises(ValueError, match=f"saved with max_position_embeddings={s} but this run has {s // 2}; pass "
                                         f"--max-position-embeddings {s} \\(or"):
        prepare(TINY.replace(load=path, run_dir=str(tmp_path / "ft"), finetune=True, seq_length=s // 2))
    prepare(TINY.replace(load=path, run_dir=str(tmp_path / "ft"), finetune=True, global_batch_size=2 * gbs,
                         seq_length=s // 2, max_position_embeddings=s))


def test_no_load_optim_keeps_weights_step_and_lr_with_a_fresh_optimizer(base, resumed, tmp_path):
    r = run(tmp_path, "fresh_optim", train_iters=4, load=str(base[0]), ckpt_step=2, load_optim=False)
    assert r.losses[3] == resumed.losses[3] and r.losses[4] != resumed.losses[4]  # same weights, other moments
    assert counts(r.state) == (2, 4) and counts(resumed.state) == (4, 4)  # Adam afresh, the lr schedule continues
    assert [x["lr"] for x in records(r.run_dir)] == [x["lr"] for x in records(resumed.run_dir)]


def test_the_seed_comes_from_the_checkpoint_unless_no_load_rng(base, resumed, tmp_path, capsys):
    """mtx's RNG state is the seed (dropout and data order are functions of seed and step): a resume takes the
    checkpoint's, saying so when --seed differs; --no-load-rng takes --seed."""
    assert [resumed.losses[s] for s in (3, 4)] == [base[1].losses[s] for s in (3, 4)]
    capsys.readouterr()
    other = run(tmp_path, "seed7", train_iters=4, load=str(base[0]), ckpt_step=2, seed=7)
    assert "seed = 1234 from the checkpoint, not --seed 7 (the checkpoint's RNG state; pass --no-load-rng" in \
        capsys.readouterr().out
    assert other.losses == resumed.losses
    fresh = run(tmp_path, "norng", train_iters=4, load=str(base[0]), ckpt_step=2, seed=7, load_rng=False)
    assert fresh.losses[3] != resumed.losses[3]
    assert json.loads((fresh.run_dir / "config.json").read_text())["training"]["seed"] == 7


def test_use_checkpoint_args_takes_the_architecture_and_says_what_it_overrode(base, tmp_path, capsys):
    path = str(base[0])
    flags = dict(load=path, num_layers=3, hidden_size=128, seq_length=64, run_dir=str(tmp_path / "r"),
                 override_opt_param_scheduler=True)  # (the preset's 200 steps)
    with pytest.raises(ValueError, match="saved with num_layers=2, hidden_size=64 but this run has 3, 128; pass "
                                         "--num-layers 2 --hidden-size 64 \\(or --use-checkpoint-args\\)"):
        prepare(TINY.replace(**flags))
    plan = prepare(TINY.replace(use_checkpoint_args=True, **flags))
    assert plan.cfg.model == base[1].model.cfg.model
    out = capsys.readouterr().out
    for name, value, flag in [("num_layers", 2, "--num-layers 3"), ("hidden_size", 64, "--hidden-size 128"),
                              ("seq_length", 32, "--seq-length 64")]:
        assert f"{name} = {value} from the checkpoint, not {flag} (--use-checkpoint-args: the checkpoint's " \
               "arguments win)" in out


def test_resuming_before_the_checkpoints_step_is_refused(base, tmp_path, capsys):
    """--train-iters before the checkpoint's step: one line naming the fix (the run built its mesh, trained nothing
    and exited 0). At the step itself (a finished run requeued) there is nothing to train, as in Megatron-LM, which
    evaluates all the same; a fine-tuned run starts again from step 0, so it may be shorter."""
    from mtx.run import prepare

    for iters, step in ((1, 4), (2, None), (1, 2)):
        with pytest.raises(ValueError, match=f"--train-iters {iters} is before step {step or 4} of --load "
                                             f"{base[0]}; pass a larger --train-iters"):
            prepare(TINY.replace(train_iters=iters, load=str(base[0]), run_dir=str(tmp_path / "r"), ckpt_step=step))
    assert prepare(TINY.replace(train_iters=4, load=str(base[0]), run_dir=str(tmp_path / "r"))).load_step == 4
    capsys.readouterr()
    requeued = run(tmp_path, "requeued", train_iters=4, load=str(base[0]), eval_interval=2, eval_iters=1)
    out = capsys.readouterr().out  # said so (it exited 0 in silence), and evaluated (as Megatron does after its loop)
    assert "steps 4 -> 4 (the checkpoint is at --train-iters already: nothing to train; pass a larger one, with " \
           "--lr-decay-iters where its decay ended there, to go on)" in out
    assert "step 4: validation loss" in out and "step 4: test loss" in out
    assert [set(r) for r in records(requeued.run_dir)] == [{"step", "tokens", f"{key}_loss", f"{key}_ppl", "wall_time"}
                                                           for key in ("val", "test")]
    assert prepare(TINY.replace(train_iters=2, load=str(base[0]), ckpt_step=4, run_dir=str(tmp_path / "r"),
                                finetune=True)).load_step == 4


def test_checkpoint_flags_without_save_say_that_nothing_is_saved(tmp_path, capsys):
    """--save-interval, --async-save and --keep-last-n-checkpoints without --save (as a resumed run may pass them on
    purpose) are taken, with one line saying that no checkpoint is written; with --save nothing is said."""
    prepare(TINY.replace(save_interval=2, async_save=True, run_dir=str(tmp_path / "a")))
    err = capsys.readouterr().err
    assert ("mtx: --save-interval --async-save without --save: this run writes no checkpoint; pass --save DIR to keep "
            "them.") in err
    prepare(TINY.replace(save_interval=2, save=str(tmp_path / "b")))
    assert "--save-interval" not in capsys.readouterr().err


def test_a_resume_keeps_the_lr_schedule_unless_told_which_one(base, resumed, tmp_path, capsys):
    """Megatron's rule: a resumed run's lr schedule is its checkpoint's (a schedule changed by the flags, or by a
    longer --train-iters that moves the decay's end, was taken silently and the lr jumped where the run resumed);
    --use-checkpoint-opt-param-scheduler keeps the checkpoint's, --override-opt-param-scheduler takes this run's."""
    path, lr = str(base[0]), TINY.optimizer.lr
    take = "--override-opt-param-scheduler to take this run's schedule"
    wd, rising = TINY.optimizer.weight_decay, dict(weight_decay_incr_style="linear", start_weight_decay=0.0,
                                                   end_weight_decay=0.1, train_iters=4)  # (the decay's end kept)
    for flags, message, fix, what in (
            (dict(lr=2 * lr), f"--lr {lr} and this run has {2 * lr}", take, "learning rate"),
            (dict(train_iters=8), "4 decay steps \\(--lr-decay-iters, or --train-iters\\) and this run has 8",
             f"--lr-decay-iters 4 to keep its decay's end, {take}", "learning rate"),
            (dict(lr_warmup_iters=1), f"{TINY.optimizer.lr_warmup_iters} warmup steps and this run has 1", take,
             "learning rate"),
            (dict(lr_decay_style="constant"), "--lr-decay-style cosine and this run has constant", take,
             "learning rate"),
            (dict(lr_warmup_init=1e-5), "--lr-warmup-init 0.0 and this run has 1e-05", take,  # (step 2 of 10's warmup)
             "learning rate"),
            (dict(weight_decay=2 * wd, train_iters=4), f"--weight-decay {wd} and this run has {2 * wd}", take,
             "weight decay"),
            (rising, "--weight-decay-incr-style constant and this run has linear", take, "weight decay")):
        with pytest.raises(ValueError, match=f"was trained with {message}, so its {what} would jump where it "
                                             f"resumes; pass {fix}, or --use-checkpoint-opt-param-scheduler to keep"):
            prepare(TINY.replace(load=path, ckpt_step=2, run_dir=str(tmp_path / "r"), **flags))
    kept = run(tmp_path, "kept", train_iters=4, load=path, ckpt_step=2, lr=2 * lr, lr_decay_iters=100,
               use_checkpoint_opt_param_scheduler=True)
    assert (f"mtx: --use-checkpoint-opt-param-scheduler keeps --load's lr and weight-decay schedules: lr {lr} "
            f"(this run's flags: {2 * lr}), lr_decay_iters 4 (this run's flags: 100).") in capsys.readouterr().out
    assert [x["lr"] for x in records(kept.run_dir)] == [x["lr"] for x in records(resumed.run_dir)]
    taken = run(tmp_path, "taken", train_iters=4, load=path, ckpt_step=2, lr=2 * lr,
                override_opt_param_scheduler=True)
    np.testing.assert_allclose([x["lr"] for x in records(taken.run_dir)],
                               [2 * x["lr"] for x in records(resumed.run_dir)], rtol=1e-6)
    assert json.loads((kept.run_dir / "config.json").read_text())["optimizer"]["lr"] == lr  # resumed alike later


def test_a_resume_on_other_data_says_so(base, tmp_path, capsys):
    """A run resumed without its data flags went on with the built-in corpus in silence: other data is allowed (a new
    corpus mid-run), and said in one line."""
    from mtx.data.dataset import builtin_corpus

    (tmp_path / "a.txt").write_text(builtin_corpus()[:20_000])
    capsys.readouterr()
    prepare(TINY.replace(load=str(base[0]), run_dir=str(tmp_path / "r"), train_iters=4,
                         train_data_path=(str(tmp_path / "a.txt"),)))
    assert capsys.readouterr().out == (f"mtx: --load {base[0]} was trained on the built-in corpus; this run goes on "
                                       f"with --train-data-path {tmp_path / 'a.txt'} (pass the checkpoint's data flags "
                                       "to keep its data).\n")
    prepare(TINY.replace(load=str(base[0]), run_dir=str(tmp_path / "r"), train_iters=4))  # its own data: silent
    assert "trained on" not in capsys.readouterr().out
