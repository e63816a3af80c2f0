"""Bad input to `python -m mtx.data.preprocess` (--json-keys on plain text, text that is not valid Unicode) and to
benchmarks/plain_gpt.py (train.py flags its plain model does not read): one error line naming the fix, nothing
written or measured."""

import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from mtx.config import Config
from mtx.data.indexed import IndexedDataset
from mtx.data.preprocess import main as preprocess
from mtx.presets import load_preset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import plain_gpt  # noqa: E402

BYTE = ["--tokenizer-type", "byte"]


def test_json_keys_are_refused_for_plain_text(tmp_path, refused):
    """Plain text has no fields: --json-keys title body once wrote its whole text into both datasets."""
    (tmp_path / "a.txt").write_text("Some plain text.")
    (tmp_path / "c.jsonl").write_text('{"title": "A title", "body": "A body."}\n')
    a, c, out = str(tmp_path / "a.txt"), str(tmp_path / "c.jsonl"), ["--output-prefix", str(tmp_path / "o"), *BYTE]
    assert (f"--json-keys title body names fields of JSON-lines input (.jsonl or .json), but --input {a} is plain "
            "text, with no fields: its whole text would be written under each key; drop --json-keys (the dataset is "
            f"then {tmp_path / 'o'}_text_document), or name the file .jsonl") in refused(
        ["--input", a, "--json-keys", "title", "body", *out])
    assert "is plain text, with no fields; drop --json-keys" in refused(["--input", a, "--json-keys", "body", *out])
    assert "under each key; pass one key (the plain text then joins its dataset)" in refused(
        ["--input", c, a, "--json-keys", "title", "body", *out])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "c.jsonl"]  # nothing written
    assert preprocess(["--input", a, *out]) == [f"{tmp_path / 'o'}_text_document"]  # the default key: fine,
    assert preprocess(["--input", a, "--json-keys", "text", *out[:2], "--overwrite", *BYTE])  # given too (Megatron's)
    body = preprocess(["--input", c, a, "--json-keys", "body", *out[:2] + ["--overwrite"], *BYTE])[0]
    assert IndexedDataset(body).num_documents == 2  # one key beside JSONL: the plain text joins its dataset


def test_unpaired_surrogate_is_named_with_its_line(tmp_path, refused):
    """A JSON escape of half a UTF-16 pair once reached the tokenizer: "'utf-8' codec can't encode", no file or line
    (a traceback with BERT's and Hugging Face's tokenizers, a replacement character with GPT-2's)."""
    src = tmp_path / "s.jsonl"
    src.write_text('{"text": "fine \\ud83d\\ude00"}\n{"text": "ab\\ud800"}\n')  # a whole pair, then half of one
    assert refused(["--input", str(src), "--output-prefix", str(tmp_path / "o"), *BYTE]) == (
        f"error: --input {src} line 2: 'text' holds an unpaired surrogate (\\ud800 at character 2), which is not "
        "valid Unicode; repair or drop that line.")
    assert not list(tmp_path.glob("o_*"))
    src.write_text('{"text": "fine \\ud83d\\ude00"}\n')
    assert IndexedDataset(preprocess(["--input", str(src), "--output-prefix", str(tmp_path / "o"), *BYTE])[0]
                          ).document_tokens(0, 1).tolist() == list("fine 😀".encode())


@pytest.mark.parametrize("argv, fix", [
    (["--swiglu"], "--swiglu is a train.py flag the benchmark does not use"),
    (["--position-embedding-type", "rope"], "--position-embedding-type is a train.py flag the benchmark does not"),
    (["--fp16", "--initial-loss-scale", "8"], "--initial-loss-scale is a train.py flag the benchmark does not use"),
    (["--hidden-dropout", "0.1"], "--hidden-dropout 0.1: plain_gpt.py's model has no dropout; pass 0"),
    (["--recompute-granularity", "selective"], "not selective (the attention core); pass one of those."),
    (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size only acts with --gspmd"),
    (["--config", str(ROOT / "configs/llama_1b.toml")], "builds GPT-2's model only, not the preset's --position"),
    (["--global-batch-size", "3"], "make it a multiple of 2"),  # once a traceback from the step's reshape
    (["--gspmd", "--tensor-model-parallel-size", "16"], "needs 16 devices, and there are 8"),  # once no "error:"
])
def test_plain_gpt_refuses_what_its_model_ignores(monkeypatch, capsys, argv, fix):
    monkeypatch.setattr(plain_gpt, "measure", lambda *a, **kw: pytest.fail("measured"))
    preset = [] if "--config" in argv else ["--config", str(ROOT / "configs/tiny.toml")]
    assert plain_gpt.main([*preset, *argv]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: ") and fix in errors[0], errors


def test_plain_gpt_takes_its_own_flags_and_lists_them(monkeypatch, capsys):
    """The flags the suite and docs/benchmarks.md pass (dropout 0, one device's sizes) still run; --help names
    plain_gpt.py and --gspmd, and leaves out what it ignores."""
    runs = []
    monkeypatch.setattr(plain_gpt, "measure", lambda cfg, **kw: runs.append(kw["gspmd"]) or {})
    base = ["--config", str(ROOT / "configs/tiny.toml"), "--hidden-dropout", "0", "--attention-dropout", "0"]
    assert plain_gpt.main([*base, "--data-parallel-size", "1", "--tensor-model-parallel-size", "1"]) == 0
    assert plain_gpt.main([*base, "--gspmd", "--data-parallel-size", "1", "--tensor-model-parallel-size", "2",
                           "--sequence-parallel"]) == 0
    assert runs == [False, True]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        plain_gpt.main(["--help"])
    shown = capsys.readouterr().out
    assert shown.startswith("usage: plain_gpt.py") and "--gspmd: split the model" in shown
    assert "[--swiglu]" not in shown and "[--initial-loss-scale" not in shown and "[--rotary-base" not in shown


def test_plain_gpt_clip_grad_0_clips_nothing():
    """--clip-grad 0 turns clipping off, as in mtx; it once clipped every gradient to 0, so nothing trained."""
    cfg = Config().replace(**load_preset(ROOT / "configs/tiny.toml"), clip_grad=0.0, weight_decay=0.0)
    optimizer = plain_gpt.make_step(cfg)[1]
    params = {"w": jnp.ones(3)}
    updates, _ = optimizer.update({"w": jnp.full(3, 0.5)}, optimizer.init(params), params)
    assert bool((updates["w"] != 0).all())
