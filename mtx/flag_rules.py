"""Flags that would do nothing: the one rule of every mtx tool (`refuse_idle`) and train.py's rules, which feature
each of its flags belongs to (`check_unused_flags`). A flag given where its feature is off is refused, naming what
turns the feature on, never taken and ignored."""

from __future__ import annotations

from mtx.schema_checks import flag_name


def refuse_idle(given, rules) -> None:
    """The one rule of every mtx tool for a flag that would do nothing: `rules` are (flags, whether they act, where
    they act, the fix); of `given` (the flags of the command line), the flags of the first rule that does not act are
    refused, the first by name: ValueError "FLAG only acts WHERE; FIX"."""
    given = set(given)
    for flags, acts, where, fix in rules:
        if not acts and (idle := sorted(set(flags) & given)):
            raise ValueError(f"{idle[0]} only acts {where}; {fix}")


def check_unused_flags(cfg, given) -> None:
    """A flag given on the command line (`given`: the field names) whose feature is off would do nothing: refused,
    naming what turns it on. Only given flags, and not their off forms (False, 0 or "none"): a preset's setting is
    fine when a flag turns its feature off. With --use-checkpoint-args the model comes from the checkpoint later
    (mtx/resume.py): the rules that depend on it are left out."""
    m, p, t, o, again = cfg.model, cfg.parallel, cfg.training, cfg.optimizer, "pass that too, or leave it out."
    given = {flag_name(name) for name in given if cfg.value(name) not in (None, False)}
    by_model = ((("rotary_base", "rotary_percent", "use_rope_scaling"), m.rope, "--position-embedding-type rope",
                 again),
                (("num_query_groups",), m.group_query_attention, "--group-query-attention", again),
                (("rope_scaling_factor", "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
                  "rope_scaling_original_max_position_embeddings"), m.use_rope_scaling, "--use-rope-scaling", again),
                (("bias_swiglu_fusion",), m.swiglu, "--swiglu", again),
                (("bias_gelu_fusion",), not m.swiglu, "the GeLU MLP, not --swiglu",
                 "leave it out (--bias-swiglu-fusion is SwiGLU's)."),
                (("gemm_epilogues",), not m.swiglu or not (m.disable_bias_linear or m.group_query_attention),
                 "the GeLU MLP, or the fused q, k, v projection's biases (not --swiglu with "
                 "--disable-bias-linear or --group-query-attention)", "leave it out."),
                (("mask_prob", "short_seq_prob", "mlm_head_positions", "num_tokentypes"), m.is_bert,
                 "--model-type bert", "leave it out for GPT."),
                (("label_smoothing", "generate_tokens"), not m.is_bert, "GPT's next-token loss",
                 "leave it out for --model-type bert."))
    rules = ((("wandb_exp_name", "wandb_save_dir"), cfg.logging.wandb_project, "--wandb-project NAME", again),
             (("initial_loss_scale", "loss_scale_window", "min_loss_scale"), t.fp16, "--fp16", again),
             (("pipeline_schedule",), p.pipeline_model_parallel_size > 1, "--pipeline-model-parallel-size 2 or more",
              again),
             (("tp_comm_overlap",), p.tensor_model_parallel_size > 1, "--tensor-model-parallel-size 2 or more",
              again),
             (("profile_step_start", "profile_step_end"), t.profile, "--profile", again),
             (("scan_layers",), not t.layer_calls, "the fused step's layer stack, not --layer-calls (each layer a "
              "call of its own)", "leave it out, or pass --no-layer-calls."),
             (("manual_gc_interval", "manual_gc_eval"), t.manual_gc, "--manual-gc", again),
             (("tensorboard_log_interval",), cfg.logging.tensorboard_dir or cfg.logging.wandb_project,
              "--tensorboard-dir or --wandb-project", again),
             (("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"), t.resumes,
              "--load (resuming, not --finetune)", again),
             (("eval_iters", "valid_data_path", "test_data_path"), t.eval_interval > 0, "--eval-interval N (N > 0)",
              again),
             (("split",), not cfg.data.train_data_path, "--data-path (or the built-in corpus)",
              "leave it out: --train-data-path's data is all for training."),
             (("lr_decay_iters", "lr_decay_samples", "min_lr"), o.lr_decay_style != "constant",
              "--lr-decay-style linear or cosine", again),
             (("lr_warmup_init",), o.lr_warmup_iters > 0, "a warmup (--lr-warmup-iters, --lr-warmup-fraction or "
              "--lr-warmup-samples above 0)", again),
             (("weight_decay_incr_iters",), o.weight_decay_incr_style != "constant",
              "--weight-decay-incr-style linear or cosine", again),
             (("weight_decay",), o.weight_decay_incr_style == "constant", "--weight-decay-incr-style constant",
              "leave it out: --start-weight-decay and --end-weight-decay set the rising decay."),
             (("distributed_timeout", "distributed_timeout_minutes"), p.coordinator_address is not None,
              "several processes (--coordinator-address)", again),
             (("gemm_epilogues",), not p.tp_comm_overlap, "the matmuls of XLA, not --tp-comm-overlap's kernels",
              "leave one of the two out."),
             *(() if t.use_checkpoint_args else by_model))
    refuse_idle(given, [(map(flag_name, names), on, f"with {enabler}", fix) for names, on, enabler, fix in rules])
