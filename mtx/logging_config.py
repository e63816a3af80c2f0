"""The logging section of the config schema (`LoggingConfig`): what each training record holds and where it goes
besides `metrics.jsonl` (the console's log line, TensorBoard, Weights & Biases). Megatron-LM's logging flags, by
its names; the records themselves are written by mtx/metrics.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtx.schema_checks import described as _f


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = _f(10, "steps between metrics lines")
    log_params_norm: bool = _f(False, "log the parameters' global L2 norm (the fp32 weights after each step)",
                               step=True)
    log_num_zeros_in_grad: bool = _f(False, "log how many gradient entries are exactly 0 (each step's, unscaled; the "
                                     "padded vocabulary's rows are always 0)",
                                     step=True)
    tensorboard_dir: str | None = _f(None, "TensorBoard event directory (pip install 'mtx[tensorboard]')", path=True)
    tensorboard_log_interval: int = _f(1, "steps between the trackers' (TensorBoard, W&B) training scalars, as "
                                          "Megatron's: each such step's loss, lr, grad norm and loss scale, with the "
                                          "timing and memory where it is a --log-interval step; evaluations always")
    log_memory_to_tensorboard: bool = _f(
        False, "GPU: each --log-interval record (metrics.jsonl and the trackers) gains the memory of this process's "
        "fullest device (most bytes in use): mem_allocated_bytes, mem_max_allocated_bytes, mem_reserved_bytes, "
        "mem_limit_bytes")
    wandb_project: str | None = _f(None, "Weights & Biases project: the TensorBoard scalars are logged there too "
                                         "(process 0; pip install 'mtx[wandb]'; WANDB_MODE=offline works)")
    wandb_exp_name: str | None = _f(None, "W&B run name; None: the run directory's name")
    wandb_save_dir: str | None = _f(
        None, "directory W&B writes its wandb/ folder into; None: the run directory", path=True)
