"""Output paths and checkpoints that are not what they seem: refused in one line, and no file mtx did not write is
changed (a sweep of such inputs found each case: mtx/files.py, mtx/checkpoint.py `intact_step`)."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from mtx.checkpoint import check_compatible
from mtx.evaluation import checkpoint_tokenizer
from mtx.cli import parse_config
from mtx.config import Config
from mtx.evaluation import checkpoint_config
from mtx.files import check_json_lines, check_run_dir, check_writable
from mtx.metrics import MetricsLogger
from mtx.presets import load_preset
from mtx.run import prepare, train
from helpers import refused_in_one_line as _refused

# a fixed decay: a run resumed to more steps keeps its schedule (mtx/resume.py)
TINY = Config().replace(**load_preset("configs/tiny.toml")).replace(
    hidden_dropout=0.0, attention_dropout=0.0, lr_decay_iters=10)



def test_only_mtxs_own_metrics_and_tracker_files_count_as_a_run_directorys(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "metrics.jsonl").write_text("my notes, not JSON\n")  # once taken for mtx's (by its name), then appended
    _refused("holds files mtx did not write \\(metrics.jsonl\\)", check_run_dir, user, "--save")
    ours = tmp_path / "ours"
    (ours / "tb" / "plugins" / "profile" / "2026").mkdir(parents=True)  # README's --tensorboard-dir ours/tb
    (ours / "tb" / "events.out.tfevents.1764400000.host.1.0").write_bytes(b"\x00")
    (ours / "tb" / "plugins" / "profile" / "2026" / "host.xplane.pb").write_bytes(b"\x00")
    (ours / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    check_run_dir(ours, "--save")
    (ours / "tb" / "notes.txt").write_text("the user's")
    _refused("holds files mtx did not write \\(tb\\)", check_run_dir, ours, "--save")
    # --tensorboard-dir the run directory itself, and mtx.plot's figures drawn into it (--out RUN_DIR): the resume
    # that README names was once refused over them; another PNG is the user's
    (ours / "tb" / "notes.txt").unlink()
    (ours / "events.out.tfevents.1764400000.host.1.0").write_bytes(b"\x00")
    from mtx import plot
    from mtx.files import PNG_SIGNATURE

    assert set(plot.main([str(ours), "--out", str(ours)])) == set(ours.glob("*.png")) != set()
    check_run_dir(ours, "--save")
    (ours / "photo.png").write_bytes(PNG_SIGNATURE + b"not mtx.plot's")
    _refused("holds files mtx did not write \\(photo.png\\)", check_run_dir, ours, "--save")


def test_a_link_to_nothing_is_refused_before_anything_is_created(tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    _refused("dangling is a link to .*gone, which does not exist", check_writable, tmp_path / "dangling" / "x", "--out")
    _refused("dangling is a link to .*gone, which does not exist", check_run_dir, tmp_path / "dangling", "--save")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_place_where_nothing_can_be_created_is_refused_even_as_root(tmp_path):
    """access() says /proc is writable to root; creating a file there fails. A probe directory (made and removed)
    tells; an ordinary directory is left as it was."""
    _refused("nothing can be created in /proc|/proc is not writable",  # as root | as anyone else
             check_writable, "/proc/mtx-run/ckpt", "--save")
    check_writable(tmp_path / "new" / "ckpt", "--save")
    assert list(tmp_path.iterdir()) == []


def test_results_are_appended_only_to_a_file_of_the_tools_results(tmp_path):
    notes, corpus = tmp_path / "notes.txt", tmp_path / "corpus.jsonl"
    notes.write_text("two lines\nof the user's\n")
    corpus.write_text(json.dumps({"text": "a document"}) + "\n")  # JSON lines, but mtx.data.preprocess's input
    for path in (notes, corpus):  # (the corpus was once appended to)
        _refused(f"--json .*{path.name} exists and is not a JSON-lines file of this tool's results \\(records with "
                 "step_s\\)", check_json_lines, path, "--json", ("step_s",))
    results = tmp_path / "r.jsonl"
    results.write_text(json.dumps({"step_s": 0.1}) + "\n\n")
    check_json_lines(results, "--json", ("step_s",))
    _refused("not a JSON-lines file of this tool's", check_json_lines, results, "--out", ("collective",))
    check_json_lines(tmp_path / "new.jsonl", "--json", ("step_s",))
    _refused("is a directory", check_json_lines, tmp_path, "--json", ("step_s",))


def test_a_resume_drops_a_metrics_line_that_a_kill_cut_short(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2}) + "\n{\"st")
    MetricsLogger(tmp_path, resumed_at=1).close()  # a traceback (JSONDecodeError) before
    assert (tmp_path / "metrics.jsonl").read_text() == json.dumps({"step": 1}) + "\n"


def test_a_different_model_names_every_field_and_a_fix_that_works():
    def check(saved, current, directory):  # the saved run's model with the defaults of the rest of its config
        check_compatible(Config(model=saved), current, directory)

    gpt = dataclasses.replace(TINY.model, vocab_size=257)
    _refused("saved with num_layers=2, hidden_size=64 but this run has 3, 128; pass --num-layers 2 --hidden-size 64",
             check, gpt, dataclasses.replace(gpt, num_layers=3, hidden_size=128), "ck")
    bert = Config().replace(**load_preset("configs/bert_tiny.toml")).model
    _refused("saved with model_type='gpt' but this run has 'bert'; pass --config of a gpt preset",
             check, gpt, bert, "ck")
    # train.py sets the vocabulary from the tokenizer, so "pass --vocab-size 257" would have changed nothing
    _refused("vocab_size=257 but this run's tokenizer has 50257; pass the tokenizer it was trained with "
             r"\(--tokenizer-type byte\)", check, gpt, dataclasses.replace(gpt, vocab_size=50257), "ck")
    converted = Config(model=dataclasses.replace(gpt, vocab_size=50257))  # (mtx.convert's: the data defaults)
    _refused(r"pass the tokenizer it was trained with \(--vocab-file, --merge-file, --tokenizer-type\)",
             check_compatible, converted, dataclasses.replace(gpt, vocab_size=257), "ck")
    with pytest.raises(ValueError, match=r"pass the tokenizer it was trained with \(--vocab-file and --merge-file"):
        checkpoint_tokenizer(converted)  # (eval.py; was "drop the tokenizer flags (... --tokenizer-type byte)")
    null = Config(model=gpt).replace(tokenizer_type="NullTokenizer")  # the saved run's tokenizer, as it was built
    _refused(r"pass the tokenizer it was trained with \(--tokenizer-type NullTokenizer --vocab-size 256\)",
             check_compatible, null, dataclasses.replace(gpt, vocab_size=301), "ck")
    # a boolean and an unset number: the flags that give them (was "pass --swiglu False --ffn-hidden-size None",
    # which argparse refuses), and they parse back to the saved model
    with pytest.raises(ValueError) as e:
        check(gpt, dataclasses.replace(gpt, swiglu=True, ffn_hidden_size=128), "ck")
    fix = str(e.value).split("; pass ")[1].split(" (or")[0]
    assert fix == "--ffn-hidden-size none --no-swiglu", str(e.value)
    # a learned position table unset in both (its rows: --seq-length's) once compared equal, and read as "has None"
    _refused("saved with max_position_embeddings=32 but this run has 64; pass --max-position-embeddings 32",
             check, dataclasses.replace(gpt, seq_length=32), dataclasses.replace(gpt, seq_length=64), "ck")
    _refused("this run has 64; pass --max-position-embeddings 16 --seq-length 16 \\(or",  # (a table cannot grow)
             check, dataclasses.replace(gpt, seq_length=16), dataclasses.replace(gpt, seq_length=64), "ck")
    # settings of a feature off in both models (a Llama preset under --no-group-query-attention) change neither;
    # where one model has the feature, only flags the saved model takes are named
    llama = Config().replace(**load_preset("configs/llama_8b.toml")).model
    off = dataclasses.replace(llama, group_query_attention=False)
    check(off, dataclasses.replace(off, num_query_groups=None), "ck")
    _refused("pass --position-embedding-type learned_absolute \\(or", check,
             dataclasses.replace(llama, position_embedding_type="learned_absolute"), llama, "ck")
    rope = dataclasses.replace(gpt, position_embedding_type="rope")  # (no table: the rows are no parameter)
    check(dataclasses.replace(rope, seq_length=32), dataclasses.replace(rope, seq_length=64), "ck")
    model = parse_config(["--config", "configs/tiny.toml", "--swiglu", "--ffn-hidden-size", "128", *fix.split()]).model
    assert (model.swiglu, model.ffn_hidden_size) == (gpt.swiglu, gpt.ffn_hidden_size)


def test_a_users_folder_named_like_a_step_is_no_checkpoint(tmp_path):
    """--load of a user's directory with a folder "4": "holds no checkpoint" in one line (was orbax's warning, then
    "step 4 is broken ...; no step is intact"), nothing of it changed."""
    from mtx.resume import resume_point

    (tmp_path / "4").mkdir()
    (tmp_path / "4" / "x").write_text("hi\n")
    (tmp_path / "notes.txt").write_text("mine\n")
    _refused("holds no checkpoint; pass a directory written by --save", resume_point, TINY.replace(load=str(tmp_path)))
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["4", "notes.txt", "x"]
    (tmp_path / "notes.txt").unlink()  # as --save: the folder is the user's, not a step of mtx's
    _refused(r"holds files mtx did not write \(4\)", check_run_dir, tmp_path, "--save")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-step run that saved steps 1 and 2."""
    path = tmp_path_factory.mktemp("saved") / "run"
    train(TINY.replace(train_iters=2, save_interval=1, log_interval=1, save=str(path)), progress=False)
    return path


def test_a_run_never_appends_to_another_runs_metrics(saved, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text(json.dumps({"step": 100, "loss": 1.0}) + "\n")  # another run's records
    before = (other / "metrics.jsonl").read_text()
    _refused("already holds metrics.jsonl of another run", prepare,
             TINY.replace(train_iters=4, load=str(saved), save=str(other)))
    assert (other / "metrics.jsonl").read_text() == before and sorted(p.name for p in other.iterdir()) == [
        "metrics.jsonl"]


def test_eval_and_convert_read_the_newest_intact_step(saved, tmp_path, capsys):
    from mtx.convert import main as convert

    path = tmp_path / "run"
    shutil.copytree(saved, path)
    (path / "2" / "config" / "metadata").write_text("garbage")  # once: "error: Expecting value: line 1 ..."
    assert checkpoint_config(str(path)).model.num_layers == 2
    err = capsys.readouterr().err
    assert "step 2 is broken (config/metadata has 7 bytes" in err and "reading step 1, the newest intact" in err
    _refused("step 2 is broken .*pass --ckpt-step 1, the newest intact step", checkpoint_config, str(path), 2)
    assert convert(["to-hf", "--load", str(path), "--hf-dir", str(tmp_path / "hf"), "--ckpt-step", "3"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --load {path} has no step 3 (it has [1, 2]); pass one of "
                                               "those to --ckpt-step.")
    assert not (tmp_path / "hf").exists()


def test_a_saved_config_with_a_value_mtx_refuses_is_the_steps_fault(saved, tmp_path, capsys):
    """A step whose saved config holds a value no run saves (an edited file, its size kept): that step is broken, said
    as the step's (once "--num-layers must be >= 1", a flag the user never passed), and the step before is read."""
    path = tmp_path / "run"
    shutil.copytree(saved, path)
    metadata = path / "2" / "config" / "metadata"
    text = metadata.read_text()
    assert '"num_layers": 2' in text
    metadata.write_text(text.replace('"num_layers": 2', '"num_layers": 0'))
    assert checkpoint_config(str(path)).model.num_layers == 2
    err = capsys.readouterr().err
    assert "step 2 is broken (its config has a value mtx refuses: --num-layers must be" in err, err
    # only the model's values: a training setting a later check refuses (--ckpt-step without --load) breaks no step
    metadata = path / "1" / "config" / "metadata"
    text = metadata.read_text()
    assert '"ckpt_step": null' in text
    metadata.write_text(text.replace('"ckpt_step": null', '"ckpt_step": 1   '))
    assert checkpoint_config(str(path), 1).model.num_layers == 2


@pytest.mark.parametrize("address, processes, rank, message", [
    ("localhost", 2, 0, "--coordinator-address localhost is not HOST:PORT"),  # IndexError in jax once
    ("localhost:abc", 2, 0, "is not HOST:PORT"),  # "did not start on [::]:abc ... is the port free?" once
    (None, 2, 1, "--num-processes and --process-id join processes through --coordinator-address"),  # ignored once
    ("localhost:1234", None, 0, "--coordinator-address needs --num-processes and --process-id"),
    ("localhost:1234", 2, 5, "--process-id 5 must be below --num-processes 2"),  # was JAX's wording, after joining
])
def test_multi_process_flags_are_checked_before_joining(address, processes, rank, message):
    from mtx.distributed import check_coordinator, initialize

    _refused(message, initialize, address, processes, rank)
    for ok in [("auto", None, None), ("10.0.0.1:1234", 2, 1), ("[::1]:1234", 2, 0), ("host:1", 4, 3),
               (None, 1, 0), (None, None, None)]:
        check_coordinator(*ok)
    _refused("is not HOST:PORT", check_coordinator, "::1", 2, 0)  # unbracketed IPv6: host "::", port 1


def test_peers_that_never_join_end_the_process_in_one_line(monkeypatch, capsys):
    """At --distributed-timeout-minutes JAX's client aborts from C++ (exit status 134, a stack of logs) when the
    other processes never joined: a second before, mtx ends the process in one line, exit status 2; once joined
    (the block left), nothing happens."""
    import threading
    import time

    from mtx import distributed

    ended = threading.Event()
    monkeypatch.setattr(distributed.os, "_exit", lambda status: (ended.set(), status))
    with distributed._joined_within(3):  # the timer fires at 2 s
        time.sleep(0.5)
    time.sleep(2)
    assert not ended.is_set()
    with distributed._joined_within(2):  # at 1 s, while "joining"
        assert ended.wait(5)
    said = "error: the other processes did not join within 2 s (--distributed-timeout-minutes)"
    assert said in capsys.readouterr().err


def test_no_output_goes_inside_a_checkpoint_step(saved, tmp_path):
    """Files added to a step mix with the checkpoint and keep --keep-last-n-checkpoints from pruning it: every output
    path (checked by check_writable) inside a step is refused, the step unchanged."""
    step = saved / "2"
    before = sorted(str(p) for p in step.rglob("*"))
    for flag, path in (("--tensorboard-dir", step), ("--hf-dir", step / "hf"), ("--profile", step / "a" / "b")):
        _refused(f"{flag} {path} is inside checkpoint step 2 of {saved}; choose a directory outside the checkpoint.",
                 check_writable, path, flag)
    _refused("--tensorboard-dir .* is inside checkpoint step 2", prepare,
             TINY.replace(train_iters=3, load=str(saved), save=str(tmp_path / "c"), tensorboard_dir=str(step)))
    assert sorted(str(p) for p in step.rglob("*")) == before


def test_only_a_runs_own_outputs_go_inside_a_run_directory(saved, tmp_path):
    """Any other output there (a run's --save, converted weights, a data set, a cache) would make the run's own
    resume refuse the directory: refused where it is given; traces and event files are the run's own."""
    from mtx.files import check_new_files

    for flag, path in (("--save", saved / "inner"), ("--hf-dir", saved / "hf"), ("--hf-dir", saved),
                       ("--compilation-cache-dir", saved / "cache")):
        _refused(f"{flag} {path} would put files in the run directory {saved}, which a resumed run would then "
                 "refuse", check_run_dir if flag == "--save" else check_writable, path, flag)
    _refused("--output-prefix .* would put files in the run directory", check_new_files, [saved / "data.bin"],
             "--output-prefix")
    _refused(f"--save {saved / 'inner'} would put files", prepare, TINY.replace(save=str(saved / "inner")))
    trace = saved / "plugins" / "profile" / "2026_12_05"
    trace.mkdir(parents=True)
    (trace / "perfetto_trace.json.gz").write_bytes(b"\x00")  # bench.py --profile RUN_DIR
    (trace / "host.xplane.pb").write_bytes(b"\x00")
    for flag in ("--profile", "--tensorboard-dir"):
        check_writable(saved / "tb", flag)
    check_run_dir(saved, "--save")
    shutil.rmtree(saved / "plugins")


def test_outputs_of_a_run_inside_its_own_new_directory_are_refused(tmp_path):
    """Checked against the run directory itself, made yet or not: a fresh run took them, its resume refused them."""
    from mtx.files import check_outside

    new = tmp_path / "new"
    _refused(f"--compilation-cache-dir {new / 'cache'} would put files in the run directory {new}", prepare,
             TINY.replace(save=str(new), compilation_cache_dir=str(new / "cache")))
    _refused("--wandb-save-dir .* would put files in the run directory", check_outside, new / "wb", new,
             "--wandb-save-dir")
    check_outside(tmp_path / "elsewhere", new, "--compilation-cache-dir")


@pytest.mark.parametrize("tool", [["train.py", "--train-iters", "1", "--run-dir", "RUN"],
                                  ["benchmarks/suite.py", "--list", "--rows", "1gpu", "2gpu"],
                                  ["eval.py", "wikitext", "--help"],  # (argparse's exit, flushed at the end)
                                  ["train.py", "--help"],  # (longer than a pipe's buffer: argparse swallowed it)
                                  ["benchmarks/collectives.py", "--collectives", "all_reduce", "--sizes-mb", "0.01",
                                   "--iters", "1", "--repeats", "1", "--out", "RESULTS"]])
def test_a_reader_that_goes_away_ends_a_tool_in_one_line(tool, tmp_path):
    """`python train.py ... | head -1`: ended in a traceback (BrokenPipeError); now one line, exit status 141, and
    a training run lets its run directory go on the way (nothing trained: taken back)."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the tool writes
    argv = [str(tmp_path / arg.lower()) if arg in ("RUN", "RESULTS") else arg for arg in tool]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # (a pipe's output buffered, as usual)
    proc = subprocess.run([sys.executable, *argv], cwd=Path(__file__).resolve().parents[1], stdout=write,
                          stderr=subprocess.PIPE, text=True, env=env)
    os.close(write)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"note: {Path(tool[0]).name} stopped: the reader of its output went "
                                                "away (a closed pipe)."]
    assert not (tmp_path / "run").exists()
    if "RESULTS" in tool:  # the measurement is on disk: written before it was printed
        assert json.loads((tmp_path / "results").read_text())["collective"] == "all_reduce"


def test_a_tool_started_with_its_output_closed_or_on_a_full_disk_ends_in_one_line(tmp_path):
    """stdout closed (sys.stdout None: exit_with's flush once crashed) or on a full disk (a traceback once)."""
    import shlex
    import subprocess
    import sys

    tool = [sys.executable, "-c", "from mtx.errors import exit_with; exit_with(lambda: print('result') or 0)"]
    closed = subprocess.run(f"{shlex.join(tool)} >&-", shell=True, stderr=subprocess.PIPE, text=True)
    assert closed.returncode == 0 and closed.stderr == "", closed.stderr
    if Path("/dev/full").exists():
        with open("/dev/full", "w") as full:
            proc = subprocess.run(tool, stdout=full, stderr=subprocess.PIPE, text=True)
        assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
            "error: No space left on device; free some space, or write the output elsewhere."], proc.stderr


@pytest.mark.parametrize("tool", [["-m", "mtx.plot", "LONG"], ["train.py", "--config", "LONG.toml"],
                                  ["eval.py", "generate", "--load", "LONG", "--prompt", "hi"]])
def test_a_name_too_long_for_the_file_system_is_one_line(tool, tmp_path):
    """A path component over 255 bytes: Path.exists() raises (ENAMETOOLONG) where a missing file would be named; each
    tool ended in a traceback."""
    import subprocess
    import sys

    long = str(tmp_path / ("y" * 300))
    proc = subprocess.run([sys.executable, *[arg.replace("LONG", long) for arg in tool]], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2, proc.stderr  # (a bad path given: the tools' own refusals' status)
    assert proc.stderr.strip().splitlines() == [f"error: File name too long ({long}{'.toml' * ('.toml' in tool[-1])});"
                                                " choose a shorter name (at most 255 bytes a component)."]
