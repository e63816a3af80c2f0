"""What a run takes from --load: which step, which of its settings, and which parts of its state.

- The step: the newest intact one (or --ckpt-step), found before any device work (`resume_point`); broken later steps
  are set aside (`set_aside`), never deleted.
- Its lr and weight-decay schedules (`check_same_schedule`): a changed one refused, as Megatron does, unless told
  which to take.
- Its settings (`from_checkpoint`): the seed, which is mtx's whole RNG state (data order and dropout masks are
  functions of (seed, step)), unless --no-load-rng or --finetune; with --use-checkpoint-args the model architecture
  too. As in Megatron the checkpoint's values win over flags and presets, and each one that differs is printed.
- Its state (`load_state`): all of it; with --no-load-optim only the weights, around a fresh optimizer state and loss
  scale, at the checkpoint's step and learning rate; with --finetune only the weights, at step 0.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

from mtx.architecture import NOT_SHAPING
from mtx.checkpoint import Checkpointer, config_problem, is_checkpoint_dir, no_checkpoint, say_passed_over
from mtx.config import SCHEDULE_FIELDS, Config, ModelConfig
from mtx.distributed import is_main_process
from mtx.files import CONFIG, is_mtx_config, same_path
from mtx.optim import decay_end, weight_decay_steps
from mtx.schema_checks import SPLIT_PATHS, flag_name

# The model fields --use-checkpoint-args takes (Megatron's list: the architecture and the sequence length). Not the
# vocabulary size, which comes from the tokenizer (a mismatch is refused), nor what shapes no parameter (NOT_SHAPING).
ARCHITECTURE = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("vocab_size", *NOT_SHAPING))


def resume_point(cfg: Config) -> tuple[int | None, tuple[Path, ...], Config | None]:
    """(The step of --load to resume from, None to restart a run that stopped before its first checkpoint finished;
    the broken later steps to set aside when resuming into the same --save directory; the config saved with the
    step, or the restarted run's config.json)."""
    t = cfg.training
    load = Path(t.load)
    if not is_checkpoint_dir(load):
        if is_mtx_config(load / CONFIG):  # an mtx run directory without a finished step
            saved = json.loads((load / CONFIG).read_text())  # readable JSON: is_mtx_config
            if problem := config_problem(saved):
                raise ValueError(f"--load {load}: {problem} (config.json of its unfinished run); start a new run "
                                 "in a new directory, or put back the config.json the run wrote.")
            if saved["training"].get("save") is None:  # --run-dir alone (--save writes config.json into itself)
                raise ValueError(f"--load {load} holds no checkpoint: its run wrote metrics only (it ran without "
                                 "--save); pass a directory written by --save.")
            began = saved["training"].get("load")  # (itself: a restart like this one, killed before saving again)
            if began is not None and not same_path(began, load):  # step 0 would be fresh weights, not those
                raise ValueError(f"--load {load} holds no finished checkpoint, and its run began from --load {began} "
                                 "(a restart from step 0 would drop those weights); start it again from --load "
                                 f"{began} into a new --save directory.")
            if t.finetune:
                raise ValueError(f"--finetune needs the weights of a finished checkpoint, and --load {load} holds "
                                 "none (its run stopped before the first save completed).")
            if is_main_process():
                print(f"mtx: --load {load} holds no finished checkpoint (its run stopped before the first save "
                      "completed); starting it again from step 0.")
            return None, (), Config.from_dict(saved)
        raise no_checkpoint(t.load)
    ckpt = Checkpointer(load)
    try:
        steps = ckpt.steps()
        step, broken = ckpt.intact_step(t.ckpt_step, t.load)
        say_passed_over(t.load, broken, step, "resuming from", file=sys.stdout)
        later = [s for s in steps if s > step]
        if t.save and same_path(t.save, load) and any(s not in broken for s in later):
            raise ValueError(f"resuming {t.load} from step {step} would overwrite its later steps; pass a new "
                             "--save directory.")
        if step > t.train_iters and not t.finetune:  # it would build its mesh, train nothing and say nothing; at
            # the last step itself (a finished run requeued, or sampled) there is nothing to do, as in Megatron-LM
            raise ValueError(f"--train-iters {t.train_iters} is before step {step} of --load {t.load}; pass a larger "
                             "--train-iters to train on from it.")
        set_aside = tuple(load / str(s) for s in later) if t.save and same_path(t.save, load) else ()
        return step, set_aside, ckpt.saved_config(step)
    finally:
        ckpt.close()


def from_checkpoint(cfg: Config, saved: Config) -> Config:
    """`cfg` with what it takes from the checkpoint's saved config: the seed (its RNG state) unless --no-load-rng or
    --finetune, the ARCHITECTURE fields with --use-checkpoint-args. Prints each value that replaces another."""
    t = cfg.training
    taken = {}
    if t.use_checkpoint_args:
        taken.update((name, getattr(saved.model, name)) for name in ARCHITECTURE)
    if t.load_rng and not t.finetune:
        taken["seed"] = saved.training.seed
    current = {**{name: getattr(cfg.model, name) for name in ARCHITECTURE}, "seed": t.seed}
    changed = {name: value for name, value in taken.items() if current[name] != value}
    if changed and is_main_process():
        for name, value in changed.items():
            flag = flag_name(name)
            why = (f"the checkpoint's RNG state; pass --no-load-rng to use {flag} {current[name]}" if name == "seed"
                   else "--use-checkpoint-args: the checkpoint's arguments win")
            print(f"mtx: --load {t.load}: {name} = {value!r} from the checkpoint, not {flag} {current[name]!r} "
                  f"({why}).")
    return cfg.replace(**changed) if changed else cfg


def check_same_batches(saved: Config, cfg: Config) -> None:
    """A resumed run reads the data from where its checkpoint's run stopped and counts its samples and tokens by the
    step, so it keeps that run's --global-batch-size and --seq-length (another would skip or repeat data and
    miscount both); a fine-tuned run starts at step 0 and may change them."""
    for flag, then, now in (("--global-batch-size", saved.training.global_batch_size, cfg.training.global_batch_size),
                            ("--seq-length", saved.model.seq_length, cfg.model.seq_length)):
        if then != now:
            raise ValueError(f"--load {cfg.training.load} was trained with {flag} {then} and this run has {now}, so "
                             f"its data and token count would not continue; pass {flag} {then}, or --finetune to "
                             "start a new run from its weights.")


def opt_param_schedule(cfg: Config, step: int = 0) -> dict:
    """The learning-rate and weight-decay schedules a run follows (mtx/optim.py), as Megatron's scheduler compares
    them on resume: the lr's peak and warmup, unless constant its decay; the weight decay's style and value, or a
    rising one's ends and length. The warmup's first lr only while a resume at `step` is still warming up (Megatron
    keeps none: past the warmup it changes nothing)."""
    o = cfg.optimizer
    kept = dict(lr=o.lr, lr_warmup_iters=o.lr_warmup_iters, lr_decay_style=o.lr_decay_style)
    kept |= dict(lr_warmup_init=o.lr_warmup_init) if step < o.lr_warmup_iters else {}
    if o.lr_decay_style != "constant":
        kept |= dict(min_lr=o.min_lr, lr_decay_iters=decay_end(o, cfg.training.train_iters))
    kept |= dict(weight_decay_incr_style=o.weight_decay_incr_style)
    if o.weight_decay_incr_style == "constant":
        return kept | dict(weight_decay=o.weight_decay)
    return kept | dict(start_weight_decay=o.start_weight_decay, end_weight_decay=o.end_weight_decay,
                       weight_decay_incr_iters=weight_decay_steps(o, cfg.training.train_iters))


def check_same_schedule(saved: Config, cfg: Config, step: int = 0) -> Config:
    """Megatron's rule for a resumed run's learning-rate and weight-decay schedules: the checkpoint's run's, unless
    told otherwise (an lr that jumps at the step the run resumes, taken silently, was once the rule).
    --use-checkpoint-opt-param-scheduler keeps the checkpoint's (returned in `cfg`), --override-opt-param-scheduler
    takes this run's flags."""
    t, then, now = cfg.training, opt_param_schedule(saved, step), opt_param_schedule(cfg, step)
    changed = [name for name in dict.fromkeys((*then, *now)) if then.get(name) != now.get(name)]
    if t.use_checkpoint_opt_param_scheduler:
        if changed and is_main_process():  # (as --use-checkpoint-args says what it overrode)
            print("mtx: --use-checkpoint-opt-param-scheduler keeps --load's lr and weight-decay schedules: "
                  + ", ".join(f"{name} {then.get(name)} (this run's flags: {now.get(name)})" for name in changed)
                  + ".")
        o, steps = saved.optimizer, saved.training.train_iters
        ends = dict(lr_decay_iters=decay_end(o, steps),  # (at the checkpoint's --train-iters, not this run's)
                    weight_decay_incr_iters=None if o.weight_decay_incr_style == "constant" else
                    weight_decay_steps(o, steps))
        return cfg.replace(lr_warmup_fraction=None, lr_warmup_samples=None, lr_decay_samples=None, **ends, **{
            name: saved.value(name) for name in SCHEDULE_FIELDS if name not in ("train_iters", *ends)})
    if not changed or t.override_opt_param_scheduler:
        return cfg
    name = changed[0]
    said = {"lr_warmup_iters": "{} warmup steps",
            "weight_decay_incr_iters": "a weight decay rising over {} steps (--weight-decay-incr-iters, or "
                                       "--train-iters)",
            "lr_decay_iters": "{} decay steps (--lr-decay-iters, or --train-iters)"}.get(name, flag_name(name) + " {}")
    keep = {"lr_decay_iters": "--lr-decay-iters {} to keep its decay's end, ",
            "weight_decay_incr_iters": "--weight-decay-incr-iters {} to keep its rise, "}.get(name, "").format(
                then.get(name))
    what = "learning rate" if name.startswith(("lr", "min_lr")) else "weight decay"
    missing = "no decay" if what == "learning rate" else "none"
    raise ValueError(f"--load {t.load} was trained with {said.format(then.get(name, missing))} and this run has "
                     f"{now.get(name, missing)}, so its {what} would jump where it resumes; pass {keep}"
                     "--override-opt-param-scheduler to take this run's schedule, or "
                     "--use-checkpoint-opt-param-scheduler to keep the checkpoint's (Megatron's flags).")


def say_if_data_changed(saved: Config, cfg: Config) -> None:
    """A line (main process) when a resumed run reads other data than its checkpoint's run did (a run resumed
    without its data flags once went on with the built-in corpus in silence): allowed (a new corpus mid-run), said."""
    def data(c: Config) -> str:
        given = [f"{flag_name(name)} {' '.join(getattr(c.data, name))}" for name in
                 ("data_path", *SPLIT_PATHS.values()) if getattr(c.data, name)]
        return "; ".join(given) or ("--mock-data" if c.data.mock_data else "the built-in corpus")

    if data(saved) != data(cfg) and is_main_process():
        print(f"mtx: --load {cfg.training.load} was trained on {data(saved)}; this run goes on with {data(cfg)} "
              "(pass the checkpoint's data flags to keep its data).")


def say_if_tokenizer_changed(saved: Config, tokenizer, load: str) -> None:
    """A line (main process) when this run's tokenizer is of another kind than the checkpoint's run used: the
    vocabulary sizes agree (check_compatible saw to that), so the weights load, but each id may now mean another
    token (a deliberate switch, GPT-2's files to its tokenizer.json say, keeps them)."""
    from mtx.data.tokenizer import saved_tokenizer

    then = saved_tokenizer(saved.data, saved.model.vocab_size)  # (None: nothing to compare against)
    if then is not None and then.name != tokenizer.name and is_main_process():
        print(f"mtx: --load {load} was trained with the {then.name} tokenizer, this run reads its data with the "
              f"{tokenizer.name} one (of the same vocabulary size): the ids the weights learned may now mean other "
              "tokens.", file=sys.stderr)


def load_state(train_step, ckpt: Checkpointer, cfg: Config, step: int):
    """The training state to start from, read from `step` of `ckpt` as --finetune and --no-load-optim say."""
    t = cfg.training
    abstract = train_step.abstract_state()
    if t.load_optim and not t.finetune:
        return _loss_scale_for(ckpt.restore(abstract, cfg, step=step), ckpt.saved_config(step).training, t)
    from mtx.state import state_with_params

    fresh = state_with_params(train_step.model, ckpt.restore_params(abstract, cfg, step))
    if t.finetune:
        return fresh
    shardings = jax.tree.map(lambda x: x.sharding, fresh)
    return jax.jit(lambda s: _at_step(s, step), out_shardings=shardings, donate_argnums=0)(fresh)


def _loss_scale_for(state, saved, t):
    """The restored state with a loss scale for this run's precision: a run that changes --fp16 on resuming starts
    the scale afresh (1 without fp16, --initial-loss-scale with it; the saved one would scale a loss that is not
    unscaled, or not scale an fp16 one), keeping the count of skipped steps that the lr schedule discounts."""
    if saved.fp16 == t.fp16:
        return state
    from mtx.optim import LossScale

    fresh = LossScale.create(t)._replace(skipped=state.loss_scale.skipped)
    if is_main_process():
        print(f"mtx: the checkpoint was trained {'with' if saved.fp16 else 'without'} --fp16 and this run "
              f"{'is not' if saved.fp16 else 'is'}: the loss scale starts at {float(fresh.scale):g}.")
    return state._replace(loss_scale=jax.tree.map(lambda new, old: jax.device_put(new, old.sharding), fresh,
                                                  state.loss_scale))


def _at_step(state, step: int):
    """A fresh state moved to `step`: its step counter and its learning-rate schedule's count (so the lr continues
    where the checkpoint left it, as the metrics report it); Adam's moments and bias correction start afresh."""
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)
    opt_state = jax.tree.map(lambda x: x._replace(count=jnp.asarray(step, x.count.dtype)) if is_schedule(x) else x,
                             state.opt_state, is_leaf=is_schedule)
    return state._replace(step=jnp.asarray(step, state.step.dtype), opt_state=opt_state)


def set_aside(step_dir: Path) -> None:
    """Renames a broken checkpoint step to <step>.broken (<step>.broken1, ... when an earlier resume took that)."""
    names = (step_dir.with_name(f"{step_dir.name}.broken{k or ''}") for k in itertools.count())
    step_dir.rename(next(name for name in names if not name.exists()))
