"""The checks of config fields together (mtx/config.py's `Config.validate`, after each field's own in
mtx/schema_checks.py): the combinations that cannot run (TP dividing the heads, batch sizes, pipeline layouts,
recomputation, checkpoint and data flags), each refused in one sentence naming the flag and the fix.
"""

from __future__ import annotations

import dataclasses

from mtx.files import same_path
from mtx.schema_checks import LIMITS, MAX_PARAMETERS, MAX_SCORES, SPLIT_PATHS, flag_name


def check_combinations(cfg, num_devices: int | None = None) -> None:
    """Refuses a combination of (individually valid) fields of `cfg` (a Config; not imported here, as mtx.config
    imports this module) that cannot run, in one sentence naming the flag and the fix; with `num_devices`, also the
    batch sizes against the data-parallel size."""
    m, p, t, o = cfg.model, cfg.parallel, cfg.training, cfg.optimizer
    _check(o.min_lr <= o.lr or o.lr_decay_style == "constant",
           f"--min-lr {o.min_lr} is above --lr {o.lr}; the schedule decays from --lr down to --min-lr.")
    check_saved_combinations(cfg)
    tp = p.tensor_model_parallel_size
    _check(m.num_attention_heads % tp == 0,
           f"--num-attention-heads {m.num_attention_heads} is not divisible by --tensor-model-parallel-size "
           f"{tp}; use a TP size that divides the head count.")
    _check(m.ffn_size >= 1, f"--swiglu's MLP width from --hidden-size {m.hidden_size} (2 / 3 of 4 x, in multiples of "
                            "64) is 0; pass --ffn-hidden-size.")
    _check(m.ffn_size % tp == 0,
           f"--ffn-hidden-size {m.ffn_size} is not divisible by --tensor-model-parallel-size {tp}.")
    rows, shard = m.padded_vocab_size, m.make_vocab_size_divisible_by
    _check(rows % (tp * shard) == 0,
           f"--tensor-model-parallel-size {tp} does not split the padded vocabulary's {rows:,} rows into shards of a "
           f"multiple of {shard}; use a TP size dividing {rows // shard} (1, 2, 4 and 8 always do).")
    _check(not p.sequence_parallel or t.micro_batch_size % tp == 0,
           f"--sequence-parallel splits each microbatch's {t.micro_batch_size} sequences over "
           f"--tensor-model-parallel-size {tp}; use a --micro-batch-size that is a multiple of {tp}.")
    _check(not p.tp_comm_overlap or p.sequence_parallel,
           "--tp-comm-overlap moves sequence parallelism's all-gathers and reduce-scatters into the matmuls; pass it "
           "with --sequence-parallel.")
    _check_pipeline(cfg)
    _check_overlap(p)
    cfg.stage_layer_counts()  # refuses layers that do not split over the stages as asked
    _check(not (t.bf16 and t.fp16), "--fp16 and --bf16 are mutually exclusive; pass at most one of them.")
    _check_model_against_run(cfg)
    _check_checkpointing(t)
    _check_megatron_flags(cfg)
    _check_recompute(cfg)
    _check_layer_calls(cfg)
    if num_devices is not None:
        dp = cfg.data_parallel_size(num_devices)
        _check(t.global_batch_size % (t.micro_batch_size * dp) == 0,
               f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
               f"{t.micro_batch_size} x data-parallel size {dp}; make it a multiple of {t.micro_batch_size * dp}.")


def _check_overlap(p) -> None:
    """The overlapped data-parallel reductions: Megatron's requirements, and the unpipelined step they live in."""
    _check(not p.overlap_param_gather or (p.use_distributed_optimizer and p.overlap_grad_reduce),
           "--overlap-param-gather gathers the distributed optimizer's shards layer by layer; pass it with "
           "--use-distributed-optimizer and --overlap-grad-reduce.")
    _check(not p.overlap_grad_reduce or p.pipeline_model_parallel_size == 1,
           "--overlap-grad-reduce reduces inside the unpipelined backward; with --pipeline-model-parallel-size "
           f"{p.pipeline_model_parallel_size} the schedule reduces once after its last tick: drop the flag.")


# What --layer-calls does not run (mtx/layer_calls.py): field, whether its value asks for it, why, the fix (None:
# drop one of the two). --layer-calls set earlier (a preset's, a config's) yields to these set later
# (`yield_layer_calls`).
LAYER_CALLS_OFF = (
    ("pipeline_model_parallel_size", lambda v: v > 1, "the pipeline schedules are the fused step's",
     "pass --pipeline-model-parallel-size 1"),
    ("use_distributed_optimizer", bool, "only the fused step shards the optimizer", None),
    ("overlap_grad_reduce", bool, "its reductions run inside the fused step's backward", None),
    ("recompute_method", lambda v: v is not None, "it picks layers of a stack, and each call runs one",
     "pass --recompute-method none"),
)


def layer_calls_conflicts(cfg) -> list[str]:
    """The fields of `cfg` set to something --layer-calls does not run (LAYER_CALLS_OFF), whether it is on or not."""
    return [name for name, asks, *_ in LAYER_CALLS_OFF if asks(cfg.value(name))]


def yield_layer_calls(cfg, given):
    """`cfg` with --layer-calls off where `given` (the fields set after it: a command line over a preset, a replace
    over a config) names a layer stack (--scan-layers or not) or asks for what the calls do not run: the later choice
    wins, as flags override a preset (a checkpoint trained with the calls evaluated on a pipeline). Given together
    with --layer-calls, the check below refuses them."""
    if "layer_calls" in given or not cfg.training.layer_calls:
        return cfg
    if "scan_layers" in given or set(layer_calls_conflicts(cfg)) & set(given):
        return cfg.replace(layer_calls=False)
    return cfg


def _check_layer_calls(cfg) -> None:
    """--layer-calls runs the unpipelined step with a replicated optimizer, each layer recomputed alike."""
    if not cfg.training.layer_calls:
        return
    for name, asks, why, fix in LAYER_CALLS_OFF:
        value = cfg.value(name)
        shown = "" if isinstance(value, bool) else f" {value}"
        _check(not asks(value), f"--layer-calls does not run with {flag_name(name)}{shown} ({why}); "
                                + (f"{fix}, or drop --layer-calls" if fix else "drop one of the two")
                                + " (--no-layer-calls where a preset sets it).")


def _check_checkpointing(t) -> None:
    """What --load takes and what --save keeps."""
    _check(t.keep_checkpoint_every is None or t.keep_last_n_checkpoints is not None,
           "--keep-checkpoint-every K only spares steps from --keep-last-n-checkpoints (without it every checkpoint "
           "is kept); pass --keep-last-n-checkpoints N with it.")
    _check(t.keep_checkpoint_every is None or not t.save_interval or t.keep_checkpoint_every % t.save_interval == 0,
           f"--keep-checkpoint-every {t.keep_checkpoint_every} is not a multiple of --save-interval {t.save_interval}, "
           "so most of the steps it names are never saved; use a multiple of the save interval.")
    for flag, on in (("--finetune", t.finetune), ("--use-checkpoint-args", t.use_checkpoint_args),
                     ("--ckpt-step", t.ckpt_step is not None), ("--no-load-optim", not t.load_optim),
                     ("--no-load-rng", not t.load_rng)):
        _check(not on or t.load, f"{flag} reads the checkpoint of --load; pass --load DIR with it.")
    _check(not t.save or not t.run_dir or same_path(t.save, t.run_dir),
           f"--save {t.save} is the run's directory too (its metrics and config go beside the checkpoints), so "
           f"--run-dir {t.run_dir} would go unused; drop --run-dir.")
    _check(t.save or not t.load or not t.run_dir or not same_path(t.run_dir, t.load),
           f"--run-dir {t.run_dir} is --load's directory, whose metrics this run would change without saving a "
           f"checkpoint there; pass --save {t.run_dir} to resume into it, or a new --run-dir.")
    _check(not t.finetune or not t.save or not t.load or not same_path(t.save, t.load),
           f"--finetune starts again from step 0, so its checkpoints would take the step numbers of --load {t.load}; "
           "pass a new --save directory.")


def _check_megatron_flags(cfg) -> None:
    """Megatron's sample counts, warmup fraction, weight-decay schedule, recompute alias, profiling and document
    masks."""
    t, o, d, m = cfg.training, cfg.optimizer, cfg.data, cfg.model
    _check(o.lr_warmup_fraction is None or o.lr_warmup_samples is None,
           "--lr-warmup-fraction and --lr-warmup-samples both set the warmup; pass one of them.")
    _check(o.lr_decay_samples is None or o.lr_decay_samples >= t.global_batch_size,
           f"--lr-decay-samples {o.lr_decay_samples} is less than one --global-batch-size {t.global_batch_size}; "
           "decay over at least one step's samples.")
    _check(not t.recompute_activations or t.recompute_granularity == "selective",
           f"--recompute-activations is Megatron's alias of --recompute-granularity selective, not "
           f"{t.recompute_granularity}; pass one of the two.")
    _check(not t.profile or t.profile_step_end > t.profile_step_start,
           f"--profile-step-end {t.profile_step_end} must be after --profile-step-start {t.profile_step_start}.")
    _check(not t.profile or t.profile_step_end <= t.train_iters,
           f"--profile traces steps {t.profile_step_start + 1}..{t.profile_step_end}, beyond --train-iters "
           f"{t.train_iters}: no trace would be written; pass --profile-step-start and --profile-step-end inside the "
           "run.")
    for name, samples in (("train_samples", t.train_samples), ("lr_warmup_samples", o.lr_warmup_samples)):
        _check(not samples or samples >= t.global_batch_size,  # 0 steps: no training, or no warmup unasked
               f"{flag_name(name)} {samples} is less than one --global-batch-size {t.global_batch_size}; pass at "
               "least one step's samples (or 0).")
    _check(not t.fp16 or t.min_loss_scale <= t.initial_loss_scale,
           f"--min-loss-scale {t.min_loss_scale:g} is above --initial-loss-scale {t.initial_loss_scale:g}; the scale "
           "starts at the initial one and never halves below the minimum.")
    _check(not (t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler),
           "--override-opt-param-scheduler takes this run's lr schedule and --use-checkpoint-opt-param-scheduler the "
           "checkpoint's; pass one of them.")
    given = [flag_name(name) for name in ("data_path", *SPLIT_PATHS.values()) if getattr(d, name)]
    _check(not d.mock_data or not given, f"--mock-data and {given[0] if given else ''} both give data; pass one.")
    _check(not d.mock_data or not m.is_bert, "--mock-data is GPT's (Megatron's mock GPT dataset); pass BERT's data "
           "with --data-path, or leave both out for the built-in corpus.")
    alone = [flag_name(name) for name in SPLIT_PATHS.values() if getattr(d, name)]
    _check(not alone or not d.data_path, f"--data-path and {alone[0] if alone else ''} both give data; pass one "
           "--data-path (split by --split), or each split's data with its own flag.")
    _check(not alone or d.train_data_path, f"{alone[0] if alone else ''} without --train-data-path: pass the training "
           "data with --train-data-path too, or all the data with --data-path (split by --split).")
    documents = [f for f in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask") if getattr(d, f)]
    _check(not documents or not m.is_bert,
           f"{flag_name(documents[0]) if documents else ''} acts on GPT's packed documents; BERT's samples "
           "are sentence pairs: drop it for --model-type bert.")


def _check_recompute(cfg) -> None:
    """--recompute-method and --recompute-num-layers: Megatron's rules (both or neither, never with selective), the
    granularities they apply to, and stages holding the layers they name."""
    t = cfg.training
    method, n, granularity = t.recompute_method, t.recompute_num_layers, t.recompute_granularity
    if method is None and n is None:
        return
    named = "--recompute-method" if method else "--recompute-num-layers"
    off = " ".join(f"{flag} none" for flag, v in (("--recompute-method", method), ("--recompute-num-layers", n)) if v)
    _check(granularity in ("full", "matmuls"),
           f"{named} picks the layers --recompute-granularity full (or matmuls) recomputes, and --recompute-"
           f"granularity is {granularity or 'none'}; pass --recompute-granularity full with it, or {off}.")
    layers = f"{n} layer{'s' if n != 1 else ''}"
    _check(method is not None, f"--recompute-num-layers {n} needs --recompute-method: uniform (groups of {layers}, "
           f"each recomputed from its input) or block (the first {layers} of each stage recomputed).")
    _check(n is not None, f"--recompute-method {method} needs --recompute-num-layers N (as in Megatron): "
           + ("the layers of a group recomputed from its input (1: each layer)." if method == "uniform" else
              "the layers of each pipeline stage recomputed, its others' activations kept."))
    _check(method == "block" or n == 1 or granularity == "full",
           f"--recompute-method uniform with --recompute-num-layers {n} recomputes groups of layers from their input, "
           "which --recompute-granularity matmuls does not (it keeps each layer's matmul outputs); pass "
           "--recompute-granularity full, or --recompute-method block.")
    counts, pp = cfg.stage_layer_counts(), cfg.parallel.pipeline_model_parallel_size
    most = max(sum(counts[rank::pp]) for rank in range(pp))  # Megatron's bound: the layers of a pipeline rank
    _check(n <= most, f"--recompute-num-layers {n} is more than the {most} layer{'s' if most != 1 else ''} a pipeline "
           f"stage holds; pass at most {most}.")


def check_saved_combinations(cfg) -> None:
    """The combinations that every config mtx saves satisfies among the fields read back from checkpoints: the
    model's shapes and kind, its tokenizer, and the weight decay's and warmup's (a resume may keep a saved schedule).
    Checked for flags here and for a saved config (an edited file) by mtx/checkpoint.py's config_problem; the parallel
    fields and most training fields are not read back (checked as flags only).
    A rule here may only refuse what no run of mtx could have saved: tightening one would make old steps "broken"."""
    m, d = cfg.model, cfg.data
    _check_schedules(cfg.optimizer)
    _check(m.hidden_size % m.num_attention_heads == 0,
           f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}; "
           "choose a hidden size that is a multiple of the head count.")
    _check(m.max_positions >= m.seq_length,
           f"--max-position-embeddings {m.max_positions} is smaller than --seq-length {m.seq_length}; "
           "raise it to at least the sequence length.")
    _check_model_type(cfg)
    _check_model_shapes(m)
    hf = d.tokenizer_type == "HuggingFaceTokenizer"
    _check(hf == (d.tokenizer_model is not None),
           "--tokenizer-type HuggingFaceTokenizer and --tokenizer-model DIR (a directory holding tokenizer.json, or "
           "the file) go together; pass both or neither.")
    _check(not m.is_bert or (d.tokenizer_type in (None, "BertWordPieceLowerCase") and d.merge_file is None),
           "--model-type bert needs BERT's WordPiece vocabulary: pass --vocab-file vocab.txt (BERT's) without "
           "--merge-file, and --tokenizer-type BertWordPieceLowerCase or none.")


def _check_schedules(o) -> None:
    """The weight decay's ends and style, and the warmup's start (Megatron's asserts; a resume may keep a saved
    config's, mtx/resume.py)."""
    ends = [flag_name(name) for name in ("start_weight_decay", "end_weight_decay") if getattr(o, name) is not None]
    style, off = o.weight_decay_incr_style, " ".join(f"{end} none" for end in ends)
    _check(style != "constant" or not ends, f"{' and '.join(ends)} {'set' if ends[1:] else 'sets'} an end of a rising "
           f"weight decay; pass --weight-decay-incr-style linear or cosine with both ends, or {off} (constant keeps "
           "--weight-decay).")
    _check(style == "constant" or len(ends) == 2, f"--weight-decay-incr-style {style} rises from --start-weight-decay "
           "to --end-weight-decay; pass both (as in Megatron), or --weight-decay-incr-style constant.")
    _check(len(ends) < 2 or o.start_weight_decay <= o.end_weight_decay,
           f"--end-weight-decay {o.end_weight_decay} is below --start-weight-decay {o.start_weight_decay}; the weight "
           "decay rises (as Megatron's): swap them, or pass --weight-decay-incr-style constant.")
    _check(o.lr_warmup_init <= o.lr, f"--lr-warmup-init {o.lr_warmup_init} is above --lr {o.lr}; the warmup rises "
           "to --lr from it (as Megatron's).")


def _check_model_type(cfg) -> None:
    m = cfg.model
    if not m.is_bert:
        _check(m.layernorm_placement == "pre",
               "--layernorm-placement post is only implemented for --model-type bert; drop it for GPT.")
        return
    _check(not m.bert_binary_head or m.num_tokentypes >= 2,
           f"--num-tokentypes {m.num_tokentypes} cannot tell sentence A from B; use 2, or --bert-no-binary-head.")
    _check(m.seq_length >= 8, f"--seq-length {m.seq_length} is too short for BERT's [CLS] A [SEP] B [SEP] samples; "
                              "use at least 8.")


def _check_model_against_run(cfg) -> None:
    """The model's sizes against the micro batch, its key/value groups against TP, rope against the data's
    documents (the model's own combinations: _check_model_shapes)."""
    m, d, tp = cfg.model, cfg.data, cfg.parallel.tensor_model_parallel_size
    scores = cfg.training.micro_batch_size * m.num_attention_heads * m.seq_length ** 2
    _check(scores <= MAX_SCORES,
           f"--seq-length {m.seq_length} makes {scores:.3g} attention scores a microbatch (--micro-batch-size "
           f"{cfg.training.micro_batch_size} x {m.num_attention_heads} heads x S x S), beyond what mtx can compute "
           f"({MAX_SCORES:.3g}); pass a shorter sequence or a smaller micro batch.")
    g = m.query_groups
    _check(g % tp == 0 or tp % g == 0,
           f"--num-query-groups {g} neither splits over --tensor-model-parallel-size {tp} (G divisible by TP) nor "
           "is replicated whole on groups of ranks (TP a multiple of G); choose G and TP so that one divides the "
           "other.")
    _check(not (m.rope and d.reset_position_ids and not d.reset_attention_mask),
           "--reset-position-ids with --position-embedding-type rope needs --reset-attention-mask: rotary positions "
           "reach attention only through their differences, which restart with the documents only when each "
           "document attends to itself alone; pass --reset-attention-mask too.")


def _check_model_shapes(m) -> None:
    """The model's sizes together; Llama's blocks (mtx/architecture.py): names, the rotary dimensions, the key/value
    groups against the heads, and BERT, which they do not combine with."""
    # (the vocabulary itself near the limit: no divisor would help, a smaller vocabulary does)
    fix = "pass 128" if m.vocab_size + 1024 <= LIMITS[int] and m.make_vocab_size_divisible_by > 128 else \
        "pass a smaller --vocab-size (or a tokenizer of fewer ids)"
    _check(m.padded_vocab_size <= LIMITS[int],
           f"--make-vocab-size-divisible-by {m.make_vocab_size_divisible_by} pads the vocabulary of {m.vocab_size:,} "
           f"ids to {m.padded_vocab_size:,} rows (a multiple of 8 x it), beyond what mtx can use ({LIMITS[int]:,}); "
           f"{fix}.")
    _check(m.num_params() <= MAX_PARAMETERS,
           f"--num-layers {m.num_layers}, --hidden-size {m.hidden_size}, --ffn-hidden-size {m.ffn_size} and the "
           f"vocabulary ({m.padded_vocab_size:,} padded) make {m.num_params():.3g} parameters, beyond what mtx can "
           f"train ({MAX_PARAMETERS:.3g}); check these sizes.")
    _check(not m.rope or (m.rotary_dim >= 2 and m.rotary_dim % 2 == 0),
           f"--rotary-percent {m.rotary_percent} of head dim {m.head_dim} rotates {m.rotary_dim} dimensions, which "
           "must be even and at least 2 (they rotate in pairs); choose a percent giving an even count.")
    _check(not m.use_rope_scaling or m.rope_scaling_high_freq_factor > m.rope_scaling_low_freq_factor,
           f"--rope-scaling-high-freq-factor {m.rope_scaling_high_freq_factor} must be above "
           f"--rope-scaling-low-freq-factor {m.rope_scaling_low_freq_factor} (the kept wavelengths are the shorter).")
    g, n = m.query_groups, m.num_attention_heads
    _check(n % g == 0, f"--num-query-groups {g} does not divide --num-attention-heads {n}; each group serves the "
                       "same number of query heads: choose G dividing the heads.")
    _check(not m.is_bert or not m.llama_blocks(),
           f"{', '.join(m.llama_blocks())}: Llama's blocks are built for GPT only; drop them for --model-type bert.")
    default_epsilon = next(f.default for f in dataclasses.fields(m) if f.name == "layernorm_epsilon")
    _check(m.norm_epsilon is None or m.layernorm_epsilon in (default_epsilon, m.norm_epsilon),
           f"--norm-epsilon {m.norm_epsilon} and --layernorm-epsilon {m.layernorm_epsilon} name the same epsilon; "
           "pass one of them.")


def _check_pipeline(cfg) -> None:
    p, pp, layers = cfg.parallel, cfg.parallel.pipeline_model_parallel_size, cfg.model.num_layers
    v, n = p.virtual_pipeline_model_parallel_size, p.num_layers_per_virtual_pipeline_stage
    if n is not None:
        _check(layers % (pp * n) == 0,
               f"--num-layers {layers} does not split into --pipeline-model-parallel-size {pp} x "
               f"virtual stages of --num-layers-per-virtual-pipeline-stage {n}; choose N dividing "
               f"{layers // pp if layers % pp == 0 else 'layers / stages'}.")
        _check(v is None or v * pp * n == layers,
               f"--virtual-pipeline-model-parallel-size {v} and --num-layers-per-virtual-pipeline-stage {n} "
               f"disagree ({v} x {pp} stages x {n} != {layers} layers); pass one of them.")
    virtual = cfg.virtual_stages
    if virtual > 1:
        _check(p.pipeline_model_parallel_layout is not None or layers % (pp * virtual) == 0,
               f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size {pp} x "
               f"--virtual-pipeline-model-parallel-size {virtual}; choose V so that stages x V divides the layers, "
               "or give a --pipeline-model-parallel-layout.")
        _check(pp > 1, "virtual pipeline stages split the pipeline stages; pass --pipeline-model-parallel-size "
                       "> 1 with them.")
        _check(p.pipeline_schedule != "gpipe",
               "--pipeline-schedule gpipe runs one stage per device; drop the virtual stages or use 1f1b / "
               "interleaved.")
        _check(p.num_layers_in_first_pipeline_stage is None and p.num_layers_in_last_pipeline_stage is None,
               "--num-layers-in-first/last-pipeline-stage do not combine with virtual stages; give a "
               "--pipeline-model-parallel-layout with one '|'-separated stage per virtual stage instead.")
    else:
        _check(p.pipeline_schedule != "interleaved" or pp == 1,
               "--pipeline-schedule interleaved needs virtual stages: pass --virtual-pipeline-model-parallel-size "
               "V > 1 (or --num-layers-per-virtual-pipeline-stage, or a layout with V x stages stages).")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
