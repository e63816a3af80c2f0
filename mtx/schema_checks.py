"""The facts of each config field (mtx/config.py) and its checks: its type, its numeric range or choices.

`Config.validate` runs `check_field` on every field before anything computes with them, so a config file's
`hidden_size = "sixty-four"` or a flag's `--adam-beta1 1.5` fails in one line naming the flag, then the checks of
fields together (mtx/config_checks.py); the command-line tools' own numeric flags use the same ranges through
`mtx.cli.ranged`.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any


def described(default: Any, help: str, *, step: bool | None = None, path: bool = False) -> Any:
    """A schema field: its default and its help, which `train.py --help` shows for the field's flag (mtx/cli.py).
    `step`: whether the training step reads it, where that differs from its section's rule (mtx/config.py's
    `STEP_FIELDS`, the train.py flags a benchmark of the step takes); `path`: it names files or directories (a
    leading ~ is the home directory, mtx/config.py's `PATH_FIELDS`)."""
    return dataclasses.field(default=default, metadata={"help": help} | ({} if step is None else {"step": step}) |
                             ({"path": True} if path else {}))


# The valid range of every numeric field, checked first by `Config.validate` with the field's flag in the message
# (tests/test_config.py checks that no numeric field is missing here). ">= 1 or -1": -1 means "the rest".
RANGES = {
    # model
    "num_layers": ">= 1", "hidden_size": ">= 1", "num_attention_heads": ">= 1", "ffn_hidden_size": ">= 1",
    "seq_length": ">= 1", "max_position_embeddings": ">= 1", "vocab_size": ">= 1",
    "make_vocab_size_divisible_by": ">= 1", "hidden_dropout": "[0, 1)", "attention_dropout": "[0, 1)",
    "init_method_std": "(0, 10]", "layernorm_epsilon": "> 0", "label_smoothing": "[0, 1)", "num_tokentypes": ">= 0",
    "rotary_base": "> 0", "rotary_percent": "(0, 1]", "norm_epsilon": "> 0", "num_query_groups": ">= 1",
    "rope_scaling_factor": ">= 1", "rope_scaling_low_freq_factor": "> 0", "rope_scaling_high_freq_factor": "> 0",
    "rope_scaling_original_max_position_embeddings": ">= 1",
    # parallel
    "tensor_model_parallel_size": ">= 1", "pipeline_model_parallel_size": ">= 1", "data_parallel_size": ">= 1 or -1",
    "num_layers_in_first_pipeline_stage": ">= 0", "num_layers_in_last_pipeline_stage": ">= 0",
    "virtual_pipeline_model_parallel_size": ">= 1", "num_layers_per_virtual_pipeline_stage": ">= 1",
    "num_processes": ">= 1", "process_id": ">= 0", "distributed_timeout": ">= 1",
    "distributed_timeout_minutes": ">= 1",
    # optimizer
    "lr": "[0, 10]", "min_lr": "[0, 10]", "lr_warmup_iters": ">= 0", "lr_decay_iters": ">= 1",
    "weight_decay": "[0, 10]", "clip_grad": ">= 0", "adam_beta1": "[0, 1)", "adam_beta2": "[0, 1)", "adam_eps": "> 0",
    "start_weight_decay": "[0, 10]", "end_weight_decay": "[0, 10]", "lr_warmup_init": "[0, 10]",
    "weight_decay_incr_iters": ">= 1",
    "lr_warmup_fraction": "[0, 1]", "lr_warmup_samples": ">= 0", "lr_decay_samples": ">= 1",
    # training
    "micro_batch_size": ">= 1", "global_batch_size": ">= 1", "train_iters": ">= 0", "seed": ">= 0",
    "recompute_num_layers": ">= 1",
    "initial_loss_scale": "(0, 4294967296]", "loss_scale_window": ">= 1", "min_loss_scale": "(0, 4294967296]",
    "eval_interval": ">= 0", "eval_iters": ">= 1", "save_interval": ">= 1", "ckpt_step": ">= 0",
    "exit_interval": ">= 1", "exit_duration_in_mins": "> 0", "keep_last_n_checkpoints": ">= 1",
    "keep_checkpoint_every": ">= 1", "generate_tokens": "[0, 65536]", "train_samples": ">= 0",
    "profile_step_start": ">= 0", "profile_step_end": ">= 1", "scheduler_memory_percent": "[1, 100]",
    "gpu_memory_fraction": "(0, 1]", "manual_gc_interval": ">= 0",
    # logging
    "log_interval": ">= 1", "tensorboard_log_interval": ">= 1",
    # data
    "prefetch_depth": ">= 0", "num_workers": "[0, 256]", "mask_prob": "(0, 1)", "short_seq_prob": "[0, 1]",
}


# Beyond every range: no count, size or seed above a 32-bit integer (the arrays and RNG keys that hold them), no
# number beyond what float32 holds (the step computes in it); checked for every numeric field. Where a large value
# is surely a typo the field's range says so (a learning rate of at most 10).
LIMITS = {int: 2**31 - 1, float: 3.4e38}
FLOAT32_TINY = 1.1754944e-38  # the smallest normal float32: a nonzero number below it computes as 0 on GPUs
# The model's sizes together: parameters (16 bytes each with Adam: 16 TB at this count) and the attention scores of one
# microbatch (B x heads x S x S, what XLA's attention holds) beyond these are typos, not models; XLA would fail on them
# with a traceback, or the allocator after minutes.
MAX_PARAMETERS, MAX_SCORES = 2**40, 2**48


def flag_name(field: str) -> str:
    """A config field's command-line flag: hidden_size -> --hidden-size (Megatron's spelling)."""
    return "--" + field.replace("_", "-")


def in_range(value, valid: str) -> bool:
    """Whether a number lies in a range written as in RANGES."""
    if valid.endswith(" or -1"):
        return value == -1 or in_range(value, valid[: -len(" or -1")])
    if valid[0] in "[(":
        lo, hi = (float(x) for x in valid[1:-1].split(","))
        return (lo <= value if valid[0] == "[" else lo < value) and (value <= hi if valid[-1] == "]" else value < hi)
    op, bound = valid.split()
    return value >= float(bound) if op == ">=" else value > float(bound)


def field_types(hint) -> tuple[tuple[type, ...], bool]:
    """A field's resolved annotation -> (the types it names, None aside; whether it admits None):
    `int | None` -> ((int,), True), `tuple[str, ...]` -> ((tuple,), False)."""
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    args = typing.get_args(hint) if union else (hint,)
    named = tuple(typing.get_origin(a) or a for a in args if a is not type(None))
    return named, len(named) < len(args)


_KIND_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", tuple: "a list of paths"}


# Megatron's data of each split on its own (--train-data-path, ...), in place of --data-path split by --split
SPLIT_PATHS = {"train": "train_data_path", "valid": "valid_data_path", "test": "test_data_path"}

# The settings of every field that names one (tests/test_config.py checks that its help lists them all).
TOKENIZER_TYPES = ("GPT2BPETokenizer", "BertWordPieceLowerCase", "HuggingFaceTokenizer", "NullTokenizer", "byte")
CHOICES = {"model_type": ("gpt", "bert"), "layernorm_placement": ("pre", "post"),
           "position_embedding_type": ("learned_absolute", "rope"), "normalization": ("LayerNorm", "RMSNorm"),
           "pipeline_schedule": ("gpipe", "1f1b", "interleaved"), "lr_decay_style": ("constant", "linear", "cosine"),
           "weight_decay_incr_style": ("constant", "linear", "cosine"),
           "recompute_granularity": ("full", "selective", "matmuls"),
           "recompute_method": ("uniform", "block"), "mlm_head_positions": ("masked", "all"),
           "tokenizer_type": TOKENIZER_TYPES}


def is_path_list(hint) -> bool:
    """Whether a field's annotation is a list of paths (tuple[str, ...]: --data-path and the per-split paths), which
    a flag takes as several values."""
    return field_types(hint)[0] == (tuple,)


def check_field(name: str, hint, value: Any) -> None:
    """One field's type (config files and Python callers can pass anything), numeric range and setting (CHOICES);
    `hint` is its resolved annotation."""
    flag = flag_name(name)
    kinds, optional = field_types(hint)
    if value is None and optional:
        return
    admitted = kinds + ((int,) if float in kinds else ())  # an integer is a fine float
    bad_type = not isinstance(value, admitted) or (isinstance(value, bool) and bool not in kinds)
    if is_path_list(hint) and not bad_type:
        bad_type = not all(isinstance(v, str) for v in value)
    if value is None:  # "none" on the command line, which only optional settings take
        raise ValueError(f"{flag} has no \"none\" setting; pass one of its values ({flag.lstrip('-')} in train.py "
                         "--help), or leave it out for its default.")
    if bad_type:
        raise ValueError(f"{flag} must be {_KIND_WORDS[kinds[0]]}, got {value!r}; fix the flag or the config file's "
                         f"{name}.")
    if any(isinstance(v, str) and not v.strip() for v in (value if isinstance(value, tuple) else (value,))):
        # an empty path once meant "the default" silently (--run-dir '' wrote runs/ into the working directory)
        raise ValueError(f"{flag} is empty; pass a value, or leave {flag} out for its default.")
    if name in CHOICES and value not in CHOICES[name]:
        words = ("none",) * optional + CHOICES[name]
        raise ValueError(f"{flag} must be {', '.join(words[:-1])} or {words[-1]}, got {value!r}.")
    if name not in RANGES:
        return
    valid = RANGES[name]
    if not math.isfinite(value) or not in_range(value, valid):
        raise ValueError(f"{flag} must be {'in ' if valid[0] in '[(' else ''}{valid}, got {value!r}.")
    limit = LIMITS[int if isinstance(value, int) else float]
    if abs(value) > limit:
        raise ValueError(f"{flag} {value!r} is beyond what mtx can use (at most {limit:.4g}); pass a smaller value.")
    if isinstance(value, float) and 0 < abs(value) < FLOAT32_TINY:  # 1e-50 passes "> 0" and is 0 in the step
        raise ValueError(f"{flag} {value!r} is 0 in float32, which the step computes in (its smallest normal number is "
                         f"{FLOAT32_TINY:.2g}); pass a larger value.")


# Megatron-LM flags of everyday scripts that mtx does not implement: refused by name, never silently ignored (any
# other unknown flag gets "did you mean"). None of them is an mtx flag (tests/test_megatron_flags.py).
MEGATRON_UNIMPLEMENTED = frozenset("--" + name for name in """
    num-experts moe-router-topk moe-grouped-gemm moe-aux-loss-coeff expert-model-parallel-size context-parallel-size
    rotary-interleaved distribute-saved-activations rampup-batch-size
    fp8-format fp8-margin use-dist-ckpt ckpt-format dist-ckpt-format auto-detect-ckpt-format data-cache-path
    vocab-extra-ids recompute-modules profile-ranks log-batch-size-to-tensorboard log-world-size-to-tensorboard
    tensorboard-queue-size
    """.split())

_KERNEL = "a switch of Megatron's CUDA kernels; in mtx XLA fuses and schedules the step, with the same results"
# Megatron-LM flags that ask for what mtx always does (or switch kernels mtx does not have): refused too, never
# ignored, with what mtx does instead, so that a script drops them knowing that nothing is lost.
MEGATRON_NEEDLESS = {
    "--log-throughput": "mtx always logs it (the log line's throughput per GPU, tflops_per_device in metrics.jsonl)",
    "--log-validation-ppl-to-tensorboard": "mtx always logs GPT's validation perplexity (val_ppl) to its trackers",
    **dict.fromkeys(("--no-log-learning-rate-to-tensorboard", "--no-log-loss-scale-to-tensorboard"),
                    "mtx always logs the learning rate and the loss scale (lr, loss_scale) to its trackers"),
    "--log-timers-to-tensorboard": "mtx always logs the step's time and its batch's (step_time_s, batch_make_s, "
    "batch_wait_s) to its trackers; the step is one XLA program, with no finer timers",
    "--timing-log-level": "mtx always logs the step's time and its batch's; the step is one XLA program, with no "
    "finer timers (--profile traces its kernels)",
    "--use-pytorch-profiler": "mtx spells it --profile (a jax.profiler trace, TensorBoard's profile tab)",
    "--attention-softmax-in-fp32": "mtx's attention always takes its softmax in float32",
    "--apply-query-key-layer-scaling": "mtx's attention scores are float32 products (its softmax too), so fp16 "
    "cannot overflow in them, which the scaling guards against",
    "--accumulate-allreduce-grads-in-fp32": "mtx always accumulates and reduces the gradients in float32",
    "--use-cpu-initialization": "mtx's initial weights are the same on every mesh already",
    **dict.fromkeys(("--use-mcore-models", "--use-legacy-models", "--transformer-impl"),
                    "mtx has one model implementation"),
    "--use-rotary-position-embeddings": "mtx spells it --position-embedding-type rope",
    **dict.fromkeys(("--no-masked-softmax-fusion", "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion",
                     "--no-persist-layer-norm", "--no-async-tensor-model-parallel-allreduce"), _KERNEL)}
