"""Flags and config files a sweep of bad inputs found accepted, crashing after device work, or refused unclearly:
each refused in one line naming the flag and the fix (mtx/cli.py, mtx/schema_checks.py, mtx/config.py)."""

import pytest

from mtx.cli import parse_config
from mtx.config import Config
from mtx.data import build_dataset
from mtx.files import check_run_dir

BIG = str(10**20)


@pytest.mark.parametrize("argv, message", [
    (["--hidden-size", BIG], f"--hidden-size {BIG} is beyond what mtx can use"),  # a traceback in init once
    (["--seed", BIG], f"--seed {BIG} is beyond what mtx can use"),  # an OverflowError once
    (["--lr-warmup-iters", BIG], "beyond what mtx can use"),  # inside the compiled step once
    (["--lr", "1e30"], "--lr must be in [0, 10], got 1e+30"),  # trained once
    (["--init-method-std", "1e30"], "--init-method-std must be in (0, 10]"),
    (["--lr", "1_0"], "argument --lr: invalid float value: '1_0'"),  # Python's float() reads 10
    (["--hidden-size", "\uff16\uff14"], "argument --hidden-size: invalid int value"),  # full-width 64
    (["--run-dir", ""], "--run-dir is empty; pass a value"),  # wrote runs/<time> in the working directory once
    (["--save", " "], "--save is empty"),
    (["--config", "configs/tiny.toml", "--config", "configs/tiny.toml"], "--config given twice"),  # dropped one
    (["--data-path", "a", "--data-path=b"], "--data-path given twice; pass all its values after one"),  # a: dropped
    (["--lr-decay-style", "none"], "--lr-decay-style has no \"none\" setting"),  # "must be a string, got None"
    (["--ckpt-step", "2"], "--ckpt-step reads the checkpoint of --load; pass --load DIR"),  # trained from scratch
    (["--lr-decay-style", "constant", "--min-lr", "1e-5"], "--min-lr only acts with --lr-decay-style linear or"),
    (["--distributed-timeout-minutes", "3"], "--distributed-timeout-minutes only acts with several processes"),
    # bytes that are no UTF-8 (os.fsdecode's surrogates): trained, then tensorstore's traceback at the save, once
    (["--save", "run/s\udcffv"], "--save 'run/s\\xffv' is not valid UTF-8; pass UTF-8 text (a file or directory: "),
    (["--save=s\udcff"], "--save 's\\xff' is not valid UTF-8"),
    (["--data-path", "a", "b\udcff"], "train.py: 'b\\xff' is not valid UTF-8"),
    (["--save", "\ud800x"], "--save '\\ud800x' is not valid UTF-8"),  # (through the API): a crash in the message once
    (["--num-attention-heads", "6", "--hidden-size", "192", "--tensor-model-parallel-size", "3"],  # "at most 8" once
     "the padded vocabulary's 51,200 rows into shards of a multiple of 128; use a TP size dividing 400 (1, 2, 4"),
])
def test_bad_flags_are_one_line_naming_the_flag(argv, message):
    with pytest.raises(ValueError) as e:
        parse_config(argv).validate(8)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("text, message", [
    (b"data_path = 5\n", "--data-path must be a list of paths, got (5,)"),  # a TypeError traceback once
    (b"hidden-size = 64\nhidden_size = 32\n", "sets hidden_size twice (hidden-size and hidden_size)"),
    ("hidden_size = 64\n".encode("utf-16"), "is not UTF-8 text"),  # "'utf-8' codec can't decode" once
    (b"num_layers = 100000000000000000000\n", "--num-layers 100000000000000000000 is beyond what mtx can use"),
    (b"train_iters = 2.5\n", "--train-iters must be an integer, got 2.5"),  # accepted once a flag replaced it
])
def test_bad_config_files_are_one_line_naming_the_file_or_field(tmp_path, text, message):
    """Every value the file sets is checked, also one that a flag on the command line then replaces."""
    (tmp_path / "c.toml").write_bytes(text)
    with pytest.raises(ValueError) as e:
        parse_config(["--config", str(tmp_path / "c.toml"), "--train-iters", "2"]).validate(8)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="is a directory"):
        parse_config(["--config", str(tmp_path)])


def test_a_preset_with_a_byte_order_mark_reads(tmp_path):
    """Windows editors start UTF-8 files with a byte-order mark: once 'not valid TOML (... line 1, column 1)'."""
    (tmp_path / "c.toml").write_bytes("hidden_size = 64\n".encode("utf-8-sig"))
    assert parse_config(["--config", str(tmp_path / "c.toml")]).model.hidden_size == 64


def test_a_negative_split_reaches_its_own_check():  # argparse's "expected one argument" once
    cfg = parse_config(["--split", "-1,2,3", "--lr", "-1e-3"])
    assert cfg.data.split == "-1,2,3"
    with pytest.raises(ValueError, match="--split '-1,2,3' must be up to three non-negative weights"):
        build_dataset(cfg.replace(seq_length=16))


@pytest.mark.parametrize("split", ["nan,1,1", "inf,1,1", "1,nan"])
def test_a_split_of_non_finite_weights_names_the_flag(split):  # "cannot convert float NaN to integer" once
    with pytest.raises(ValueError, match=f"--split '{split}' must be up to three non-negative weights"):
        build_dataset(Config().replace(split=split, seq_length=16))


def test_tokenizer_flags_without_data_are_refused_not_ignored():
    with pytest.raises(ValueError, match="--vocab-file, --tokenizer-type without --data-path: the built-in corpus"):
        build_dataset(Config().replace(vocab_file="/nonexistent", tokenizer_type="GPT2BPETokenizer"))


def test_tools_range_check_the_config_flags_they_take(capsys):
    """eval.py and the audit parse config flags without a Config.validate: the ranges apply at parsing."""
    import eval as eval_cli
    from mtx.audit import main as audit

    assert eval_cli.main(["lambada", "--load", "x", "--data-path", "y", "--micro-batch-size", "0"]) == 2
    assert "argument --micro-batch-size: must be >= 1, got 0" in capsys.readouterr().err
    assert eval_cli.main(["generate", "--load", "x", "--prompt", "hi", "--micro-batch-size", "4"]) == 2
    assert "generate: unknown flag --micro-batch-size" in capsys.readouterr().err  # taken and ignored, once
    assert eval_cli.main(["generate", "--load", "x", "--prompt", "hi", "--seed", BIG]) == 2
    assert f"argument --seed: {BIG} is beyond what mtx can use" in capsys.readouterr().err  # "must be >= 0" once
    assert audit(["--num-microbatches", "0"]) == 2
    assert "argument --num-microbatches: must be >= 1, got 0" in capsys.readouterr().err
    # a billion new tokens ran for hours with no output (generation slides its window past the positions)
    assert eval_cli.main(["generate", "--load", "x", "--prompt", "hi", "--max-new-tokens", "1000000000"]) == 2
    assert "argument --max-new-tokens: must be in [1, 65536], got 1000000000" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^--generate-tokens must be in \[0, 65536\], got 1000000000.$"):
        parse_config(["--generate-tokens", "1000000000"]).validate(8)


def test_a_tools_unset_flag_takes_none_as_its_help_says():
    """eval.py's --micro-batch-size and --ckpt-step say "None: the checkpoint's" / "the latest": `none` is that."""
    import eval as script

    args = script.build_parser().parse_args(["wikitext", "--data-path", "w", "--micro-batch-size", "None",
                                             "--ckpt-step", "none"])
    assert args.micro_batch_size is None and args.ckpt_step is None
    assert script.build_parser().parse_args(["wikitext", "--data-path", "w", "--ckpt-step", "3"]).ckpt_step == 3


def test_the_audit_refuses_flags_whose_feature_is_off(capsys):
    from mtx.audit import main as audit

    for argv, said in ((["--rotary-base", "5000"], "--rotary-base only acts with --position-embedding-type rope"),
                       (["--bias-swiglu-fusion"], "--bias-swiglu-fusion only acts with --swiglu")):
        assert audit(argv) == 2  # audited a model without the feature, once
        assert said in capsys.readouterr().err


def test_a_path_the_os_will_not_look_at_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="File name too long; choose another path"):
        check_run_dir(tmp_path / ("x" * 300), "--run-dir")


def test_an_optional_number_of_a_preset_is_unset_by_none(tmp_path):
    """--ffn-hidden-size none undoes a preset's setting (the fix a refused resume names for a saved None)."""
    (tmp_path / "c.toml").write_text("ffn_hidden_size = 128\n")
    assert parse_config(["--config", str(tmp_path / "c.toml")]).model.ffn_hidden_size == 128
    unset = parse_config(["--config", str(tmp_path / "c.toml"), "--ffn-hidden-size", "none"])
    assert unset.model.ffn_hidden_size is None


@pytest.mark.parametrize("argv, message", [
    (["generate", "--load", "x", "--prompt", "hi", "--temperature", "0", "--seed", "7"],
     "--seed only acts with a --temperature above 0 (0 is greedy: nothing is sampled); drop it, or pass"),
    (["wikitext", "--data-path", "x", "--dry-run", "--tensor-model-parallel-size", "2"],
     "--tensor-model-parallel-size only acts with a model, not with --dry-run (which counts tokens and windows)"),
    (["wikitext", "--data-path", "x", "--dry-run", "--no-bf16"], "--no-bf16 only acts with a model"),
    (["lambada", "--load", "x", "--data-path", "x", "--distributed-timeout", "50"],
     "--distributed-timeout only acts with several processes (--coordinator-address); pass that too"),
])
def test_eval_flags_that_would_do_nothing_are_refused(argv, message, capsys):
    """eval.py's flags that the task, as the others set it, would not read: refused before anything is read (each
    was accepted and did nothing)."""
    import eval as script

    assert script.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_eval_flags_at_their_defaults_are_let_be(capsys, tmp_path):
    """--top-k 0, --top-p 1 (the filters' off settings), --seed 0 and a dry run's --tensor-model-parallel-size 1 do
    nothing either way: scripts that always pass them go on (to the missing checkpoint here)."""
    import eval as script

    for argv in (["generate", "--prompt", "hi", "--temperature", "0", "--top-k", "0", "--top-p", "1", "--seed", "0"],
                 ["wikitext", "--data-path", "x", "--dry-run", "--tensor-model-parallel-size", "1"]):
        assert script.main([*argv, "--load", str(tmp_path / "none")]) == 2
        assert "only acts" not in capsys.readouterr().err


def test_eval_paths_start_at_the_home_directory_when_quoted(monkeypatch, tmp_path):
    """eval.py's paths are its own flags (no Config expands them): a quoted ~ once read ./~/ck."""
    import eval as script

    monkeypatch.setenv("HOME", str(tmp_path))
    args = script.build_parser().parse_args(["wikitext", "--load", "~/ck", "--data-path", "~/wiki.tokens",
                                             "--vocab-file", "~/v.json"])
    assert (args.load, args.data_path, args.vocab_file) == tuple(f"{tmp_path}/{n}" for n in ("ck", "wiki.tokens",
                                                                                            "v.json"))
