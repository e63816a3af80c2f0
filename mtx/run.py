"""The training loop behind train.py: validate, load data, build the mesh, train, evaluate, save, sample.

Every check of the user's input (flags, data files, run and checkpoint directories) happens before the first array
is placed on a device, and nothing existing is ever overwritten: a new run refuses a --save or run directory that
already belongs to another run. In a multi-host run (mtx.distributed) every process makes the same checks on the
shared filesystem and meets the others before anything is written; only process 0 writes run files and prints.
"""

from __future__ import annotations

import itertools
import json
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from mtx.checkpoint import Checkpointer, check_compatible, is_checkpoint_dir
from mtx.config import Config
from mtx.data import build_dataset
from mtx.data.prefetch import prefetch
from mtx.devices import check_accelerator
from mtx.distributed import barrier, is_main_process
from mtx.files import check_run_dir, check_writable, is_mtx_config
from mtx.metrics import MetricsLogger, throughput
from mtx.parallel.mesh import check_tensor_parallel_fits, make_mesh
from mtx.sharded_model import ShardedModel
from mtx.step import TrainStep


SAMPLE_PROMPT = "The "


@dataclass
class RunResult:
    state: object
    model: ShardedModel
    run_dir: Path
    losses: dict[int, float] = field(default_factory=dict)  # step -> training loss, at every step
    sample: str | None = None
    stopped: str | None = None  # why the run stopped before --train-iters (a signal, --exit-interval, ...)


@dataclass
class Plan:
    """A run that passed every input check: the resolved config, its data and its directory."""

    cfg: Config
    dataset: object
    run_dir: Path
    load_step: int | None = None  # the step of --load to resume from (None: a fresh start)
    set_aside: tuple[Path, ...] = ()  # broken steps of --load after load_step, renamed <step>.broken before saving


def prepare(cfg: Config) -> Plan:
    """Everything that can fail on bad input, with no device work: config, data, directories, checkpoint."""
    num_devices = len(jax.devices())
    if (warning := check_accelerator()) and is_main_process():
        print(warning, file=sys.stderr)
    cfg.validate(num_devices)
    check_tensor_parallel_fits(cfg.parallel.tensor_model_parallel_size, jax.local_device_count(), jax.process_count())
    dataset = build_dataset(cfg)
    cfg = cfg.replace(vocab_size=dataset.tokenizer.vocab_size).validate(num_devices)
    t = cfg.training
    resuming = bool(t.load)
    load_step, set_aside = _resume_point(cfg) if t.load else (None, ())
    run_dir = Path(t.save or t.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    check_run_dir(run_dir, "--save" if t.save else "--run-dir")  # never over a file mtx did not write
    if t.tensorboard_dir:
        check_writable(t.tensorboard_dir, "--tensorboard-dir")
    if t.save and is_checkpoint_dir(t.save) and not (t.load and Path(t.load) == Path(t.save)):
        raise ValueError(f"--save {t.save} already holds checkpoints of another run; pass --load {t.save} to "
                         "resume it, or choose a new --save directory.")
    if (run_dir / "metrics.jsonl").exists() and not resuming:
        raise ValueError(f"run directory {run_dir} already holds metrics.jsonl of another run; choose a new "
                         f"--run-dir (or --save), or pass --load {run_dir} to resume it (or restart it, if it "
                         "stopped before its first checkpoint).")
    return Plan(cfg, dataset, run_dir, load_step, set_aside)


def _resume_point(cfg: Config) -> tuple[int | None, tuple[Path, ...]]:
    """(The step of --load to resume from, None to restart a run that stopped before its first checkpoint
    finished; the broken later steps to set aside when resuming into the same --save directory)."""
    t = cfg.training
    load = Path(t.load)
    if not is_checkpoint_dir(load):
        if is_mtx_config(load / "config.json"):  # an mtx run directory without a finished step
            if is_main_process():
                print(f"mtx: --load {load} holds no finished checkpoint (its run stopped before the first save "
                      "completed); starting it again from step 0.")
            return None, ()
        raise ValueError(f"--load {t.load} holds no checkpoint; pass a directory written by --save.")
    ckpt = Checkpointer(load)
    try:
        steps = ckpt.steps()
        if t.ckpt_step is not None and t.ckpt_step not in steps:
            raise ValueError(f"--load {t.load} has no step {t.ckpt_step} (it has {steps}); pass one of those "
                             "to --ckpt-step.")
        broken = {}
        for step in ([t.ckpt_step] if t.ckpt_step is not None else reversed(steps)):
            if (problem := ckpt.problem(step)) is None:
                break
            broken[step] = problem
        else:
            intact = [s for s in steps if s not in broken and ckpt.problem(s) is None]
            step, problem = next(iter(broken.items()))
            raise ValueError(f"--load {t.load}: step {step} is broken ({problem}); "
                             + (f"pass --ckpt-step {intact[-1]}, the newest intact step." if intact else
                                "no step is intact: start a new run."))
        if broken and is_main_process():
            print("\n".join(f"mtx: --load {t.load}: step {s} is broken ({p}); resuming from step {step}, the newest "
                            "intact one." for s, p in broken.items()))
        check_compatible(ckpt.saved_config(step).model, cfg.model, t.load)
        later = [s for s in steps if s > step]
        if t.save and Path(t.save) == load and any(s not in broken for s in later):
            raise ValueError(f"resuming {t.load} from step {step} would overwrite its later steps; pass a new "
                             "--save directory.")
        set_aside = tuple(load / str(s) for s in later) if t.save and Path(t.save) == load else ()
        return step, set_aside
    finally:
        ckpt.close()


def train(cfg: Config | Plan, *, progress: bool = True, mesh=None) -> RunResult:
    """Trains as `cfg` says; a Config is first checked by `prepare`."""
    plan = cfg if isinstance(cfg, Plan) else prepare(cfg)
    cfg, dataset, run_dir = plan.cfg, plan.dataset, plan.run_dir
    t, p = cfg.training, cfg.parallel
    mesh = mesh or make_mesh(p.data_parallel_size, p.pipeline_model_parallel_size, p.tensor_model_parallel_size)
    model = ShardedModel(cfg, mesh)
    train_step = TrainStep(model)
    main = is_main_process()
    barrier("mtx: every process checked its input")  # so no process sees files another one just wrote
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        for step_dir in plan.set_aside:  # kept, not deleted: the new steps of this run take their numbers
            _set_aside(step_dir)
    barrier("mtx: broken steps set aside")

    saver = Checkpointer(t.save) if t.save else None
    if plan.load_step is not None:
        loader = saver if saver and Path(t.load) == Path(t.save) else Checkpointer(t.load)
        state = loader.restore(train_step.abstract_state(), cfg, step=plan.load_step)
        if loader is not saver:
            loader.close()
    else:
        state = train_step.init_state()
    start = int(jax.device_get(state.step))
    if main:
        _print_banner(cfg, mesh, model, start)

    logger = MetricsLogger(run_dir, t.tensorboard_dir, enabled=main, resumed_at=start if t.load else None)
    result = RunResult(state, model, run_dir)
    tokens_per_step = t.global_batch_size * cfg.model.seq_length
    flops_per_token = cfg.model.flops_per_token()
    bar = _progress_bar(start, t.train_iters, progress and main)
    pending, interval_start, interval_steps = [], time.perf_counter(), 0
    batches = prefetch(lambda step: model.put_batch(dataset.batch("train", step, t.global_batch_size)),
                       range(start, t.train_iters), depth=cfg.data.prefetch_depth)
    with _StopRequests(t) as stops:  # until the last checkpoint is written
        for step, batch in zip(range(start, t.train_iters), batches):
            state, metrics = train_step(state, batch)
            pending.append((step + 1, metrics))
            if step == start:  # the first step compiles: time the interval from its end
                jax.block_until_ready(metrics)
                interval_start = time.perf_counter()
            else:
                interval_steps += 1
            final = step + 1 == t.train_iters
            result.stopped = None if final else stops.reason(step + 1)
            last = final or result.stopped is not None
            if (step + 1) % t.log_interval == 0 or last:
                fetched = jax.device_get(pending)  # the only host sync of the interval
                elapsed = time.perf_counter() - interval_start
                result.losses.update((s, float(m["loss"])) for s, m in fetched)
                s, m = fetched[-1]
                timing = (throughput(tokens_per_step * interval_steps, elapsed, flops_per_token, mesh.size)
                          if interval_steps else {"tokens_per_s": None, "tflops_per_device": None, "mfu": None})
                record = {"step": s, "loss": float(m["loss"]), "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]),
                          "loss_scale": float(m["loss_scale"]),
                          "skipped_steps": sum(bool(x["skipped"]) for _, x in fetched),
                          "step_time_s": elapsed / interval_steps if interval_steps else None, **timing}
                logger.log(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s'] or 0:.0f}",
                                mfu="n/a" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%")
                bar.update(len(fetched))
                pending, interval_steps = [], 0
            if t.eval_interval and ((step + 1) % t.eval_interval == 0 or final) and dataset.num_samples("valid"):
                val = evaluate(model, state.params, dataset, t.eval_iters, t.micro_batch_size * mesh.shape["data"])
                if cfg.model.is_bert:  # MLM + SOP loss: no perplexity of one distribution
                    logger.log({"step": step + 1, "val_loss": val})
                    if main:
                        bar.write(f"step {step + 1}: validation loss (MLM + SOP) {val:.4f}")
                else:
                    ppl = math.exp(min(val, 50.0))
                    logger.log({"step": step + 1, "val_loss": val, "val_ppl": ppl})
                    if main:
                        bar.write(f"step {step + 1}: validation loss {val:.4f}, perplexity {ppl:.2f}")
            if saver and t.save_interval and (step + 1) % t.save_interval == 0:
                saver.save(state, cfg)
            if not pending:  # a new timing interval starts after this step's logging, evaluation and saving
                interval_start = time.perf_counter()
            if result.stopped:
                break
        batches.close()  # (an error in the loop closes it when the generator is collected)
        bar.close()
        if saver:
            if saver.latest_step() != int(jax.device_get(state.step)):
                saver.save(state, cfg)
            saver.wait()
            saver.close()
    logger.close()
    result.state = state
    if result.stopped:
        if main:
            where = (f"checkpoint saved in {t.save}: resume with --load {t.save}" if saver else
                     "no --save, so nothing was saved")
            print(f"\nmtx: stopped after step {int(jax.device_get(state.step))} ({result.stopped}); {where}.")
    elif t.generate_tokens and not cfg.model.is_bert:  # BERT is no left-to-right generator
        result.sample = sample_text(model, state.params, dataset, t.generate_tokens, t.seed)
        if main:
            print(f"\n--- sample ({t.generate_tokens} tokens) ---\n{result.sample}\n---")
    return result


def _set_aside(step_dir: Path) -> None:
    """Renames a broken checkpoint step to <step>.broken (<step>.broken1, ... when an earlier resume took that)."""
    names = (step_dir.with_name(f"{step_dir.name}.broken{k or ''}") for k in itertools.count())
    step_dir.rename(next(name for name in names if not name.exists()))


class _StopRequests:
    """Why training should stop before --train-iters, checked after each step: SIGTERM or SIGINT (with
    --exit-signal-handler, the default: the step finishes, a checkpoint is saved, the process exits 0; a second
    SIGINT interrupts at once), --exit-interval, --exit-duration-in-mins. With several processes all must stop at the
    same step: signals and the clock are agreed on at logging steps (a host sync there anyway), the interval is the
    same everywhere."""

    def __init__(self, t):
        self.t, self.start, self.signal, self.previous = t, time.monotonic(), None, {}

    def __enter__(self) -> "_StopRequests":
        if self.t.exit_signal_handler and threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # (None: set outside Python)
        self.previous = {}

    def _on_signal(self, signum, frame) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name

    def reason(self, step: int) -> str | None:
        t = self.t
        if t.exit_interval and step % t.exit_interval == 0:
            return f"--exit-interval {t.exit_interval}"
        minutes = (time.monotonic() - self.start) / 60
        local = (f"{self.signal} received" if self.signal else f"--exit-duration-in-mins {t.exit_duration_in_mins}"
                 if t.exit_duration_in_mins and minutes >= t.exit_duration_in_mins else None)
        if jax.process_count() == 1:
            return local
        if step % t.log_interval:
            return None
        from jax.experimental import multihost_utils

        anyone = bool(np.any(multihost_utils.process_allgather(np.int32(local is not None))))
        return local or ("another process was asked to stop" if anyone else None)


def evaluate(model: ShardedModel, params, dataset, iters: int, batch_size: int) -> float:
    """Mean validation loss over `iters` batches (the same batches at every evaluation)."""
    losses = [model.eval_loss(params, model.put_batch(dataset.batch("valid", i, batch_size)))
              for i in range(iters)]
    return float(np.mean(jax.device_get(losses)))


def sample_text(model: ShardedModel, params, dataset, num_tokens: int, seed: int) -> str:
    """SAMPLE_PROMPT continued by `num_tokens` ids (KV-cached, temperature 0.8, top-k 40), decoded to text."""
    from mtx.generate import generate

    prompt = dataset.tokenizer.encode(SAMPLE_PROMPT)
    ids = generate(model, params, [prompt], num_tokens, temperature=0.8, top_k=40, seed=seed)[0]
    return dataset.tokenizer.decode(ids)


def _print_banner(cfg: Config, mesh, model: ShardedModel, start: int) -> None:
    m, t = cfg.model, cfg.training
    family = f"BERT ({m.layernorm_placement}-LN)" if m.is_bert else "GPT"
    print(f"mtx: {family} {m.num_layers} layers x {m.hidden_size} wide, {m.num_attention_heads} heads, "
          f"{cfg.model.num_params() / 1e6:.2f}M parameters (vocab {m.vocab_size} padded to {m.padded_vocab_size})")
    print(f"mtx: mesh data={mesh.shape['data']} pipeline={mesh.shape['pipeline']} model={mesh.shape['model']} on "
          f"{mesh.size} {jax.devices()[0].platform} device(s); {model.num_microbatches} microbatch(es) of "
          f"{t.micro_batch_size} per step; {t.compute_dtype}; steps {start} -> {t.train_iters}")
    if model.pipeline is not None:
        sch = model.pipeline
        chunks = f" x {sch.virtual} virtual stages" if sch.virtual > 1 else ""
        print(f"mtx: pipeline schedule {sch.kind}: {sch.stages} stages{chunks}, layers {list(sch.counts)}, "
              f"{sch.microbatches} microbatches, {sch.ticks} ticks; ideal bubble (p-1)/(v m+p-1) = {sch.bubble:.1%}")


def _progress_bar(start: int, total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, disable=not enabled, unit="step", dynamic_ncols=True)
