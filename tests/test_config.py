"""The config owns the arithmetic (parameter counts, FLOPs, padded vocab) and refuses bad combinations early."""

import re

import pytest

from mtx.cli import parse_config
from mtx.config import Config, ModelConfig
from mtx.presets import load_preset

PRESETS = {"gpt2_124m": 124_439_808, "gpt2_355m": 354_823_168}


def test_gpt2_124m_parameter_count():
    m = Config().replace(**load_preset("configs/gpt2_124m.toml")).model
    assert m.num_params_unpadded() == 124_439_808
    assert m.padded_vocab_size == 51_200  # the paper's padding of 50,257
    assert m.num_params() == 124_439_808 + (51_200 - 50_257) * 768


@pytest.mark.parametrize("name,billions", [("gpt_1.2b", 1.2), ("gpt_2.5b", 2.5), ("gpt_4.2b", 4.2), ("gpt_8.3b", 8.3)])
def test_paper_table1_sizes(name, billions):
    cfg = Config().replace(**load_preset(f"configs/{name}.toml"))
    assert round(cfg.model.num_params() / 1e9, 1) == billions
    assert cfg.model.padded_vocab_size == 51_200


def test_flops_per_token_is_6n_plus_attention():
    m = ModelConfig(num_layers=40, hidden_size=1536, num_attention_heads=16, seq_length=1024)
    assert m.flops_per_token() == 6 * m.num_params() + 12 * 40 * 1536 * 1024


@pytest.mark.parametrize("vocab,padded", [(50257, 51200), (257, 1024), (1024, 1024), (30522, 30720)])
def test_padded_vocab_is_multiple_of_128_per_shard(vocab, padded):
    m = ModelConfig(vocab_size=vocab)
    assert m.padded_vocab_size == padded
    for tp in (1, 2, 4, 8):
        assert (m.padded_vocab_size // tp) % 128 == 0


@pytest.mark.parametrize("flags,needle", [
    (dict(hidden_size=96, num_attention_heads=12, tensor_model_parallel_size=8), "--tensor-model-parallel-size"),
    (dict(hidden_size=100, num_attention_heads=8), "--num-attention-heads"),
    (dict(bf16=True, fp16=True), "--fp16 and --bf16"),
    (dict(recompute_granularity="some"), "--recompute-granularity"),
    (dict(seq_length=256, max_position_embeddings=128), "--max-position-embeddings"),
])
def test_bad_combinations_fail_with_the_flag_named(flags, needle):
    with pytest.raises(ValueError, match=needle):
        Config().replace(**flags).validate(8)


def test_more_devices_than_exist():
    with pytest.raises(ValueError, match="only 8 exist"):
        Config().replace(tensor_model_parallel_size=8, data_parallel_size=2).validate(8)


def test_inconsistent_batch_sizes():
    with pytest.raises(ValueError, match="--global-batch-size 30 is not divisible"):
        Config().replace(global_batch_size=30, micro_batch_size=4).validate(8)


def test_flags_override_preset_and_unknown_flags_fail():
    cfg = parse_config(["--config", "configs/tiny.toml", "--hidden-size", "128", "--bf16"])
    assert cfg.model.hidden_size == 128 and cfg.model.num_layers == 2 and cfg.training.bf16
    with pytest.raises(ValueError, match="unknown flag --no-such-flag; train.py --help lists the flags"):
        parse_config(["--no-such-flag", "1"])


def test_preset_with_unknown_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("hiden_size = 3\n")
    with pytest.raises(ValueError, match="unknown field"):
        load_preset(bad)


def test_config_round_trips_through_dict():
    cfg = Config().replace(data_path=("a.txt",), hidden_size=256)
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_help_lists_every_flag():
    """`train.py --help` formats (a '%' in a field's help once broke argparse) and names every field's flag."""
    from mtx.cli import build_parser

    text = build_parser().format_help()
    for flag in ("--mask-prob", "--sequence-parallel", "--no-scan-layers", "--bert-no-binary-head"):
        assert flag in text


def test_boolean_flags_undo_a_preset(tmp_path):
    """Every boolean field takes a flag each way, so a preset's setting can be undone on the command line (the 1.2B
    preset unrolls its layers; a benchmark row meant to scan them once could not, and silently ran unrolled)."""
    from mtx.cli import parse_config

    preset = tmp_path / "p.toml"
    preset.write_text("scan_layers = false\nsequence_parallel = true\nuse_flash_attn = true\n")
    values = lambda cfg: (cfg.training.scan_layers, cfg.parallel.sequence_parallel, cfg.training.use_flash_attn)
    assert values(parse_config(["--config", str(preset)])) == (False, True, True)
    assert values(parse_config(["--config", str(preset), "--scan-layers", "--no-sequence-parallel",
                                "--no-use-flash-attn"])) == (True, False, False)
    assert values(parse_config(["--no-scan-layers", "--sequence-parallel", "--use-flash-attn"])) == (False, True, True)
    assert parse_config(["--sequence-parallel", "--no-sequence-parallel"]).parallel.sequence_parallel is False  # last wins


def test_every_field_has_help_and_entry_points_share_its_flags():
    """Each flag's help is its field's metadata; eval.py and the audit add subsets of the same flags, with their own
    defaults where given and the schema's elsewhere."""
    import argparse
    import dataclasses

    from mtx.cli import add_config_flags
    from mtx.config import SECTIONS

    assert all(f.metadata.get("help") for cls in SECTIONS.values() for f in dataclasses.fields(cls))
    parser = argparse.ArgumentParser()
    add_config_flags(parser, ["num_layers", "bf16", "data_parallel_size"], defaults={"num_layers": None})
    assert vars(parser.parse_args([])) == {"num_layers": None, "bf16": False, "data_parallel_size": -1}
    args = parser.parse_args(["--num-layers", "3", "--bf16", "--no-bf16", "--data-parallel-size", "2"])
    assert vars(args) == {"num_layers": 3, "bf16": False, "data_parallel_size": 2}
    with pytest.raises(ValueError, match="not a config field"):
        add_config_flags(parser, ["no_such_field"])


def test_configs_saved_with_removed_fields_still_load():
    """config.json of a run from before --tp-comm-p2p and --tp-comm-batch-split were removed: the fields never changed
    the model, so the run's checkpoints keep loading; an unknown field is still refused. (--tp-comm-overlap, removed
    with them, is a field again: the same switch, now the peer-memory matmuls.)"""
    saved = Config().to_dict()
    saved["parallel"].update(tp_comm_p2p=True, tp_comm_batch_split=False)
    assert Config.from_dict(saved) == Config()
    old = {k: v for k, v in Config().to_dict().items() if k != "logging"}  # before the logging section: in training
    old["training"].update(log_interval=7, tensorboard_dir="tb", wandb_project="p", log_params_norm=True)
    log = Config.from_dict(old).logging
    assert (log.log_interval, log.tensorboard_dir, log.wandb_project, log.log_params_norm) == (7, "tb", "p", True)
    saved["parallel"]["not_a_field"] = 1
    with pytest.raises(ValueError, match="holds 'not_a_field', which mtx does not know"):
        Config.from_dict(saved)  # said of the file by its caller, not of a flag
    for shape, said in (([], "is not an object of sections"), ({**Config().to_dict(), "model": []}, "is not an object"),
                        ({**Config().to_dict(), "extra": {}}, "holds 'extra', which mtx does not know")):
        with pytest.raises(ValueError, match=said):
            Config.from_dict(shape)  # once AttributeError: 'list' object has no attribute 'items'


def test_every_numeric_field_has_a_range():
    """A new numeric field cannot skip range checking: RANGES lists every int and float field of the schema."""
    from mtx.config import FIELD_TYPES
    from mtx.schema_checks import RANGES, field_types

    numeric = {name for name, hint in FIELD_TYPES.items() if {int, float} & set(field_types(hint)[0])}
    assert len(numeric) > 40 and numeric == set(RANGES)


@pytest.mark.parametrize("argv,message", [
    (["--num-layers", "0"], "--num-layers must be >= 1, got 0."),
    (["--hidden-size", "-64"], "--hidden-size must be >= 1, got -64."),
    (["--num-attention-heads", "0"], "--num-attention-heads must be >= 1, got 0."),
    (["--lr", "-1e-3"], "--lr must be in [0, 10], got -0.001."),
    (["--lr", "nan"], "--lr must be in [0, 10], got nan."),
    (["--adam-beta1", "1.5"], "--adam-beta1 must be in [0, 1), got 1.5."),
    (["--adam-beta2", "-0.1"], "--adam-beta2 must be in [0, 1), got -0.1."),
    (["--save-interval", "-1"], "--save-interval must be >= 1, got -1."),
    (["--log-interval", "0"], "--log-interval must be >= 1, got 0."),
    (["--eval-iters", "0"], "--eval-iters must be >= 1, got 0."),
    (["--hidden-dropout", "1"], "--hidden-dropout must be in [0, 1), got 1.0."),
    (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1 or -1, got 0."),
    (["--clip-grad", "inf"], "--clip-grad must be >= 0, got inf."),
    (["--model-type", "bert", "--mask-prob", "0"], "--mask-prob must be in (0, 1), got 0.0."),
    (["--min-lr", "0.1", "--lr", "0.01"], "--min-lr 0.1 is above --lr 0.01"),
])
def test_numbers_out_of_range_fail_with_the_flag_named(argv, message):
    """Negative values parse as values (`--lr -1e-3`), and every numeric field is range-checked by validate."""
    with pytest.raises(ValueError) as e:
        parse_config(argv).validate(8)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("line,message", [
    ('hidden_size = "sixty-four"', "--hidden-size must be an integer, got 'sixty-four'"),
    ("num_layers = 2.5", "--num-layers must be an integer, got 2.5"),
    ("bf16 = 1", "--bf16 must be true or false, got 1"),
    ("lr = true", "--lr must be a number, got True"),
    ('recompute_granularity = 3', "--recompute-granularity must be a string, got 3"),
    ("data_path = [1, 2]", "--data-path must be a list of paths, got (1, 2)"),
])
def test_wrong_types_in_a_config_file_fail_with_the_field_named(tmp_path, line, message):
    preset = tmp_path / "bad.toml"
    preset.write_text(line + "\n")
    with pytest.raises(ValueError) as e:
        parse_config(["--config", str(preset)]).validate(8)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("argv,message", [
    (["eval.py", "generate", "--top-p", "0"], "argument --top-p: must be in (0, 1], got 0"),
    (["eval.py", "generate", "--max-new-tokens", "0"], "argument --max-new-tokens: must be in [1, 65536], got 0"),
    (["eval.py", "wikitext", "--overlapping-eval", "-3"], "argument --overlapping-eval: must be >= 1, got -3"),
    (["mtx.data.preprocess", "--input", "x", "--output-prefix", "y", "--workers", "0"],
     "argument --workers: must be in [1, 256], got 0"),
])
def test_tools_range_check_their_own_numbers(capsys, argv, message):
    import importlib

    tool = importlib.import_module("eval" if argv[0] == "eval.py" else argv[0])
    try:
        status = tool.main(argv[1:])
    except SystemExit as e:
        status = e.code
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2 and len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], errors


def test_checkpoint_and_tracking_flags_parse_with_megatron_names():
    cfg = parse_config(["--finetune", "--no-load-optim", "--no-load-rng", "--use-checkpoint-args", "--async-save",
                        "--keep-last-n-checkpoints", "3", "--keep-checkpoint-every", "100", "--load", "ckpt",
                        "--wandb-project", "p", "--wandb-exp-name", "e", "--wandb-save-dir", "w"])
    t, log = cfg.training, cfg.logging
    assert (t.finetune, t.load_optim, t.load_rng, t.use_checkpoint_args, t.async_save) == (
        True, False, False, True, True)
    assert (t.keep_last_n_checkpoints, t.keep_checkpoint_every) == (3, 100)
    assert (log.wandb_project, log.wandb_exp_name, log.wandb_save_dir) == ("p", "e", "w")
    d = Config().training
    assert (d.finetune, d.load_optim, d.load_rng, d.use_checkpoint_args, d.async_save) == (
        False, True, True, False, False)
    assert d.keep_last_n_checkpoints is None and Config().logging.wandb_project is None


@pytest.mark.parametrize("argv,message", [
    (["--keep-last-n-checkpoints", "0"], "--keep-last-n-checkpoints must be >= 1, got 0."),
    (["--keep-last-n-checkpoints", "2", "--keep-checkpoint-every", "-5"], "--keep-checkpoint-every must be >= 1"),
    (["--keep-checkpoint-every", "10"], "--keep-checkpoint-every K only spares steps from --keep-last-n-checkpoints"),
    (["--keep-last-n-checkpoints", "2", "--keep-checkpoint-every", "150", "--save-interval", "100"],
     "--keep-checkpoint-every 150 is not a multiple of --save-interval 100"),
    (["--finetune"], "--finetune reads the checkpoint of --load; pass --load DIR with it."),
    (["--use-checkpoint-args"], "--use-checkpoint-args reads the checkpoint of --load; pass --load DIR with it."),
    (["--finetune", "--load", "ck", "--save", "ck"], "--finetune starts again from step 0"),
    (["--no-load-optim"], "--no-load-optim reads the checkpoint of --load; pass --load DIR with it."),
    (["--no-load-rng"], "--no-load-rng reads the checkpoint of --load; pass --load DIR with it."),
    (["--save", "ck", "--run-dir", "other"], "--save ck is the run's directory too (its metrics and config go beside "
     "the checkpoints), so --run-dir other would go unused; drop --run-dir."),
    (["--load", "ck", "--run-dir", "ck"], "--run-dir ck is --load's directory, whose metrics this run would change "
     "without saving a checkpoint there; pass --save ck to resume into it, or a new --run-dir."),
])
def test_checkpoint_flags_out_of_range_or_in_conflict_are_refused(argv, message):
    with pytest.raises(ValueError) as e:
        parse_config(argv).validate(8)
    assert str(e.value).startswith(message)


def test_bert_flops_count_the_mlm_head_where_it_runs():
    """BERT's masked-LM head (dense D -> D and the tied logits) counts at every position with --mlm-head-positions all
    and at round-up(--mask-prob x S) positions a sequence with masked (the default); a bad choice is one line."""
    cfg = Config().replace(**load_preset("configs/bert_336m.toml"))
    m, d, v = cfg.model, cfg.model.hidden_size, cfg.model.padded_vocab_size
    assert cfg.mlm_positions == 77 and cfg.replace(mlm_head_positions="all").mlm_positions is None
    every = m.flops_per_token()
    assert every == 6 * m.num_params() + 12 * 24 * 1024 * 512
    assert m.flops_per_token(77) == pytest.approx(every - 6 * d * (d + v) * (1 - 77 / 512), rel=1e-12)
    with pytest.raises(ValueError, match="--mlm-head-positions must be masked or all, got 'some'"):
        cfg.replace(mlm_head_positions="some").validate()


@pytest.mark.parametrize("argv,message", [
    (["--adam-eps", "1e-50"], "--adam-eps 1e-50 is 0 in float32, which the step computes in (its smallest normal "
     "number is 1.2e-38); pass a larger value."),
    (["--lr", "1e-45"], "--lr 1e-45 is 0 in float32"),
    (["--make-vocab-size-divisible-by", "2147483647"], "--make-vocab-size-divisible-by 2147483647 pads the "
     "vocabulary of 50,257 ids to 17,179,869,176 rows (a multiple of 8 x it), beyond what mtx can use "
     "(2,147,483,647); pass 128."),
    (["--hidden-size", "2147483640", "--num-attention-heads", "8"],
     "--num-layers 4, --hidden-size 2147483640, --ffn-hidden-size 8589934560 and the vocabulary"),
    (["--seq-length", "2147483647", "--max-position-embeddings", "2147483647"],
     "--seq-length 2147483647 makes 1.48e+20 attention scores a microbatch"),
])
def test_numbers_float32_or_the_model_cannot_hold_are_refused(argv, message):
    """A positive number that is 0 in float32 passes "> 0" and trained on NaN; sizes whose product no device holds
    reached XLA (a traceback) or the allocator (minutes, then killed)."""
    with pytest.raises(ValueError) as e:
        parse_config(argv).validate(8)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("argv,enabler", [
    (["--wandb-exp-name", "x"], "--wandb-project NAME"), (["--wandb-save-dir", "w"], "--wandb-project NAME"),
    (["--bias-swiglu-fusion"], "--swiglu"), (["--swiglu", "--bias-gelu-fusion"], "the GeLU MLP, not --swiglu"),
    (["--rotary-base", "5e5"], "--position-embedding-type rope"),
    (["--use-rope-scaling"], "--position-embedding-type rope"),
    (["--position-embedding-type", "rope", "--rope-scaling-factor", "8"], "--use-rope-scaling"),
    (["--loss-scale-window", "10"], "--fp16"), (["--num-query-groups", "2"], "--group-query-attention"),
    (["--mask-prob", "0.3"], "--model-type bert"), (["--mlm-head-positions", "all"], "--model-type bert"),
    (["--model-type", "bert", "--label-smoothing", "0.1"], "GPT's next-token loss"),
    (["--pipeline-schedule", "gpipe"], "--pipeline-model-parallel-size 2 or more"),
    (["--tp-comm-overlap", "--tensor-model-parallel-size", "1"], "--tensor-model-parallel-size 2 or more"),
    (["--profile-step-start", "1", "--profile-step-end", "2"], "--profile"),
    (["--eval-iters", "5", "--eval-interval", "0"], "--eval-interval N (N > 0)"),
])
def test_a_flag_whose_feature_is_off_is_refused(argv, enabler):
    """Given on the command line, a setting of a feature that is off is refused; from a preset it is not (a flag may
    turn the preset's feature off)."""
    with pytest.raises(ValueError, match=re.escape(f"only acts with {enabler}; ")):
        parse_config(argv)
    parse_config(["--no-bias-swiglu-fusion", "--swiglu", "--no-bias-gelu-fusion"])  # the off forms are harmless
    parse_config(["--no-sequence-parallel", "--no-tp-comm-overlap", "--wandb-project", "none", "--wandb-exp-name",
                  "none", "--bert-no-binary-head"])
    parse_config(["--sequence-parallel", "--tensor-model-parallel-size", "1"])  # off at TP 1, as Megatron turns it
    # the model of --use-checkpoint-args is the checkpoint's, read later: a BERT one takes --mask-prob
    parse_config(["--load", "ck", "--use-checkpoint-args", "--mask-prob", "0.2", "--bias-swiglu-fusion"])
    # a preset's setting of a feature a flag turns off (its partner flag was once refused, naming the preset's value)
    parse_config(["--config", "configs/llama_8b.toml", "--no-group-query-attention"]).validate(8)
    parse_config(["--config", "configs/llama_8b.toml", "--position-embedding-type", "learned_absolute"]).validate(8)
    cfg = parse_config(["--config", "configs/llama_8b.toml", "--no-use-rope-scaling"])
    assert not cfg.model.use_rope_scaling and cfg.model.rope_scaling_factor != 1


def test_a_home_directory_in_a_preset_or_a_quoted_flag_is_the_users(tmp_path, monkeypatch):
    """The shell expands ~ only on an unquoted command line: a preset's "~/ckpt" once trained into ./~/ckpt."""
    monkeypatch.setenv("HOME", str(tmp_path))
    preset = tmp_path / "p.toml"
    preset.write_text('save = "~/ckpt"\ndata_path = ["0.7", "~/a", "0.3", "b~"]\nvocab_file = "~/vocab.json"\n')
    cfg = parse_config(["--config", str(preset), "--tensorboard-dir", "~/tb"])
    assert (cfg.training.save, cfg.logging.tensorboard_dir) == (f"{tmp_path}/ckpt", f"{tmp_path}/tb")
    assert cfg.data.data_path == ("0.7", f"{tmp_path}/a", "0.3", "b~")
    assert cfg.data.vocab_file == f"{tmp_path}/vocab.json"
    assert Config().replace(load="~").training.load == str(tmp_path)
    for path in ("~nosuchuser/x", "~+/x"):  # names no home directory: refused, not made as ./~nosuchuser/x
        with pytest.raises(ValueError, match=f"^--save {re.escape(path)}: .* names no home directory here"):
            parse_config(["--save", path]).validate(8)


def test_an_empty_config_is_refused():
    """--config "$PRESET" with PRESET unset once trained the default model, silently."""
    for empty in ("", " "):
        with pytest.raises(ValueError, match="^--config is empty; pass a preset file such as configs/gpt2_124m.toml"):
            parse_config(["--config", empty])


def test_every_setting_of_a_field_is_in_its_help_and_only_those_are_taken():
    """CHOICES (mtx/schema_checks.py) is the one list of a field's settings: its help names each one, and another
    value is refused naming them all, from a flag or a config file."""
    import dataclasses

    from mtx.config import SECTIONS
    from mtx.schema_checks import CHOICES

    helps = {f.name: f.metadata["help"] for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
    for name, choices in CHOICES.items():
        assert all(choice in helps[name] for choice in choices), (name, helps[name])
        with pytest.raises(ValueError, match=f" must be .*{re.escape(choices[-1])}, got 'x'.$"):
            Config().replace(**{name: "x"}).validate(8)
    # named as a setting mtx lacks before the rule for flags that do nothing (PP 1 here) speaks
    with pytest.raises(ValueError, match="^--pipeline-schedule must be gpipe, 1f1b or interleaved, got '1F1B'"):
        parse_config(["--pipeline-schedule", "1F1B"])
