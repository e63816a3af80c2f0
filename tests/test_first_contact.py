"""First contact with the command lines: a mistyped flag is one line with the flag meant, every tool's --help shows
what a newcomer needs (a task's own flags, defaults, every recompute choice), train.py says where its files go."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

from mtx import audit, convert, plot
from mtx.cli import parse_config, unknown_flags_message
from mtx.files import run_files
from mtx.metrics import seconds_since_process_start
from mtx.data import preprocess

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TRAIN, EVAL = _script("train"), _script("eval")
TOOLS = {"train.py": TRAIN.main, "eval.py": EVAL.main, "audit": audit.main, "convert": convert.main,
         "preprocess": preprocess.main, "plot": plot.main}


def _run(capsys, tool: str, argv: list[str]) -> tuple[int, list[str]]:
    """(exit status, the non-empty lines on stderr) of one tool's main: some return the status, some raise it."""
    try:
        status = TOOLS[tool](argv)
    except SystemExit as e:
        status = e.code
    return status, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("tool,argv,line", [
    ("train.py", ["--hiden-size", "64"], "error: train.py: unknown flag --hiden-size; did you mean --hidden-size?"),
    ("train.py", ["--train_iters=3"], "error: train.py: unknown flag --train_iters; did you mean --train-iters?"),
    # --data-path is required too: the mistyped flag explains more than the missing one
    ("eval.py", ["wikitext", "--data-pth", "wiki.txt"],
     "error: eval.py wikitext: unknown flag --data-pth; did you mean --data-path?"),
    ("eval.py", ["generate", "--prompt", "a", "--top_p", "0.9"],
     "error: eval.py generate: unknown flag --top_p; did you mean --top-p?"),
    ("audit", ["--recompute-granulrity", "full"],
     "error: python -m mtx.audit: unknown flag --recompute-granulrity; did you mean --recompute-granularity?"),
    ("convert", ["to-hf", "--lod", "ckpt", "--hf-dir", "out"],
     "error: python -m mtx.convert to-hf: unknown flag --lod; did you mean --load?"),
    ("preprocess", ["--inptu", "a.txt", "--output-prefix", "out"],
     "error: python -m mtx.data.preprocess: unknown flag --inptu; did you mean --input?"),
    ("plot", ["run", "--ot", "plots"], "error: python -m mtx.plot: unknown flag --ot; did you mean --out?"),
    # abbreviations are unknown flags too, with the flag they begin
    ("audit", ["--seq", "64"], "error: python -m mtx.audit: unknown flag --seq; did you mean --seq-length?"),
    ("train.py", ["--fp32"], "error: train.py: unknown flag --fp32; train.py --help lists the flags."),
])
def test_an_unknown_flag_is_one_line_with_the_flag_meant(capsys, tool, argv, line):
    assert _run(capsys, tool, argv) == (2, [line])


@pytest.mark.parametrize("tool,argv,message", [
    ("train.py", ["--hidden-size"], "train.py: argument --hidden-size: expected one argument"),
    ("train.py", ["--hidden-size", "wide"], "train.py: argument --hidden-size: invalid int value: 'wide'"),
    ("train.py", ["surplus"], "train.py: unrecognized arguments: surplus"),
    ("eval.py", ["lambada", "--data-path"], "eval.py lambada: argument --data-path: expected one argument"),
    ("audit", ["--seq-length", "long"], "python -m mtx.audit: argument --seq-length: invalid int value: 'long'"),
    ("convert", ["to-hf", "--load", "ckpt"], "python -m mtx.convert to-hf: the following arguments are required: "
                                             "--hf-dir"),
])
def test_a_missing_or_mistyped_value_is_one_line(capsys, tool, argv, message):
    assert _run(capsys, tool, argv) == (2, [f"error: {message}"])


def test_unknown_flags_message():
    known = ["--hidden-size", "--ffn-hidden-size", "--seq-length", "--seed", "--help"]
    assert unknown_flags_message(["--hidden_size"], known, "HINT") == "unknown flag --hidden_size; did you mean " \
                                                                      "--hidden-size?"
    assert unknown_flags_message(["--se"], known, "HINT") == "unknown flag --se; did you mean --seed?"
    assert unknown_flags_message(["--colour"], known, "see --help") == "unknown flag --colour; see --help."
    assert unknown_flags_message(["--hiden-size", "--colour", "--hiden-size"], known, "see --help") == \
        "unknown flags --hiden-size (did you mean --hidden-size?), --colour; see --help."


def _help(capsys, monkeypatch, main, argv) -> str:
    monkeypatch.setenv("COLUMNS", "250")  # one line per flag
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


TASK_FLAGS = {"wikitext": ["--data-path FILE", "--seq-length INT", "--overlapping-eval INT", "--no-detokenize",
                           "--dry-run"],
              "lambada": ["--data-path FILE", "--seq-length INT"],
              "generate": ["--prompt TEXT", "--max-new-tokens INT", "--temperature FLOAT", "--top-k INT",
                           "--top-p FLOAT", "--seed INT"]}


def test_eval_help_lists_the_tasks(capsys, monkeypatch):
    text = _help(capsys, monkeypatch, EVAL.main, ["--help"])
    for task in TASK_FLAGS:
        assert re.search(rf"^ +{task} +\S", text, re.M), task  # each task with its summary
    assert "eval.py TASK --help" in text


@pytest.mark.parametrize("task", sorted(TASK_FLAGS))
def test_eval_task_help_lists_the_task_flags(capsys, monkeypatch, task):
    text = _help(capsys, monkeypatch, EVAL.main, [task, "--help"])
    common, own = text.split(f"\n{task} flags:\n")
    for flag in TASK_FLAGS[task]:  # in the task's section, each with its help
        assert re.search(rf"^  {flag}\s+\S", own, re.M), flag
    others = {f.split()[0] for t, flags in TASK_FLAGS.items() if t != task for f in flags} - {
        f.split()[0] for f in TASK_FLAGS[task]}
    assert not any(flag in text for flag in others)  # and no other task's
    assert "--load STR" in common and "--tensor-model-parallel-size INT" in common
    if task == "generate":
        for line in ("--max-new-tokens INT  tokens to generate per prompt (default: 64)",
                     "--temperature FLOAT   softmax temperature; 0 is greedy (default: 1.0)",
                     "--top-p FLOAT         nucleus sampling; 1: no filter (default: 1.0)"):
            assert line in own


def test_audit_help_shows_defaults_and_every_recompute_choice(capsys, monkeypatch):
    text = _help(capsys, monkeypatch, audit.main, ["--help"])
    takes_value = [a for a in audit.build_parser()._actions if a.option_strings and a.nargs != 0]
    assert len(takes_value) >= 12
    for action in takes_value:
        assert "(default: " in action.help, action.option_strings
    assert "--hidden-size INT" in text and "(default: 128)" in text
    # every value the config accepts, read from its refusal of one it does not
    with pytest.raises(ValueError) as e:
        audit.audit_config(hidden_size=64, num_attention_heads=8, seq_length=16, micro_batch_size=2,
                           tensor_model_parallel_size=2, recompute_granularity="everything")
    choices = re.split(r", | or ", re.search(r"must be (.+), got", str(e.value)).group(1))
    assert set(choices) == {"none", "full", "selective", "matmuls"}
    help_text = re.search(r"^  --recompute-granularity STR\s+(.*?)\n  -", text, re.M | re.S).group(1)
    for choice in choices:
        assert f"{choice} (" in help_text, choice


def test_audit_takes_none_for_no_recompute(capsys):
    """`--recompute-granularity none` means no recomputation, as in train.py."""
    argv = ["--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "16", "--micro-batch-size", "2",
            "--recompute-granularity", "none", "--json"]
    assert audit.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["config"]["recompute_granularity"] is None
    assert parse_config(["--recompute-granularity", "none"]).training.recompute_granularity is None
    assert audit.main(["--num-microbatches", "3"]) == 2  # one stage, one data rank: nothing would take them
    assert "--num-microbatches sets the microbatches of the pipelined step" in capsys.readouterr().err


def test_train_prints_the_run_directory_at_start_and_end(tmp_path, capsys):
    run = tmp_path / "run"
    assert TRAIN.main(["--config", "configs/tiny.toml", "--train-iters", "1", "--run-dir", str(run)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) > 2 and lines[0] == lines[-1] == f"mtx: run directory {run}/ (config.json, metrics.jsonl)"
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "metrics.jsonl"]
    # Where the time to the first step went: printed, and in the first record (its parts add up to the whole)
    assert any(line.startswith("mtx: first step ") and "s after the process started" in line for line in lines)
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    parts = [first[k] for k in ("startup_to_train_s", "startup_state_s", "startup_first_step_s")]
    assert all(x >= 0 for x in parts) and first["startup_first_step_s"] > 0
    assert first["startup_s"] == pytest.approx(sum(parts), abs=1e-6)
    assert first["startup_s"] <= seconds_since_process_start() + 1  # this process's age, to /proc's second


def test_the_run_directory_line_names_the_tracker_directories():
    cfg = parse_config(["--tensorboard-dir", "tb", "--wandb-project", "p"])
    assert run_files(cfg, Path("runs/x")) == ("mtx: run directory runs/x/ (config.json, metrics.jsonl, "
                                               "wandb_run_id); TensorBoard events in tb/; Weights & Biases files in "
                                               "runs/x/")
    cfg = parse_config(["--save", "ck", "--wandb-project", "p", "--wandb-save-dir", "w/"])
    assert run_files(cfg, Path("ck")) == ("mtx: run directory ck/ (config.json, metrics.jsonl, wandb_run_id, "
                                           "checkpoints); Weights & Biases files in w/")


def test_a_second_ctrl_c_is_one_line_and_status_130(tmp_path, capsys, monkeypatch):
    """The first SIGINT finishes the step and saves; a second raises KeyboardInterrupt wherever the loop is (a
    traceback through the prefetch thread's join, once): train.py's main turns a KeyboardInterrupt out of training
    into one line naming what is intact, exit status 130."""
    import mtx.run

    def interrupted(plan):
        raise KeyboardInterrupt

    monkeypatch.setattr(mtx.run, "train", interrupted)
    status, lines = _run(capsys, "train.py", ["--config", "configs/tiny.toml", "--run-dir", str(tmp_path / "r")])
    assert status == 130 and len(lines) == 1, lines
    assert lines[0].startswith("error: interrupted (SIGINT) before the run could save"), lines
