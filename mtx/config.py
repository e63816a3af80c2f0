"""The one typed configuration schema: model, parallelism, optimizer, training, logging and data.

The defaults are the embedded default run (`python train.py`): a small GPT (4 layers, width 128) on the built-in
corpus with TP = 2 and the remaining devices data-parallel. Presets in configs/ set only what differs. Field names
are Megatron-LM's argument names (`--hidden-size` is `hidden_size`), unique across sections, so flags and preset keys
map to fields without a table (presets are read by mtx/presets.py); each field carries its flag's help (`_f`, shown
by mtx/cli.py's `--help`). The model section, `ModelConfig`, and its arithmetic live in mtx/architecture.py, the
logging section, `LoggingConfig`, in mtx/logging_config.py.
`Config.validate()` refuses bad values and combinations before any device work: mtx/schema_checks.py, config_checks.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from mtx.architecture import ModelConfig
from mtx.logging_config import LoggingConfig
from mtx.config_checks import check_combinations, yield_layer_calls
from mtx.files import expand_home, unexpanded_home
from mtx.schema_checks import check_field, described as _f, flag_name, is_path_list


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = _f(2, 'TP: devices one layer is split over (the "model" axis)')
    sequence_parallel: bool = _f(False, "split the residual stream (LayerNorm, dropout, residual adds) over TP by rows")
    tp_comm_overlap: bool = _f(
        False, "with --sequence-parallel: its all-gathers and reduce-scatters inside the linear layers' matmuls, "
        "through peer memory (Mosaic GPU kernels on Hopper GPUs; XLA's collectives elsewhere)")
    pipeline_model_parallel_size: int = _f(1, 'PP: stages the layer stack is split into (the "pipeline" axis)')
    data_parallel_size: int = _f(-1, "DP: -1 means all remaining devices, devices / (TP x PP), as in Megatron")
    num_layers_in_first_pipeline_stage: int | None = _f(None, "uneven stages: layers of the first stage")
    num_layers_in_last_pipeline_stage: int | None = _f(None, "uneven stages: layers of the last stage")
    pipeline_model_parallel_layout: str | None = _f(
        None, 'Megatron layout string, e.g. "Et|tt|tt|tL"; with more stages than --pipeline-model-parallel-size, '
        "each device holds several (virtual stages)")
    pipeline_schedule: str = _f("1f1b", "gpipe | 1f1b (Megatron's default) | interleaved (1F1B over virtual stages, "
                                "implied by virtual stages)")
    virtual_pipeline_model_parallel_size: int | None = _f(
        None, "virtual stages (layer chunks) each pipeline device holds, interleaved; None: 1, or from the layout")
    num_layers_per_virtual_pipeline_stage: int | None = _f(
        None, "layers of each virtual stage (sets the virtual size to layers / (stages x this))")
    use_distributed_optimizer: bool = _f(
        False, 'ZeRO-1: fp32 master weights and Adam moments split over "data" (12 / DP bytes per parameter), '
        "gradients reduce-scattered and parameters all-gathered each step")
    overlap_grad_reduce: bool = _f(
        False, 'reduce each layer\'s gradients over "data" as its backward ends, overlapped with the next layer\'s; '
        "with gradient accumulation in the last microbatch's backward only (as Megatron's buckets)")
    overlap_param_gather: bool = _f(
        False, "distributed optimizer: gather each layer's parameters as it runs, overlapped with the layer before")
    coordinator_address: str | None = _f(
        None, 'multi-host: host:port of process 0 (or "auto" under SLURM/MPI/TPU); None: one process', step=False)
    num_processes: int | None = _f(None, "multi-host: processes in the run, one per host", step=False)
    process_id: int | None = _f(None, "multi-host: this process's rank, 0 .. num_processes - 1", step=False)
    distributed_timeout: int = _f(
        100, "multi-host: seconds a silent process is waited for before all exit with an error", step=False)
    distributed_timeout_minutes: int | None = _f(
        None, "multi-host: minutes the processes wait for each other to join the run (jax.distributed.initialize's "
        "initialization_timeout); None: max(--distributed-timeout, 60) seconds", step=False)


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = _f(1e-3, "peak learning rate")
    min_lr: float = _f(1e-4, "learning rate at the end of decay")
    lr_decay_style: str = _f("cosine", "constant | linear | cosine")
    lr_warmup_iters: int = _f(30, "linear warmup from --lr-warmup-init over this many steps")
    lr_warmup_init: float = _f(0.0, "the learning rate warmup starts from")
    lr_decay_iters: int | None = _f(None, "steps of decay after which lr stays at min_lr; None means train_iters")
    lr_warmup_fraction: float | None = _f(None, "warmup as a fraction of the decay steps (sets --lr-warmup-iters)")
    lr_warmup_samples: int | None = _f(None, "warmup in samples: --lr-warmup-iters = this // --global-batch-size")
    lr_decay_samples: int | None = _f(None, "decay in samples: --lr-decay-iters = this // --global-batch-size")
    weight_decay: float = _f(0.01, "AdamW decoupled weight decay (not on biases or LayerNorm)")
    weight_decay_incr_style: str = _f("constant", "constant (--weight-decay) | linear | cosine: from "
                                                  "--start-weight-decay to --end-weight-decay over "
                                                  "--weight-decay-incr-iters steps")
    start_weight_decay: float | None = _f(None, "the weight decay at step 0 (linear or cosine increments)")
    end_weight_decay: float | None = _f(None, "the weight decay from --weight-decay-incr-iters on (linear or cosine)")
    weight_decay_incr_iters: int | None = _f(None, "steps the weight decay rises over; None: all the run's (as "
                                                   "Megatron, which has no flag for it)")
    clip_grad: float = _f(1.0, "global gradient-norm clip; 0 disables it")
    adam_beta1: float = _f(0.9, "Adam's first-moment decay beta1")
    adam_beta2: float = _f(0.999, "Adam's second-moment decay beta2")
    adam_eps: float = _f(1e-8, "Adam's epsilon, added to the root of the second moment")


@dataclass(frozen=True)
class TrainingConfig:
    micro_batch_size: int = _f(4, "sequences per data-parallel rank per microbatch", step=True)
    global_batch_size: int = _f(32, "sequences per optimizer step; accumulation = global / (micro x DP)", step=True)
    train_iters: int = _f(300, "optimizer steps")
    train_samples: int | None = _f(None, "training length in samples: --train-iters = this // --global-batch-size")
    seed: int = _f(1234, "one seed for init, data order and dropout", step=True)
    bf16: bool = _f(False, "bf16 compute, fp32 master weights", step=True)
    fp16: bool = _f(False, "fp16 compute with dynamic loss scaling", step=True)
    initial_loss_scale: float = _f(2.0**16, "starting dynamic loss scale (fp16)", step=True)
    loss_scale_window: int = _f(1000, "good steps before the loss scale doubles", step=True)
    min_loss_scale: float = _f(1.0, "the loss scale never halves below this", step=True)
    recompute_granularity: str | None = _f(
        None, "None | full (whole layer) | selective (attention core) | matmuls (keep matmul outputs)", step=True)
    recompute_activations: bool = _f(False, "Megatron's alias of --recompute-granularity selective", step=True)
    recompute_method: str | None = _f(
        None, "which layers --recompute-granularity full or matmuls recomputes: uniform (groups of "
        "--recompute-num-layers layers, each recomputed from its input; groups of more than one: full only) | block "
        "(the first --recompute-num-layers layers of each pipeline stage, the others' activations kept); None: every "
        "layer (Megatron asks for a method with full)",
        step=True)
    recompute_num_layers: int | None = _f(None, "--recompute-method's layers: a group's (uniform) or each stage's "
                                                "recomputed ones (block)", step=True)
    scan_layers: bool = _f(True, "the layer stack as one lax.scan (compiles one layer); False unrolls it", step=True)
    layer_calls: bool = _f(False, "each layer a compiled call of its own: one layer compiled, run unrolled", step=True)
    compilation_cache_dir: str | None = _f(
        "~/.cache/mtx/xla", "JAX's persistent compilation cache on GPUs: a later start of the same program loads it "
                            "instead of compiling (none turns it off; CPU runs compile quickly and ignore it)",
        path=True)
    scheduler_memory_percent: int | None = _f(
        None, "GPU: the share (percent) of the memory left beside the step's arguments that XLA's latency-hiding "
              "scheduler may plan into when it moves collectives to overlap compute (XLA's "
              "xla_gpu_memory_limit_slop_factor, for the training step only); lower trades overlap for memory; "
              "None: XLA's 95", step=True)
    gpu_memory_fraction: float | None = _f(
        None, "GPU: the share of each GPU's memory JAX's allocator holds (XLA fits the step into it, recomputing what "
              "does not fit); None: $XLA_CLIENT_MEM_FRACTION, else 0.9 (JAX's own is 0.75)", step=True)
    use_flash_attn: bool = _f(False, "fused attention on GPU (bf16/fp16): cuDNN's flash attention, or with attention "
                                     "dropout mtx's Pallas kernel (the same masks); XLA's attention elsewhere",
                              step=True)
    mlm_head_positions: str = _f("masked", "BERT: where the masked-LM head (dense, GeLU, LayerNorm, logits, loss) "
                                           "runs: masked (only the positions the loss reads, at most round-up("
                                           "--mask-prob x S) a sequence) | all (every position, as Megatron)",
                                 step=True)
    eval_interval: int = _f(100, "steps between validation runs; 0 disables")
    eval_iters: int = _f(10, "global batches per evaluation (validation; test once training ends)")
    save: str | None = _f(None, "checkpoint (and run) directory", path=True)
    save_interval: int | None = _f(None, "steps between checkpoints; None saves only at the end")
    async_save: bool = _f(False, "write each checkpoint in the background while training goes on (finished before "
                                 "the next save and before exit); off: each save is on disk before the next step")
    keep_last_n_checkpoints: int | None = _f(
        None, "delete older checkpoints of --save beyond its newest N intact ones (never the newest, never a broken "
        "or foreign one); None keeps every checkpoint")
    keep_checkpoint_every: int | None = _f(None, "with --keep-last-n-checkpoints: also keep every step divisible by K")
    load: str | None = _f(None, "checkpoint directory to resume from", path=True)
    ckpt_step: int | None = _f(None, "step to load from --load; None means the latest")
    finetune: bool = _f(False, "load only the weights of --load: step 0, fresh optimizer, this run's --seed, new "
                               "metrics (Megatron's --finetune)")
    load_optim: bool = _f(True, "load --load's optimizer state; --no-load-optim: fresh Adam moments and loss scale "
                                "(the step and the lr schedule continue; Megatron's restarts its scheduler)")
    override_opt_param_scheduler: bool = _f(False, "resuming: take this run's lr and weight-decay schedules where "
                                                      "--load's differ")
    use_checkpoint_opt_param_scheduler: bool = _f(False, "resuming: keep --load's lr and weight-decay schedules, "
                                                            "whatever the flags say")
    load_rng: bool = _f(True, "take --load's seed (mtx's RNG state: dropout masks and data order are functions of "
                              "seed and step); --no-load-rng: this run's --seed")
    use_checkpoint_args: bool = _f(False, "take the model architecture from --load's saved config; it wins over "
                                          "flags and presets (each overridden value is printed)")
    run_dir: str | None = _f(None, "where metrics and the resolved config go when --save is not given", path=True)
    generate_tokens: int = _f(200, "tokens of a sample printed after training; 0 disables")
    exit_interval: int | None = _f(None, "stop after the first step divisible by this, saving a checkpoint")
    exit_duration_in_mins: float | None = _f(None, "stop after this many minutes of training, saving a checkpoint")
    exit_signal_handler: bool = _f(True, "on SIGTERM/SIGINT, finish the step, save a checkpoint and exit 0")
    manual_gc: bool = _f(False, "Python's garbage collector off, run by the loop instead: at the start, every "
                                "--manual-gc-interval steps and around evaluations (Megatron's: every process pauses "
                                "at the same step, not one at a time)")
    manual_gc_interval: int = _f(0, "--manual-gc: steps between collections; 0: none between steps")
    manual_gc_eval: bool = _f(True, "--manual-gc: collect before and after each evaluation")
    profile: bool = _f(False, "jax.profiler trace of steps --profile-step-start + 1 .. --profile-step-end on "
                              "process 0, into --tensorboard-dir or <run dir>/profile (TensorBoard's profile tab)")
    profile_step_start: int = _f(10, "--profile: steps completed before the trace starts")
    profile_step_end: int = _f(12, "--profile: steps completed when the trace stops")

    @property
    def compute_dtype(self) -> str:
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"

    @property
    def resumes(self) -> bool:
        """--load without --finetune: this run goes on from the checkpoint's step (a fine-tuned run is a new run:
        new metrics, from step 0, its own seed and optimizer)."""
        return bool(self.load) and not self.finetune


@dataclass(frozen=True)
class DataConfig:
    data_path: tuple[str, ...] = _f(
        (), 'text/.npy files, .bin/.idx prefixes, or a blend "0.7 a 0.3 b"; empty: built-in', path=True)
    train_data_path: tuple[str, ...] = _f((), "training data alone (--data-path's forms; no --split)", path=True)
    valid_data_path: tuple[str, ...] = _f((), "validation data alone, read every --eval-interval N > 0", path=True)
    test_data_path: tuple[str, ...] = _f((), "test data alone, evaluated at the end (--eval-interval N > 0)", path=True)
    mock_data: bool = _f(False, "GPT: Megatron's mock data, no files read: documents 1, 2, ..., n - 1 (wrapping "
                                "below the vocabulary's end) and end-of-document, n < --seq-length drawn from --seed")
    vocab_file: str | None = _f(None, "GPT-2 encoder.json, or BERT's vocab.txt (the tokenizer)", path=True)
    merge_file: str | None = _f(None, "GPT-2 vocab.bpe merges", path=True)
    tokenizer_type: str | None = _f(None, "GPT2BPETokenizer | BertWordPieceLowerCase | HuggingFaceTokenizer | "
                                          "NullTokenizer | byte; None: by the files given")
    tokenizer_model: str | None = _f(None, "HuggingFaceTokenizer: a local directory holding tokenizer.json, or "
                                           "that file", path=True)
    split: str = _f("949,50,1", "train,valid,test weights of the token stream, as in Megatron")
    prefetch_depth: int = _f(2, "training batches prepared ahead on a background thread; 0 prepares each at its step")
    num_workers: int = _f(0, "processes that build training batches (each builds the dataset from these flags, then "
                             "whole batches ahead); 0 builds them on the prefetch thread. For BERT at large batches")
    mask_prob: float = _f(
        0.15, "BERT: fraction of tokens masked (80% [MASK], 10% random, 10% kept), whole words", step=True)
    short_seq_prob: float = _f(0.1, "BERT: probability that a sample targets a random shorter length", step=True)
    eod_mask_loss: bool = _f(False, "GPT: no loss where the input token is end-of-document (the next document's "
                                    "first token); the mean is over the other tokens")
    reset_position_ids: bool = _f(False, "GPT: positions restart at 0 after each end-of-document token")
    reset_attention_mask: bool = _f(False, "GPT: no attention across end-of-document tokens (each packed document "
                                           "sees only itself; attention then runs unfused, even with --use-flash-attn)")


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "optimizer": OptimizerConfig,
            "training": TrainingConfig, "logging": LoggingConfig, "data": DataConfig}


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "the model's shape and type"})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"help": "the mesh and processes"})
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig, metadata={"help": "AdamW and the lr schedule"})
    training: TrainingConfig = field(default_factory=TrainingConfig, metadata={"help": "batches, precision, runs"})
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"help": "metrics and trackers"})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "data files and tokenizer"})

    @property
    def sequence_parallel(self) -> bool:
        """--sequence-parallel with TP > 1 (one model rank has nothing to split, as in Megatron): whether the layers
        split the residual stream by rows over "model"; the one switch every layer reads."""
        return self.parallel.sequence_parallel and self.parallel.tensor_model_parallel_size > 1

    @property
    def tp_comm_overlap(self) -> bool:
        """--tp-comm-overlap where sequence parallelism is on: whether its linear layers move their operands inside
        the matmuls (mtx/kernels/collective_matmul.py)."""
        return self.sequence_parallel and self.parallel.tp_comm_overlap

    def __post_init__(self):
        """Megatron's derived settings, recomputed whenever the config changes: sample counts and the warmup fraction
        set the step counts the schedule and the loop read, --recompute-activations the recompute granularity.
        Values a check would refuse are left alone for `validate` to name."""
        for section, names in PATH_FIELDS.items():  # "~/ckpt" from a preset or a quoted flag: the home directory's
            part = getattr(self, section)
            object.__setattr__(self, section, dataclasses.replace(part, **{
                name: expand_home(getattr(part, name)) for name in names}))
        t, o = self.training, self.optimizer
        gbs = t.global_batch_size
        if not _is_count(gbs) or gbs < 1:
            return
        # each step count from its Megatron sample count (DERIVED's first source; the warmup fraction is below)
        steps = {target: self.value(samples) // gbs for target, (samples, *_) in DERIVED.items()
                 if _is_count(self.value(samples))}
        if t.recompute_activations is True and t.recompute_granularity is None:
            t = dataclasses.replace(t, recompute_granularity="selective")
        t = dataclasses.replace(t, **{k: v for k, v in steps.items() if k == "train_iters"})
        # (a decay shorter than one step is refused by name in validate, not as --lr-decay-iters 0)
        o = dataclasses.replace(o, **{k: max(v, int(k == "lr_decay_iters")) for k, v in steps.items()
                                      if k != "train_iters"})
        decay = o.lr_decay_iters or t.train_iters
        fraction = o.lr_warmup_fraction
        if isinstance(fraction, (int, float)) and 0 <= fraction <= 1 and _is_count(decay):
            o = dataclasses.replace(o, lr_warmup_iters=math.floor(fraction * decay))
        object.__setattr__(self, "training", t)
        object.__setattr__(self, "optimizer", o)

    def replace(self, **flat: Any) -> "Config":
        """Returns a copy with fields set by their (unique) names, e.g. `cfg.replace(hidden_size=64)`. A step count
        and the Megatron flag it is derived from (--train-iters and --train-samples, ...) cannot both be set; an
        earlier --layer-calls yields to a layer stack or to what the calls do not run set here (`yield_layer_calls`)."""
        parts = {name: {} for name in SECTIONS}
        for key, value in flat.items():
            section = FIELD_SECTION.get(key)
            if section is None:
                raise ValueError(f"unknown config field {key!r}; see `python train.py --help` for the known ones.")
            parts[section][key] = value
        new = dataclasses.replace(
            self, **{s: dataclasses.replace(getattr(self, s), **kw) for s, kw in parts.items() if kw})
        for target, sources in DERIVED.items():
            given = [s for s in sources if new.value(s) is not None]
            if target in flat and given:
                raise ValueError(f"{flag_name(given[0])} sets {flag_name(target)}; pass only one of the two.")
        return yield_layer_calls(new, flat)

    def value(self, name: str) -> Any:
        """A field's value by its flat name (`replace`'s), whatever section holds it."""
        return getattr(getattr(self, FIELD_SECTION[name]), name)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, dict[str, Any]]) -> "Config":
        """A saved config.json -> Config; fields of removed features (which never changed the model) are dropped.
        ValueError (no flag named: the file is at fault) for a file of another shape or a field mtx does not know."""
        if not isinstance(d, dict) or not all(isinstance(v, dict) for v in d.values()):
            raise ValueError("is not an object of sections of fields, as mtx writes it")
        if unknown := [s for s in d if s not in SECTIONS] or [k for part in d.values() for k in part
                                                                if k not in FIELD_SECTION and k not in _REMOVED_FIELDS]:
            raise ValueError(f"holds {unknown[0]!r}, which mtx does not know")
        flat = {k: coerce_field(k, v) for section in d.values() for k, v in section.items() if k not in _REMOVED_FIELDS}
        derived = {target for target, sources in DERIVED.items() if any(flat.get(s) is not None for s in sources)}
        return cls().replace(**{k: v for k, v in flat.items() if k not in derived})  # derived: recomputed

    def validate(self, num_devices: int | None = None) -> "Config":
        """Refuses a bad value or combination with one sentence naming the flag and the fix; returns self. Every
        field's type and range first (mtx/schema_checks.py), then the combinations (mtx/config_checks.py)."""
        for part in (getattr(self, section) for section in SECTIONS):
            for f in dataclasses.fields(part):
                check_field(f.name, FIELD_TYPES[f.name], getattr(part, f.name))
                if f.metadata.get("path") and (path := unexpanded_home(getattr(part, f.name))):  # (not ./~user)
                    raise ValueError(f"{flag_name(f.name)} {path}: {path.split('/')[0]} names no home directory "
                                     "here; write the path out.")
        check_combinations(self, num_devices)
        return self

    def stage_layer_counts(self) -> tuple[int, ...]:
        """Layers of each (virtual) pipeline stage, P x V in pipeline order (mtx/parallel/layout.py)."""
        from mtx.parallel.layout import stage_layer_counts

        p = self.parallel
        return stage_layer_counts(self.model.num_layers, p.pipeline_model_parallel_size * self.virtual_stages,
                                  layout=p.pipeline_model_parallel_layout,
                                  first=p.num_layers_in_first_pipeline_stage, last=p.num_layers_in_last_pipeline_stage)

    @property
    def mlm_positions(self) -> int | None:
        """BERT with --mlm-head-positions masked: the masked-LM head's positions per sequence, round-up(--mask-prob x
        S), the most BERT's dataset masks in one sequence (mtx/data/bert_dataset.py); None: every position."""
        m = self.model
        if not (m.is_bert and self.training.mlm_head_positions == "masked"):
            return None
        return max(1, math.ceil(self.data.mask_prob * m.seq_length))

    @property
    def virtual_stages(self) -> int:
        """V, the layer chunks each pipeline device holds: from --virtual-pipeline-model-parallel-size, else
        --num-layers-per-virtual-pipeline-stage, else a layout with more stages than devices; 1 otherwise."""
        from mtx.parallel.layout import parse_layout

        p = self.parallel
        pp = p.pipeline_model_parallel_size
        if p.virtual_pipeline_model_parallel_size is not None:
            return p.virtual_pipeline_model_parallel_size
        if p.num_layers_per_virtual_pipeline_stage:
            return max(self.model.num_layers // (pp * p.num_layers_per_virtual_pipeline_stage), 1)
        if p.pipeline_model_parallel_layout and pp > 1:
            stages = len(parse_layout(p.pipeline_model_parallel_layout))
            return stages // pp if stages % pp == 0 else 1
        return 1

    @property
    def schedule(self) -> str:
        """The pipeline schedule that runs: gpipe, 1f1b, or interleaved (1F1B over V > 1 virtual stages)."""
        return "interleaved" if self.virtual_stages > 1 else self.parallel.pipeline_schedule

    def data_parallel_size(self, num_devices: int) -> int:
        from mtx.parallel.mesh import resolve_sizes

        p = self.parallel
        return resolve_sizes(p.data_parallel_size, p.pipeline_model_parallel_size,
                             p.tensor_model_parallel_size, num_devices)[0]


# Fields older versions saved for features measured slower and removed (none changed the model): configs still load.
_REMOVED_FIELDS = frozenset({"tp_comm_p2p", "tp_comm_batch_split"})

# Step counts that Megatron's sample / fraction flags set (Config.__post_init__), each from the flags named.
DERIVED = {"train_iters": ("train_samples",), "lr_decay_iters": ("lr_decay_samples",),
           "lr_warmup_iters": ("lr_warmup_samples", "lr_warmup_fraction")}

# The fields the lr and weight-decay schedules are made of (mtx/optim.py), which a resume compares with its checkpoint's
# or, with --use-checkpoint-opt-param-scheduler, takes from it (mtx/resume.py).
SCHEDULE_FIELDS = ("train_iters", "lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "lr_warmup_init",
                   "lr_decay_iters", "weight_decay", "weight_decay_incr_style", "start_weight_decay",
                   "end_weight_decay", "weight_decay_incr_iters")

FIELD_SECTION = {f.name: s for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
FIELD_TYPES = {name: hint for cls in SECTIONS.values() for name, hint in get_type_hints(cls).items()}
# The fields the training step reads (the train.py flags a benchmark of the step takes, benchmarks/bench.py): the
# model, mesh and optimizer sections', but for the multi-host start, and the training and data fields marked
# `step=True` (the batch shape, precision and loss scaling, recomputation, kernels, the seed; BERT's masking).
STEP_FIELDS = tuple(f.name for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)
                    if f.metadata.get("step", s in ("model", "parallel", "optimizer")))


# The fields that name files or directories (`path=True`), by section: a leading "~" is the home directory in a preset
# and a quoted flag too (the shell expands only an unquoted one; a preset's "~/ckpt" once went to ./~/ckpt).
PATH_FIELDS = {s: tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("path"))
               for s, cls in SECTIONS.items()}


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def coerce_field(key: str, value: Any) -> Any:
    """A saved or preset value as its field holds it: a path list from a list or one path."""
    if is_path_list(FIELD_TYPES[key]) and value is not None:  # a list (checked later), or one path
        return tuple(value) if isinstance(value, (list, tuple)) else (value,)
    return value
