"""The value checks of the config schema (mtx/config.py): every field's type, every numeric field's range.

`Config.validate` runs `check_field` on every field before anything computes with them, so a config file's
`hidden_size = "sixty-four"` or a flag's `--adam-beta1 1.5` fails in one line naming the flag; the command-line tools'
own numeric flags use the same ranges through `mtx.cli.ranged`.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any


# The valid range of every numeric field, checked first by `Config.validate` with the field's flag in the message
# (tests/test_config.py checks that no numeric field is missing here). ">= 1 or -1": -1 means "the rest".
RANGES = {
    # model
    "num_layers": ">= 1", "hidden_size": ">= 1", "num_attention_heads": ">= 1", "ffn_hidden_size": ">= 1",
    "seq_length": ">= 1", "max_position_embeddings": ">= 1", "vocab_size": ">= 1",
    "make_vocab_size_divisible_by": ">= 1", "hidden_dropout": "[0, 1)", "attention_dropout": "[0, 1)",
    "init_method_std": "> 0", "layernorm_epsilon": "> 0", "label_smoothing": "[0, 1)", "num_tokentypes": ">= 0",
    # parallel
    "tensor_model_parallel_size": ">= 1", "pipeline_model_parallel_size": ">= 1", "data_parallel_size": ">= 1 or -1",
    "num_layers_in_first_pipeline_stage": ">= 0", "num_layers_in_last_pipeline_stage": ">= 0",
    "virtual_pipeline_model_parallel_size": ">= 1", "num_layers_per_virtual_pipeline_stage": ">= 1",
    "num_processes": ">= 1", "process_id": ">= 0", "distributed_timeout": ">= 1",
    # optimizer
    "lr": ">= 0", "min_lr": ">= 0", "lr_warmup_iters": ">= 0", "lr_decay_iters": ">= 1", "weight_decay": ">= 0",
    "clip_grad": ">= 0", "adam_beta1": "[0, 1)", "adam_beta2": "[0, 1)", "adam_eps": "> 0",
    # training
    "micro_batch_size": ">= 1", "global_batch_size": ">= 1", "train_iters": ">= 0", "seed": ">= 0",
    "initial_loss_scale": "> 0", "loss_scale_window": ">= 1", "min_loss_scale": "> 0", "log_interval": ">= 1",
    "eval_interval": ">= 0", "eval_iters": ">= 1", "save_interval": ">= 1", "ckpt_step": ">= 0",
    "exit_interval": ">= 1", "exit_duration_in_mins": "> 0",
    "generate_tokens": ">= 0",
    # data
    "prefetch_depth": ">= 0", "mask_prob": "(0, 1)", "short_seq_prob": "[0, 1]",
}


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


def check_field(name: str, hint, value: Any) -> None:
    """One field's type (config files and Python callers can pass anything) and numeric range; `hint` is its resolved
    annotation."""
    flag = "--" + name.replace("_", "-")
    kinds, optional = field_types(hint)
    if value is None and optional:
        return
    admitted = kinds + ((int,) if float in kinds else ())  # an integer is a fine float
    bad_type = not isinstance(value, admitted) or (isinstance(value, bool) and bool not in kinds)
    if name == "data_path" and not bad_type:
        bad_type = not all(isinstance(v, str) for v in value)
    if value is None or bad_type:
        raise ValueError(f"{flag} must be {_KIND_WORDS[kinds[0]]}, got {value!r}; fix the flag or the config file's "
                         f"{name}.")
    if name not in RANGES:
        return
    valid = RANGES[name]
    if not math.isfinite(value) or not in_range(value, valid):
        raise ValueError(f"{flag} must be {'in ' if valid[0] in '[(' else ''}{valid}, got {value!r}.")
