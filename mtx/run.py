"""The training loop behind train.py: validate, load data, build the mesh, train, evaluate, save, sample.

Every check of the user's input (flags, data, run and checkpoint directories) comes before any device work, and
nothing existing is overwritten (a new run refuses another run's --save or run directory). Multi-host (mtx.distributed):
every process checks and meets the others before anything is written; only process 0 writes run files and prints.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from mtx.checkpoint import Checkpointer, check_compatible, is_checkpoint_dir
from mtx.config import Config
from mtx.data import build_dataset, say_what_data_overrides
from mtx.data.prefetch import BatchTimes, prefetch
from mtx.data.workers import BatchWorkers
from mtx.devices import check_accelerator, devices, use_compilation_cache, use_memory_fraction
from mtx.distributed import barrier, is_main_process
from mtx.evaluation import perplexity
from mtx.files import CONFIG, METRICS, check_outside, check_run_dir, check_writable, forget_new_run_dir, same_path
from mtx.loop_controls import ManualGC, Profiler, Startup, StopRequests
from mtx.metrics import MetricsLogger, Progress, check_trackers, device_memory, interval_record
from mtx.parallel.mesh import DATA, MODEL, PIPELINE, check_tensor_parallel_fits, make_mesh
from mtx.resume import (check_same_batches, check_same_schedule, from_checkpoint, load_state, resume_point,
                        say_if_data_changed, say_if_tokenizer_changed, set_aside)
from mtx.run_lock import RunLock, check_free
from mtx.schema_checks import flag_name
from mtx.sharded_model import ShardedModel
from mtx.step import TrainStep


SAMPLE_PROMPT = "The "
# Steps and evaluation batches dispatched ahead of the CPU's devices at most: waiting only once per log interval,
# XLA's CPU collectives aborted with 100 or more steps queued (a rendezvous timeout, rc 134; 32: none). GPUs queue
# as before (a wait per log interval).
MAX_IN_FLIGHT = 32


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
    use_memory_fraction(cfg.training.gpu_memory_fraction)  # before JAX starts its backends (it reads it once)
    num_devices = len(devices())
    for warning in (check_accelerator(), _unsaved_checkpoints(cfg.training)):
        if warning and is_main_process():
            print(warning, file=sys.stderr)
    cfg.validate(num_devices)
    check_tensor_parallel_fits(cfg.parallel.tensor_model_parallel_size, jax.local_device_count(), jax.process_count())
    t = cfg.training
    check_trackers(cfg.logging)
    load_step, broken_later, saved = resume_point(cfg) if t.load else (None, (), None)
    if saved is not None:  # its seed (RNG state) and, with --use-checkpoint-args, its architecture, before the data
        cfg = from_checkpoint(cfg, saved).validate(num_devices)
    try:
        dataset = build_dataset(cfg)
    except OSError as e:  # a data or tokenizer file that exists but cannot be read (permissions, a device, ...)
        raise ValueError(f"{e.filename or '--data-path'} cannot be read ({e.strerror or e}); pass a readable "
                         "file.") from None
    configured = cfg
    cfg = cfg.replace(vocab_size=dataset.tokenizer.vocab_size).validate(num_devices)
    if load_step is not None:
        # A resume goes on with its run's batches and lr schedule, once the model is known to be the same (compared
        # at the kept sequence length, which check_same_batches says). A step 0 (a converted checkpoint, say) has
        # read no data and followed no schedule: its run's batch, sequence length and schedule need not continue.
        continues = t.resumes and load_step > 0
        kept = dataclasses.replace(cfg.model, seq_length=saved.model.seq_length) if continues else cfg.model
        check_compatible(saved, kept, t.load)
        say_if_tokenizer_changed(saved, dataset.tokenizer, t.load)
        if continues:
            check_same_batches(saved, cfg)
            cfg = check_same_schedule(saved, cfg, load_step)
            say_if_data_changed(saved, cfg)
        if t.profile and t.resumes and t.profile_step_start < load_step:  # a requeued command line, say
            traced = t.profile_step_end > load_step
            if is_main_process():
                print(f"mtx: --profile's steps {t.profile_step_start + 1}..{t.profile_step_end} begin before step "
                      f"{load_step}, where this run resumes: " + (f"tracing steps {load_step + 1}.."
                      f"{t.profile_step_end}." if traced else "no trace."))
            cfg = cfg.replace(**(dict(profile_step_start=load_step) if traced else dict(profile=False)))
    run_dir = Path(t.save or t.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    run_flag = _run_flag(t)
    check_run_dir(run_dir, run_flag)  # never over a file mtx did not write
    # nor beside a run still writing there
    check_free(run_dir, run_flag, by_pid=_single_process(), quiet=not is_main_process())
    trackers = (("--tensorboard-dir", cfg.logging.tensorboard_dir), ("--wandb-save-dir", cfg.logging.wandb_save_dir))
    for flag, path in trackers:
        if path:  # W&B writes a folder wandb/ into its directory: the run directory, or that folder, is the run's
            own = flag == "--wandb-save-dir" and (same_path(path, run_dir) or same_path(path, run_dir / "wandb"))
            check_writable(run_dir if own else path, flag, a_run_dir=True)
            if not own and flag != "--tensorboard-dir":
                check_outside(path, run_dir, flag)  # (also of a run directory this run will make)
    if t.compilation_cache_dir:
        check_outside(t.compilation_cache_dir, run_dir, "--compilation-cache-dir")
    if jax.default_backend() != "cpu":  # before the first compilation; CPU runs compile quickly and leave it off
        use_compilation_cache(t.compilation_cache_dir)
    if t.save and is_checkpoint_dir(t.save) and not (t.resumes and same_path(t.load, t.save)):
        raise ValueError(f"--save {t.save} already holds checkpoints of another run; pass --load {t.save} to "
                         "resume it, or choose a new --save directory.")
    # A run appends to (and on resuming, trims) only its own metrics: those of the directory it resumes from
    if (run_dir / METRICS).exists() and not (t.resumes and same_path(run_dir, t.load)):
        raise ValueError(f"run directory {run_dir} already holds metrics.jsonl of another run; choose a new "
                         f"--run-dir (or --save), or pass --load {run_dir} to resume it (or restart it, if it "
                         "stopped before its first checkpoint).")
    say_what_data_overrides(configured, dataset)  # after every refusal: a refused run prints its one line only
    return Plan(cfg, dataset, run_dir, load_step, broken_later)


def train(cfg: Config | Plan, *, progress: bool = True, mesh=None) -> RunResult:
    """Trains as `cfg` says; a Config is first checked by `prepare`."""
    entered = time.perf_counter()
    plan = cfg if isinstance(cfg, Plan) else prepare(cfg)
    cfg, dataset, run_dir = plan.cfg, plan.dataset, plan.run_dir
    t, p, log = cfg.training, cfg.parallel, cfg.logging
    mesh = mesh or make_mesh(p.data_parallel_size, p.pipeline_model_parallel_size, p.tensor_model_parallel_size)
    model = ShardedModel(cfg, mesh)
    train_step = TrainStep(model)
    main = is_main_process()
    barrier("mtx: every process checked its input")  # so no process sees files another one just wrote
    created, lock = False, None
    if main:  # the directory made here (not found) is this run's own: taken back if nothing trains in it
        created = _made(run_dir)
        # (refused, InUse: another run that passed its checks beside this one's holds it)
        lock = RunLock(run_dir, _run_flag(t), by_pid=_single_process()).acquire()
    trained = False  # whether a step has finished
    try:
        if main:
            (run_dir / CONFIG).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
            for step_dir in plan.set_aside:  # kept, not deleted: the new steps of this run take their numbers
                set_aside(step_dir)
        barrier("mtx: broken steps set aside")

        # The trackers start before the device work, so a W&B run that will not start costs no compile.
        tokens_per_step = t.global_batch_size * cfg.model.seq_length
        wandb = dict(project=log.wandb_project, name=log.wandb_exp_name or run_dir.absolute().name,
                     dir=str(log.wandb_save_dir or run_dir), config=cfg.to_dict()) if log.wandb_project else None
        logger = MetricsLogger(run_dir, log.tensorboard_dir, enabled=main, tokens_per_step=tokens_per_step,
                               wandb=wandb, resumed_at=(plan.load_step or 0) if t.resumes else None,
                               tracker_interval=log.tensorboard_log_interval)
        saver = workers = batches = None  # closed in the finally below, whatever fails after this point
        try:
            saver = Checkpointer(t.save, async_save=t.async_save, keep_last=t.keep_last_n_checkpoints,
                                 keep_every=t.keep_checkpoint_every) if t.save else None
            if plan.load_step is not None:
                loader = saver if saver and same_path(t.load, t.save) else Checkpointer(t.load)
                state = load_state(train_step, loader, cfg, plan.load_step)  # as --finetune and --no-load-optim say
                if loader is not saver:
                    loader.close()
            else:
                state = train_step.init_state()
            start = int(jax.device_get(jax.block_until_ready(state).step))
            startup = Startup(entered, state_ready=time.perf_counter())
            if main:
                _print_banner(cfg, mesh, model, start)

            result = RunResult(state, model, run_dir)
            flops_per_token = cfg.model.flops_per_token(cfg.mlm_positions)
            console = Progress(start, t.train_iters, t.global_batch_size, enabled=progress and main,
                               loss_name="lm + sop loss" if cfg.model.is_bert else "lm loss")
            pending, interval_start, interval_steps = [], time.perf_counter(), 0
            cpu = jax.default_backend() == "cpu"
            # Batches from worker processes (each with its own copy of the dataset) or this process's prefetch thread.
            workers = BatchWorkers(cfg, cfg.data.num_workers) if cfg.data.num_workers else None
            source = workers or dataset
            batch_times = BatchTimes()
            rows = model.host_rows(t.global_batch_size)  # each process builds only the rows its devices hold
            batches = prefetch(lambda step: model.put_batch(source.batch("train", step, t.global_batch_size,
                                                                         rows.slice), rows),
                               range(start, t.train_iters), depth=cfg.data.prefetch_depth, times=batch_times)
            profiler = Profiler(t, log.tensorboard_dir or run_dir / "profile", enabled=main)

            def report(step: int, splits) -> None:
                """Each of `splits` that holds samples evaluated with the state of `step`: logged and printed."""
                for split in [s for s in splits if dataset.num_samples(s)]:
                    if cpu and pending:  # the evaluation's batches queue behind the steps still running
                        jax.block_until_ready(pending[-1][1])
                    collector.before_evaluation()
                    loss = evaluate(model, state.params, dataset, t.eval_iters, split)
                    collector.after_evaluation()
                    key, name = _EVALUATED[split]
                    if cfg.model.is_bert:  # MLM + SOP loss: no perplexity of one distribution
                        logger.log({"step": step, f"{key}_loss": loss})
                        message = f"step {step}: {name} loss (MLM + SOP) {loss:.4f}"
                    else:
                        ppl = perplexity(loss)
                        logger.log({"step": step, f"{key}_loss": loss, f"{key}_ppl": ppl})
                        message = f"step {step}: {name} loss {loss:.4f}, perplexity {ppl:.2f}"
                    if main:
                        console.write(message)

            # until the last checkpoint is written; the trace stopped
            with StopRequests(t, log.log_interval) as stops, profiler, ManualGC(t) as collector:
                for step, batch in zip(range(start, t.train_iters), batches):
                    profiler.before(step)
                    state, metrics = train_step(state, batch)
                    profiler.after(step, metrics)
                    collector.after_step(step + 1)
                    pending.append((step + 1, metrics))
                    if cpu and len(pending) >= MAX_IN_FLIGHT:  # a long log interval: bound the steps queued
                        jax.block_until_ready(pending[-MAX_IN_FLIGHT][1])
                    if step == start:  # the first step compiles: time the interval from its end
                        jax.block_until_ready(metrics)
                        trained, interval_start, _ = True, time.perf_counter(), batch_times.take()
                        if main:
                            console.write(startup.first_step_done(interval_start))
                    else:
                        interval_steps += 1
                    final = step + 1 == t.train_iters
                    result.stopped = None if final else stops.reason(step + 1)
                    if (step + 1) % log.log_interval == 0 or final or result.stopped is not None:
                        fetched = jax.device_get(pending)  # the interval's host sync (and on the CPU the waits above)
                        elapsed = time.perf_counter() - interval_start
                        result.losses.update((s, float(m["loss"])) for s, m in fetched)
                        record = interval_record(fetched, elapsed, interval_steps, tokens_per_step, flops_per_token,
                                                 mesh.size, batch_times.take()) | startup.take()
                        record |= device_memory() if log.log_memory_to_tensorboard else {}
                        console.update(logger.log(record, fetched), len(fetched))
                        pending, interval_steps = [], 0
                    evaluating = t.eval_interval and ((step + 1) % t.eval_interval == 0 or final)
                    # validation every --eval-interval steps and at the end; the test split once training ends
                    report(step + 1, ("valid",) * bool(evaluating) + ("test",) * bool(evaluating and final))
                    if saver and t.save_interval and (step + 1) % t.save_interval == 0:
                        saver.save(state, cfg)
                    if not pending:  # a new timing interval starts after this step's logging, evaluation and saving
                        interval_start, _ = time.perf_counter(), batch_times.take()
                    if result.stopped:
                        break
                if start == t.train_iters and t.eval_interval:  # resumed at its end: evaluated all the same (Megatron)
                    report(start, ("valid", "test"))
                profiler.stop()  # a run that stopped inside the traced steps: not its final save
                batches.close()  # (an error in the loop closes it when the generator is collected)
                console.close()
                if saver and saver.latest_step() != int(jax.device_get(state.step)):
                    saver.save(state, cfg)
                if saver:  # the last save (an async one too) is on disk and recorded before the run ends or stops
                    saver.wait()
                    saver.close()
        except BaseException as e:
            # A save in flight is finished, not cut off; but not after a runtime error with several processes: perhaps
            # one is gone, and finishing the save would wait for it at orbax's barrier.
            if saver and not (isinstance(e, jax.errors.JaxRuntimeError) and jax.process_count() > 1):
                saver.close()
            raise
        finally:
            if batches is not None:
                batches.close()  # its thread stopped: it asks the workers nothing more
            if workers:
                workers.close()
            logger.close()
    except BaseException:  # (W&B would not start, out of memory in the first step, ...): a retry may take it as new
        if created and not trained:
            forget_new_run_dir(run_dir)
        raise
    finally:
        if lock:
            lock.release()
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


def _run_flag(t) -> str:
    """The flag that names the run directory, for messages about it."""
    return "--save" if t.save else "--run-dir"


def _single_process() -> bool:
    """Whether this is the run's only process: its lock's holder may then be asked of by pid (mtx/run_lock.py)."""
    return jax.process_count() == 1


def _made(run_dir: Path) -> bool:
    """Makes the run directory; whether this call made it (False: it was there, or another run made it first)."""
    try:
        run_dir.mkdir(parents=True)
    except FileExistsError:
        return False
    return True


def _unsaved_checkpoints(t) -> str | None:
    """A notice when flags ask for checkpoints that no --save will hold (a resumed run may pass them on purpose)."""
    flags = [flag_name(name) for name in ("save_interval", "async_save", "keep_last_n_checkpoints",
                                          "keep_checkpoint_every") if getattr(t, name)]
    if flags and not t.save:
        return f"mtx: {' '.join(flags)} without --save: this run writes no checkpoint; pass --save DIR to keep them."
    return None


# a split evaluated in training -> (its metrics' prefix, its name in the log)
_EVALUATED = {"valid": ("val", "validation"), "test": ("test", "test")}


def evaluate(model: ShardedModel, params, dataset, iters: int, split: str = "valid") -> float:
    """Mean loss of a split (validation, or test) over `iters` batches of --global-batch-size samples (the same
    samples at every evaluation and on every mesh), as Megatron evaluates: each batch scored in parts of a micro
    batch a data rank (the step's memory), each part normalized by the whole batch's counts, so the parts sum to the
    batch's loss. Each process builds only the rows its devices hold, as in training."""
    t, cpu = model.cfg.training, jax.default_backend() == "cpu"
    rows = t.micro_batch_size * model.mesh.shape[DATA]
    per_batch, held = t.global_batch_size // rows, model.host_rows(rows)
    losses, queued = [], 0
    for i in range(iters):  # part p of batch i: the split's batch i x per_batch + p of `rows` samples
        parts = [model.put_batch(dataset.batch(split, i * per_batch + p, rows, held.slice), held)
                 for p in range(per_batch)]
        counts = jax.tree.map(lambda *part_counts: sum(part_counts), *map(model.eval_counts, parts))
        loss = 0.0
        for part in parts:
            loss, queued = loss + model.eval_loss(params, part, counts), queued + 1
            if cpu and queued % MAX_IN_FLIGHT == 0:  # the CPU's bound on queued work
                jax.block_until_ready(loss)
        losses.append(loss)
    return float(np.mean(jax.device_get(losses)))


def sample_text(model: ShardedModel, params, dataset, num_tokens: int, seed: int) -> str:
    """SAMPLE_PROMPT continued by `num_tokens` ids (KV-cached, temperature 0.8, top-k 40), decoded to text; a
    tokenizer without words (NullTokenizer) starts from its end-of-document id, a new document."""
    from mtx.data.tokenizer import NullTokenizer
    from mtx.generate import generate

    tokenizer = dataset.tokenizer
    prompt = [tokenizer.eod] if isinstance(tokenizer, NullTokenizer) else tokenizer.encode(SAMPLE_PROMPT)
    ids = generate(model, params, [prompt], num_tokens, temperature=0.8, top_k=40, seed=seed)[0]
    return tokenizer.decode(ids)


def _print_banner(cfg: Config, mesh, model: ShardedModel, start: int) -> None:
    m, t = cfg.model, cfg.training
    family = f"BERT ({m.layernorm_placement}-LN)" if m.is_bert else "GPT"
    groups = f" ({m.query_groups} key/value groups)" if m.group_query_attention else ""
    print(f"mtx: {family} {m.num_layers} layers x {m.hidden_size} wide, {m.num_attention_heads} heads{groups}, "
          f"{cfg.model.num_params() / 1e6:.2f}M parameters (vocab {m.vocab_size} padded to {m.padded_vocab_size})")
    if m.llama_blocks():
        print(f"mtx: Llama's blocks: {' '.join(m.llama_blocks())}")
    print(f"mtx: mesh data={mesh.shape[DATA]} pipeline={mesh.shape[PIPELINE]} model={mesh.shape[MODEL]} on "
          f"{mesh.size} {jax.devices()[0].platform} device(s); {model.num_microbatches} microbatch(es) of "
          f"{t.micro_batch_size} per step; {t.compute_dtype}; steps {start} -> {t.train_iters}" +
          (" (the checkpoint is at --train-iters already: nothing to train; pass a larger one, with --lr-decay-iters "
           "where its decay ended there, to go on)"
           if start and start == t.train_iters else ""))
    if cfg.tp_comm_overlap:
        from mtx.kernels.collective_matmul import machine_condition

        reason = machine_condition(mesh.shape[MODEL])
        print("mtx: --tp-comm-overlap: " + ("peer-memory kernels in the linears whose shapes divide their tiles"
                                            if reason is None else f"XLA's collectives (no kernels: {reason})"))
    if model.pipeline is not None:
        sch = model.pipeline
        chunks = f" x {sch.virtual} virtual stages" if sch.virtual > 1 else ""
        print(f"mtx: pipeline schedule {sch.kind}: {sch.stages} stages{chunks}, layers {list(sch.counts)}, "
              f"{sch.microbatches} microbatches, {sch.ticks} ticks; ideal bubble {sch.bubble:.1%}")
