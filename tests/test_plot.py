"""`python -m mtx.plot`: PNG curves from hand-written metrics.jsonl files (no training), resumed runs, bad input."""

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="mtx.plot draws with matplotlib: pip install matplotlib")

from mtx import plot  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
CONFIG = {"model": {"seq_length": 8}, "parallel": {}, "optimizer": {}, "training": {"global_batch_size": 4}}


def _run(path, records, config=CONFIG):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def _train(step, loss, **more):
    return {"step": step, "loss": loss, "lr": 1e-4 * step, "grad_norm": 1.0 / step, "loss_scale": 1.0,
            "step_time_s": 0.5, "tokens_per_s": 64.0, "tflops_per_device": 0.1, "mfu": None, **more}


def _refused(capsys, argv) -> str:
    """Bad input: exit status 2 and exactly one line on stderr (returned), no traceback."""
    with pytest.raises(SystemExit) as e:
        plot.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    return err.strip()


def test_runs_to_pngs(tmp_path, capsys):
    # run a: validation records and MFU; run b: no MFU (CPU), a null tokens_per_s, no validation
    a = _run(tmp_path / "a", [_train(2, 5.0, mfu=0.4), {"step": 2, "val_loss": 4.9, "val_ppl": 134.3},
                              _train(4, 4.0, mfu=0.5), {"step": 4, "val_loss": 3.9, "val_ppl": 49.4}])
    b = _run(tmp_path / "b", [_train(2, 6.0, tokens_per_s=None), _train(4, 5.5)])
    out = tmp_path / "figures"
    written = plot.main([str(a), str(b), "--out", str(out), "--x", "steps", "tokens"])
    names = {f"{stem}_{x}.png" for stem in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu")
             for x in ("steps", "tokens")}
    assert {p.name for p in written} == names and {p.name for p in out.iterdir()} == names
    for path in written:
        data = path.read_bytes()
        assert data.startswith(PNG) and data.rstrip().endswith(b"IEND\xaeB`\x82") and len(data) > 5000
        assert plot.made_by_mtx_plot(path)
    assert "wrote 10 figures" in capsys.readouterr().out
    run_b = plot._read_run(b, need_tokens=True)
    assert plot._points(run_b, "tokens_per_s", "steps") == ([4], [64.0])  # the null is left out
    assert plot._points(run_b, "loss", "tokens") == ([2 * 32, 4 * 32], [6.0, 5.5])  # global batch 4 x seq 8
    assert plot._points(run_b, "mfu", "steps") == ([], [])


def test_missing_fields_are_skipped(tmp_path):
    """No MFU and no validation in any run: those figures are not drawn (not an error)."""
    a = _run(tmp_path / "a", [_train(1, 5.0), _train(2, 4.0)])
    written = plot.main([str(a), "--out", str(tmp_path / "out")])
    assert [p.name for p in written] == ["loss_steps.png", "lr_steps.png", "grad_norm_steps.png",
                                         "tokens_per_s_steps.png"]


def test_resumed_run_continues_the_curve(tmp_path):
    """Records logged again after a resume (steps 4 and 6 re-run from a checkpoint at step 3) replace the earlier
    ones from that step on, per kind: the curve is the run that went on."""
    records = [_train(2, 5.0), {"step": 2, "val_loss": 4.5}, _train(4, 4.0), {"step": 4, "val_loss": 3.5},
               _train(6, 3.0), _train(4, 4.1), _train(6, 3.1), {"step": 6, "val_loss": 2.9}, _train(8, 2.0)]
    run = plot._read_run(_run(tmp_path / "r", records), need_tokens=False)
    assert plot._points(run, "loss", "steps") == ([2, 4, 6, 8], [5.0, 4.1, 3.1, 2.0])
    assert plot._points(run, "val_loss", "steps") == ([2, 4, 6], [4.5, 3.5, 2.9])


def test_tokens_from_records_need_no_config(tmp_path, capsys):
    """Records that carry their own `tokens` are plotted against them; without them and without config.json
    --x tokens is refused."""
    counted = _run(tmp_path / "counted", [_train(1, 5.0, tokens=100), _train(3, 4.0, tokens=300)], config=None)
    assert plot._points(plot._read_run(counted, need_tokens=True), "loss", "tokens") == ([100, 300], [5.0, 4.0])
    plot.main([str(counted), "--out", str(tmp_path / "o1"), "--x", "tokens"])
    bare = _run(tmp_path / "bare", [_train(1, 5.0)], config=None)
    err = _refused(capsys, [str(bare), "--out", str(tmp_path / "o2"), "--x", "tokens"])
    assert "has no config.json" in err and err.endswith("use --x steps.")
    assert not (tmp_path / "o2").exists()


def test_bad_input_is_one_line(tmp_path, capsys):
    good = _run(tmp_path / "good", [_train(1, 5.0)])
    out = ["--out", str(tmp_path / "out")]
    assert "does-not-exist is not a directory" in _refused(capsys, [str(tmp_path / "does-not-exist"), *out])
    (tmp_path / "empty").mkdir()
    assert "empty holds no metrics.jsonl" in _refused(capsys, [str(good), str(tmp_path / "empty"), *out])
    broken = _run(tmp_path / "broken", [_train(1, 5.0)])
    with (broken / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 2, "loss": 4.\n')  # cut short
    assert "metrics.jsonl line 2 is not a JSON object with an integer step" in _refused(capsys, [str(broken), *out])
    (broken / "metrics.jsonl").write_text('{"loss": 4.0}\n')
    assert "line 1 is not a JSON object" in _refused(capsys, [str(broken), *out])
    for huge in ('{"step": 1, "loss": 1%s}', '{"step": 1%s, "loss": 1.0}', '{"step": 1, "tokens": 1%s}'):
        (broken / "metrics.jsonl").write_text(huge % ("0" * 400) + "\n")  # once OverflowError's traceback
        assert "line 1 holds a number too large to draw" in _refused(capsys, [str(broken), *out])
    (tmp_path / "file").write_text("")
    assert "is a file, not a directory" in _refused(capsys, [str(good), "--out", str(tmp_path / "file")])
    quiet = _run(tmp_path / "quiet", [])
    assert "holds no values to plot yet" in _refused(capsys, [str(quiet), *out])
    assert "invalid choice" in _refused(capsys, [str(good), "--x", "wall"])
    assert not (tmp_path / "out").exists()  # nothing written by any of them


def test_empty_and_repeated_run_dirs_are_refused(tmp_path, capsys, monkeypatch):
    """An empty RUN_DIR was once read as '.' ('. holds no metrics.jsonl'); a run given twice was drawn twice."""
    monkeypatch.chdir(tmp_path)
    _run(tmp_path / "good", [_train(1, 5.0)])
    out = ["--out", "out"]
    assert _refused(capsys, ["", *out]) == ("error: RUN_DIR is empty; pass a run directory (train.py's --save or "
                                            "--run-dir).")
    assert "RUN_DIR good ' ': path 2 of 2 is empty" in _refused(capsys, ["good", " ", *out])
    assert "good is given twice; pass each run directory once" in _refused(capsys, ["good", "good", *out])
    assert "given twice (as good and ./good/)" in _refused(capsys, ["good", "./good/", *out])
    assert not (tmp_path / "out").exists()


def test_never_writes_over_foreign_files(tmp_path, capsys):
    good = _run(tmp_path / "good", [_train(1, 5.0), _train(2, 4.0)])
    out = tmp_path / "out"
    first = plot.main([str(good), "--out", str(out)])
    again = plot.main([str(good), "--out", str(out)])  # its own files: replaced
    assert first == again and all(plot.made_by_mtx_plot(p) for p in again)
    (out / "lr_steps.png").write_bytes(PNG + b"someone else's image")
    (out / "notes.txt").write_text("kept")
    err = _refused(capsys, [str(good), "--out", str(out)])
    assert "holds lr_steps.png, not written by mtx.plot" in err and err.endswith("choose another --out.")
    assert (out / "lr_steps.png").read_bytes() == PNG + b"someone else's image"
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".png")) == ["notes.txt"]  # no tmp files


def test_notebook_figures_are_marked_and_never_replace_foreign_files(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(plot, "NOTEBOOK_FIGURES", tmp_path / "figures")
    for module in ("IPython", "IPython.display"):  # outside IPython the path is printed
        monkeypatch.setitem(sys.modules, module, None)
    plt = plot.pyplot()
    path = plot.show(plt.subplots()[0], "01_demo")
    assert path == tmp_path / "figures/01_demo.png" and plot.made_by_mtx_plot(path)
    umask = os.umask(0o022)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as any file the user writes, not mkstemp's 0600
    assert capsys.readouterr().out == f"figure: {path}\n" and not plt.get_fignums()  # written, then closed
    path.write_bytes(PNG + b"someone else's image")
    with pytest.raises(ValueError, match="was not written by mtx.plot"):
        plot.show(plt.subplots()[0], "01_demo")
    assert path.read_bytes() == PNG + b"someone else's image" and not plt.get_fignums()


def test_without_matplotlib(tmp_path, capsys, monkeypatch):
    good = _run(tmp_path / "good", [_train(1, 5.0)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    err = _refused(capsys, [str(good), "--out", str(tmp_path / "out")])
    assert err == "error: mtx.plot needs matplotlib, which is not installed; pip install matplotlib."
    assert not (tmp_path / "out").exists()


def test_suite_draws_its_table(tmp_path, capsys, monkeypatch):
    """benchmarks/suite.py --plot draws the table of a results file (fabricated here: the repository stores none)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from benchmarks import suite

    rows = {r["name"]: r for group in ("1gpu", "2gpu") for r in suite.ROWS[group]}
    result = lambda tokens_per_s, tflops, gb: {"step_s": 0.3, "tokens_per_s": tokens_per_s, "tflops_per_device": tflops,
                                               "mfu": tflops / 989, "params": 1.2e9, "global_batch": gb,
                                               "peak_mem_gib": 40.0}
    records = [{**rows["1.2B, 1 GPU"], "result": result(60000.0, 480.0, 16)},
               {**rows["1.2B, 1 GPU, mb 24"], "result": {"error": "out of memory"}},
               {**rows["2.5B, TP 2 (weak)"], "result": result(46000.0, 384.0, 16)},
               {**rows["1.2B, TP 2 (strong)"], "result": result(90000.0, 360.0, 16)},
               {**rows["1.2B, DP 2"], "result": result(112000.0, 450.0, 32)}]
    assert suite.scaling(records) == [None, None, ("weak", 0.8), ("strong", 1.5), ("tokens", 112000 / 60000)]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in records))
    png = tmp_path / "scaling.png"
    assert suite.main(["--table-only", "--baseline", str(results), "--plot", str(png)]) == 0
    assert "| 2.5B, TP 2 (weak) | 2 |" in capsys.readouterr().out  # the table, from the file: no row was run
    assert png.read_bytes().startswith(PNG) and plot.made_by_mtx_plot(png)
    assert suite.main(["--table-only", "--baseline", str(results), "--plot", str(png)]) == 0  # its own: replaced
    png.write_bytes(PNG + b"another image")
    assert suite.main(["--table-only", "--baseline", str(results), "--plot", str(png)]) == 2
    assert "was not written by mtx.plot" in capsys.readouterr().err
    assert png.read_bytes() == PNG + b"another image"


def test_suite_refuses_bad_input_before_running_a_row(tmp_path, capsys, monkeypatch):
    """An unreadable or malformed --baseline, or a --plot path it may not write, is one line and exit 2 before any
    row runs (a GPU suite takes hours)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from benchmarks import suite

    monkeypatch.setattr(suite, "run_row", lambda *a: pytest.fail("a row ran"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"name": "x"}\nnot json\n')
    foreign = tmp_path / "mine.png"
    foreign.write_bytes(PNG + b"the user's")
    for argv, message in ((["--baseline", str(tmp_path / "none.jsonl")], "none.jsonl: No such file"),
                          (["--baseline", str(bad)], "bad.jsonl line 2 is not JSON"),
                          (["--plot", str(tmp_path / "no" / "dir.png")], "is not a directory"),
                          (["--plot", str(foreign)], "was not written by mtx.plot")):
        assert suite.main(["--rows", "1gpu", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err, err
