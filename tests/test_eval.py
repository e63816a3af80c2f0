"""Evaluation: WikiText detokenization and windows, the sharded scorer against a plain forward on every mesh,
LAMBADA's every-subword rule, eval.py's JSON output and one-line errors, and both tasks with a Hugging Face
tokenizer on a Llama-shaped model."""

import importlib.util
import inspect
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mtx import evaluation as ev
from mtx.config import Config
from mtx.data import build_tokenizer
from mtx.data.detokenize import count_original_tokens, wikitext_detokenize
from mtx.loading import load_model
from mtx.parallel.mesh import MODEL, make_mesh
from mtx.presets import load_preset
from mtx.run import train

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("eval_cli", ROOT / "eval.py")
eval_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eval_cli)


# ---- detokenizer ----
@pytest.mark.parametrize("raw, clean", [
    ("a well @-@ known 1 @,@ 000 km , or 3 @.@ 5 mi . ", "a well-known 1,000 km, or 3.5 mi. "),
    ("end .", "end ."),  # Megatron's rules need the space after the mark too
    ("x : y ; z . w ! v ? u , t", "x: y; z. w! v? u, t"),
    ("a ( 24 in ) b [ c ] d { e } f \" lobster red \" g", 'a (24 in) b [c] d {e} f "lobster red" g'),
    (" = = = Career = = = \n", " === Career ===\n"),
    (" = = Life = = \n", " == Life ==\n"),
    ("the players ' union", "the players' union"),
    ("in N years", "in 1 years"),
    ("John 's car", "John's car"),
    ("it was 30 \N{DEGREE SIGN} C", "it was 30\N{DEGREE SIGN}C"),
    ("end . \n next", "end.\nnext"),
])
def test_wikitext_detokenizer_rules(raw, clean):
    assert wikitext_detokenize(raw) == clean


def test_detokenizer_rules_apply_in_order():
    # "= = = =" must not be read as two "= =" (longest first); " , " before brackets sees the fixed commas.
    assert wikitext_detokenize("= = = = A = = = =") == "==== A ===="
    assert wikitext_detokenize("( a , b )") == "(a, b)"


def test_original_tokens_are_counted_on_single_spaces():
    assert count_original_tokens(" a b  c \n") == 4  # "a b  c".split(" ") is a, b, '', c
    assert count_original_tokens(" = Title = \n") == 3


# ---- windows ----
@pytest.mark.parametrize("t, s, o", [(2, 8, 2), (8, 8, 2), (9, 8, 2), (10, 8, 2), (50, 8, 3), (50, 8, 8), (51, 8, 1),
                                     (100, 16, 5), (17, 16, 16), (18, 16, 16), (5, 16, 4)])
def test_every_target_is_scored_exactly_once(t, s, o):
    tokens = np.arange(100, 100 + t)  # each token names its own position
    n = ev.num_windows(t, s, o)
    scored = np.zeros(t, int)
    for i in range(n):
        inputs, targets, mask = ev.window(tokens, i, s, o)
        for pos in np.flatnonzero(mask):
            assert targets[pos] == inputs[pos] + 1  # the target follows its input
            scored[targets[pos] - 100] += 1
        assert mask.any(), f"window {i} of {n} scores nothing"
    assert scored[0] == 0 and np.all(scored[1:] == 1)
    assert n == 1 + max(0, -(-(t - 1 - s) // o))


def test_no_tokens_means_no_windows():
    assert ev.num_windows(0, 8, 2) == 0 and ev.num_windows(1, 8, 2) == 0


# ---- the sharded scorer ----
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny GPT trained 0 steps (byte tokenizer: 257 ids padded to 1024, so TP ranks past the first hold only
    padding ids), saved from one device (the quickest to initialize) and loaded onto every mesh."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    cfg = Config().replace(**load_preset(ROOT / "configs/tiny.toml")).replace(
        train_iters=0, save=str(path), tensor_model_parallel_size=1, data_parallel_size=1)
    train(cfg, progress=False)
    return path


def _reference(model, params, inputs, targets):
    """Plain forward on a 1-device mesh (no collectives to type-check): full logits, log_softmax and argmax over the
    real vocabulary (padded ids are no tokens)."""
    def local(params, inputs):
        return model.merge(params).logits(inputs)

    logits = jax.jit(jax.shard_map(local, mesh=model.mesh, in_specs=(model.param_specs, P()), out_specs=P(),
                                   check_vma=False))(params, inputs)
    real = np.asarray(logits, np.float64)[..., : model.cfg.model.vocab_size]
    m = real.max(-1, keepdims=True)
    logp = real - m - np.log(np.exp(real - m).sum(-1, keepdims=True))
    top2 = np.sort(real, -1)[..., -2:]
    return -np.take_along_axis(logp, targets[..., None], -1)[..., 0], real.argmax(-1), top2[..., 1] - top2[..., 0]


@pytest.fixture(scope="module")
def scored_batch(checkpoint):
    """A (6, 24) batch (not a multiple of any data-parallel size: the scorer pads it) whose targets are half the
    reference argmax, half random, with 20% of positions masked; and the reference's NLL, argmax and top-2 margin."""
    ref_model, ref_params = load_model(str(checkpoint), data_parallel_size=1)
    assert ref_model.mesh.size == 1
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, 257, (6, 24)).astype(np.int32)
    _, argmax_ref, margin = _reference(ref_model, ref_params, inputs, inputs)
    targets = np.where(rng.random(inputs.shape) < 0.5, argmax_ref, rng.integers(0, 257, inputs.shape)).astype(np.int32)
    nll_ref = _reference(ref_model, ref_params, inputs, targets)[0]
    mask = (rng.random(inputs.shape) < 0.8).astype(np.int32)
    return inputs, targets, mask, nll_ref, argmax_ref, margin


@pytest.mark.parametrize("tp, pp, sp", [(1, 1, False), (2, 1, False), (2, 2, False), (1, 2, False), (2, 2, True)])
def test_scorer_matches_a_plain_forward(checkpoint, scored_batch, tp, pp, sp):
    inputs, targets, mask, nll_ref, argmax_ref, margin = scored_batch
    model, params = load_model(str(checkpoint), tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 sequence_parallel=sp)
    # With sequence parallelism each data rank's rows split over TP: 6 rows round up to 8 (DP 2 x TP 2).
    scorer = ev.Scorer(model, params, batch_size=6 if sp else 8)
    assert scorer.batch_size == 8
    nll, correct = scorer(inputs, targets, mask)
    scorer(inputs[:3], targets[:3], mask[:3])
    assert scorer._fn._cache_size() == 1  # fewer rows are padded to the compiled shape, not recompiled
    np.testing.assert_allclose(nll, np.where(mask > 0, nll_ref, 0.0), rtol=1e-5, atol=1e-5)
    expected = (targets == argmax_ref) & (mask > 0)
    clear = margin > 1e-5  # a near-tie may fall either way under another reduction order
    assert clear.mean() > 0.9 and np.array_equal(correct[clear], expected[clear])
    assert expected.sum() > 10 and (~expected & (mask > 0)).sum() > 10  # both outcomes are exercised


def test_vocab_parallel_argmax_ties_and_padding():
    mesh = make_mesh(1, 1, 4, devices=jax.devices()[:4])
    z = np.zeros((1, 4, 16), np.float32)  # 4 ranks x 4 ids; ids 14 and 15 are vocabulary padding
    z[0, 0, [5, 15]] = [2.0, 9.0]  # padding never wins
    z[0, 1, [3, 9]] = 4.0  # a tie across ranks goes to the lower id
    z[0, 2, [7, 6]] = 1.0  # a tie inside a rank too
    z[0, 3, 14] = 5.0  # all real ids equal: id 0
    fn = jax.jit(jax.shard_map(lambda x: ev.vocab_parallel_argmax(x, 14), mesh=mesh,
                               in_specs=P(None, None, MODEL), out_specs=P()))
    got = np.asarray(fn(jax.device_put(z, NamedSharding(mesh, P(None, None, MODEL)))))
    assert got.tolist() == [[5, 3, 6, 0]]
    assert got.tolist() == np.argmax(z[..., :14], -1).tolist()


# ---- LAMBADA ----
def _oracle(sequences):
    """A fake scorer that has memorized token sequences: its argmax after any 4 tokens is what followed them there."""
    nxt = {tuple(seq[i - 3: i + 1]): seq[i + 1] for seq in sequences for i in range(3, len(seq) - 1)}

    def score(inputs, targets, mask):
        correct = np.zeros(inputs.shape, bool)
        for r, s in np.argwhere(mask > 0):
            correct[r, s] = nxt.get(tuple(inputs[r, s - 3: s + 1].tolist())) == targets[r, s]
        return np.where(mask > 0, 1.0, 0.0), correct

    return score


def test_lambada_needs_every_subword_of_the_last_word(shared_data):
    tok = build_tokenizer(str(shared_data / "gpt2/encoder.json"), str(shared_data / "gpt2/vocab.bpe"))
    text = "She smiled at the story, which was\nincomprehensibly"
    context, target = ev.lambada_split(text)
    assert (context, target) == ("She smiled at the story, which was", " incomprehensibly")
    ids, k = ev.lambada_tokens(tok, text)
    word = tok.encode(" incomprehensibly")
    assert k == len(word) >= 3 and ids == tok.encode(context) + word
    wrong_last = ids[:-1] + [tok.encode(" cat")[0]]
    wrong_first = ids[: len(ids) - k] + [ids[len(ids) - k] + 1] + ids[len(ids) - k + 1:]
    texts = [text, "Another line ends with " + "incomprehensibly", "A short one: yes"]
    other_ids, _ = ev.lambada_tokens(tok, texts[1])
    for memorized, expect in [([ids], 1), ([wrong_last], 0), ([wrong_first], 0), ([ids, other_ids], 2)]:
        result = ev.lambada_accuracy(_oracle(memorized), 2, tok, texts, seq_length=64, progress=False)
        assert (result["correct"], result["n"]) == (expect, 3), memorized
    result = ev.lambada_accuracy(_oracle([ids]), 2, tok, texts, seq_length=8, progress=False)  # context cut left
    assert len(ids) - 1 > 8 and result["correct"] == 1 and result["seq_length"] == 8 and result["truncated"] >= 1


def test_an_older_checkpoints_unread_tokenizer_files_are_left_out():
    """Before tokenizer files the chosen type does not read were refused, a run with --tokenizer-type byte could
    save them in its config; it trained on bytes, and eval.py reads it so (the files need not exist)."""
    cfg = Config().replace(tokenizer_type="byte", vocab_file="gone/encoder.json", merge_file="gone/vocab.bpe",
                           vocab_size=257)
    assert ev.checkpoint_tokenizer(cfg).vocab_size == 257
    with pytest.raises(ValueError, match="does not read --vocab-file or --merge-file"):  # given as flags: refused
        ev.checkpoint_tokenizer(cfg, vocab_file="gone/encoder.json", merge_file="gone/vocab.bpe", tokenizer_type="byte")


def test_lambada_file_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine words"}\n{"txt": "x"}\n')
    with pytest.raises(ValueError, match="line 2"):
        ev.read_lambada(bad)
    with pytest.raises(ValueError, match="no such file"):
        ev.read_lambada(tmp_path / "missing.jsonl")


# ---- eval.py ----
def _cli(capsys, *argv):
    rc = eval_cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if rc == 0 else None), err


def test_dry_run_counts_wikitext_tokens(shared_data):
    path = shared_data / "wikitext-2/valid.txt"
    expected = len(path.read_text(encoding="utf-8").strip().split(" "))
    assert expected == 217642
    gpt2 = ["--vocab-file", str(shared_data / "gpt2/encoder.json"), "--merge-file", str(shared_data / "gpt2/vocab.bpe")]
    proc = subprocess.run([sys.executable, "eval.py", "wikitext", "--data-path", str(path), "--dry-run",
                           "--seq-length", "1024", "--overlapping-eval", "32", *gpt2],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["original_tokens"] == expected
    assert result["tokens"] == 243597  # GPT-2 BPE tokens after detokenization (T > T_o, as in the paper)
    assert result["windows"] == ev.num_windows(243597, 1024, 32) == 7582


def test_cli_wikitext_and_lambada_json(checkpoint, tmp_path, capsys, shared_data):
    text = (shared_data / "wikitext-2/valid.txt").read_text(encoding="utf-8")[:1500]
    (tmp_path / "wiki.txt").write_text(text, encoding="utf-8")
    rc, result, err = _cli(capsys, "wikitext", "--load", str(checkpoint), "--data-path", str(tmp_path / "wiki.txt"),
                           "--tensor-model-parallel-size", "2", "--overlapping-eval", "8")
    assert rc == 0, err
    t = len(wikitext_detokenize(text).encode("utf-8"))  # byte tokenizer: one token a byte
    assert result["tokens"] == t and result["scored_tokens"] == t - 1
    assert result["original_tokens"] == count_original_tokens(text)
    assert result["windows"] == ev.num_windows(t, 32, 8)
    assert abs(result["loss"] - np.log(257)) < 0.5  # an untrained model is near uniform over the 257 real ids
    assert np.isclose(np.log(result["adjusted_ppl"]), result["loss"] * (t - 1) / result["original_tokens"])
    rc, raw, _ = _cli(capsys, "wikitext", "--load", str(checkpoint), "--data-path", str(tmp_path / "wiki.txt"),
                      "--no-detokenize", "--dry-run")
    assert rc == 0 and raw["tokens"] == len(text.encode("utf-8"))

    lines = ['{"text": "the cat sat on the mat"}', '{"text": "one"}', '{"text": "a b c d e f g h i j k"}']
    (tmp_path / "l.jsonl").write_text("\n".join(lines) + "\n")
    rc, result, err = _cli(capsys, "lambada", "--load", str(checkpoint), "--data-path", str(tmp_path / "l.jsonl"),
                           "--pipeline-model-parallel-size", "2")
    assert rc == 0, err
    assert result["n"] == 3 and 0.0 <= result["accuracy"] <= 1.0 and result["target_tokens"] == 4 + 4 + 2


def test_a_batch_larger_than_the_examples_is_cut_to_them(checkpoint):
    """--micro-batch-size beyond the rows there are to score: the scorer compiles no batch larger than them (rounded
    up to the data ranks), where 100,000 rows for 13 windows allocated 52 GB once, after the model loaded."""
    model, params = load_model(str(checkpoint), micro_batch_size=100_000)
    dp = model.mesh.shape["data"]
    assert dp == 8 and ev.Scorer(model, params).batch_size == 100_000 * dp
    assert ev.Scorer(model, params, most=3).batch_size == dp  # 3 rows, one a rank at most
    assert ev.Scorer(model, params, most=20).batch_size == 24


@pytest.mark.parametrize("argv, needle", [
    (["wikitext", "--data-path", "x.txt"], "needs --load"),
    (["lambada", "--data-path", "x.jsonl"], "needs --load"),
    (["wikitext", "--load", "CKPT", "--data-path", "missing.txt"], "--data-path missing.txt: no such file"),
    (["wikitext", "--load", "CKPT", "--data-path", "WIKI", "--overlapping-eval", "64"], "--overlapping-eval 64"),
    (["wikitext", "--load", "CKPT", "--data-path", "WIKI", "--seq-length", "33"], "--seq-length 33"),
    (["wikitext", "--load", "CKPT", "--data-path", "WIKI", "--pipeline-model-parallel-size", "4"],
     "holds 2 layers, which do not split evenly over --pipeline-model-parallel-size 4; pass a size that divides 2"),
    # (was a message naming training's layout flags, which eval.py does not take)
    (["lambada", "--load", "CKPT", "--data-path", "WIKI"], "line 1 is not a JSON object"),
    (["generate", "--load", "CKPT", "--prompt", "hi", "--top-p", "0"], "--top-p"),
    (["generate", "--load", "CKPT", "--prompt", ""], "--prompt is empty"),
    (["generate", "--load", "CKPT", "--prompt", "hi", "--temperature", "0", "--top-k", "5"],
     "--top-k only acts with a --temperature above 0 (0 is greedy"),  # accepted once, the filter doing nothing
    (["generate", "--load", "CKPT", "--prompt", "\udcff\udcfe"], "--prompt '\\xff\\xfe' is not valid UTF-8; pass"),
    (["wikitext", "--load", "NOCKPT", "--data-path", "WIKI"], "holds no checkpoint"),
    (["wikitext", "--load", "CKPT", "--data-path", "WIKI", "--vocab-file", "GPT2"], "--merge-file"),
    (["wikitext", "--load", "CKPT", "--data-path", "EMPTY"], "holds only whitespace"),  # was: perplexity 1.0, exit 0
    (["wikitext", "--load", "CKPT", "--data-path", "SPACES"], "holds only whitespace"),  # original_tokens 1 once
    (["wikitext", "--load", "CKPT", "--data-path", "LONG"], "is JSON lines (LAMBADA's format)"),  # scored once
    (["wikitext", "--load", "CKPT", "--data-path", "NOCKPT"], "is a directory"),  # "no such file" once
    (["wikitext", "--load", "CKPT", "--data-path", "LATIN1"], "is not UTF-8 text"),
    (["lambada", "--load", "CKPT", "--data-path", "NUL"], "binary, not text"),
    (["lambada", "--load", "CKPT", "--data-path", "LONG", "--seq-length", "4"], "target word of 16 tokens"),
])
def test_cli_errors_are_one_line_with_exit_code_2(checkpoint, tmp_path, capsys, argv, needle):
    (tmp_path / "wiki.txt").write_text(" = A = \n b c . \n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "spaces.txt").write_text("  \n \t\n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (tmp_path / "nul.jsonl").write_bytes(b'{"text": "a b"}\x00\n')
    (tmp_path / "long.jsonl").write_text('{"text": "the word extraordinarily"}\n')  # bytes: 16 target tokens
    subs = {"CKPT": str(checkpoint), "NOCKPT": str(tmp_path), "WIKI": str(tmp_path / "wiki.txt"), "GPT2": "enc.json",
            **{name: str(tmp_path / f) for name, f in (("EMPTY", "empty.txt"), ("SPACES", "spaces.txt"),
                                                        ("LATIN1", "latin1.txt"),
                                                        ("NUL", "nul.jsonl"), ("LONG", "long.jsonl"))}}
    rc, _, err = _cli(capsys, *[subs.get(a, a) for a in argv])
    assert rc == 2 and err.startswith("error: ") and needle in err and err.count("\n") == 1, err


def test_cli_generate(checkpoint, capsys):
    import mtx.generate

    if "top_p" not in inspect.signature(mtx.generate.generate).parameters:
        pytest.skip("mtx.generate.generate has not yet the batched (prompts, max_new_tokens, top_p, eod) signature")
    rc, result, err = _cli(capsys, "generate", "--load", str(checkpoint), "--prompt", "The ", "--prompt", "A b",
                           "--max-new-tokens", "5", "--temperature", "0")
    assert rc == 0, err
    assert [s["prompt"] for s in result["samples"]] == ["The ", "A b"]
    assert all(0 < s["new_tokens"] <= 5 and isinstance(s["completion"], str) for s in result["samples"])


# ---- a Hugging Face tokenizer and Llama's blocks ----
WIKI = (" = Lobster = \n The European lobster , H. gammarus , is 3 @.@ 5 m long and well @-@ known . It lives in "
        "the sea ( 24 in deep ) . \n = = Life = = \n The lobster 's life is long ; it eats the fish . \n")
LAMBADA = ["the lobster lives in the sea", "It eats what the fish\neat", "one", "The sea is long and the lobster is "
           "well known for its claws"]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A tokenizer.json like Llama 2's (Hugging Face's conversion of its SentencePiece model): "▁" prepended to the
    text and for every space, BPE pieces learned within words, "</s>" the end of a document. -> its directory."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from mtx.data.dataset import builtin_corpus

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")  # learn pieces within words
    tok.train_from_iterator([builtin_corpus()[:20_000], WIKI, *LAMBADA],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.pre_tokenizer = None
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    folder = tmp_path_factory.mktemp("hf_tokenizer")
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_lambada_targets_are_the_words_ids_in_the_whole_text(hf_tokenizer):
    """Encoded alone, " claws" would start with a "▁" of its own; the target is the word's ids in the whole text."""
    tok = build_tokenizer(None, None, "HuggingFaceTokenizer", str(hf_tokenizer))
    ids, k = ev.lambada_tokens(tok, LAMBADA[3])
    assert ids == tok.encode(LAMBADA[3]) and tok.decode(ids[-k:]) == "claws"
    assert tok.encode(" claws") != ids[-k:] and tok.encode(" claws")[1:] == ids[-k:]
    ids, k = ev.lambada_tokens(tok, LAMBADA[1])  # the newline before the word is one space, as in Megatron
    assert ids == tok.encode("It eats what the fish eat") and tok.decode(ids[-k:]) == "eat"
    assert ev.lambada_tokens(tok, "one") == ([tok.eod, *tok.encode(" one")], len(tok.encode(" one")))


@pytest.fixture(scope="module")
def llama_checkpoint(hf_tokenizer, tmp_path_factory):
    """A tiny Llama (8 heads in 2 key/value groups, rope, RMSNorm, SwiGLU, no biases, untied output) trained 0 steps on
    text tokenized by `hf_tokenizer` (the checkpoint records the tokenizer)."""
    folder = tmp_path_factory.mktemp("llama")
    (folder / "corpus.txt").write_text(WIKI * 40, encoding="utf-8")
    cfg = Config().replace(**load_preset(ROOT / "configs/tiny.toml")).replace(
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True, group_query_attention=True,
        num_query_groups=2, untie_embeddings_and_output_weights=True, disable_bias_linear=True, train_iters=0,
        save=str(folder / "ckpt"), data_path=(str(folder / "corpus.txt"),), tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=str(hf_tokenizer), tensor_model_parallel_size=1, data_parallel_size=1)
    train(cfg, progress=False)
    return folder / "ckpt"


def test_wikitext_lambada_and_generate_with_a_hugging_face_tokenizer_on_a_llama(
        llama_checkpoint, hf_tokenizer, tmp_path, capsys):
    """The checkpoint's tokenizer (or the same one named by flags) on one device and with the 2 groups replicated over
    TP 4 in 2 pipeline stages: finite losses, the same numbers and the same greedy text on both meshes."""
    (tmp_path / "wiki.txt").write_text(WIKI * 3, encoding="utf-8")
    (tmp_path / "l.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LAMBADA))
    tokenizer_flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_tokenizer)]
    runs = []
    for mesh in ([], ["--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2", *tokenizer_flags]):
        common = ["--load", str(llama_checkpoint), *mesh]
        results = []
        for argv in (["wikitext", "--data-path", str(tmp_path / "wiki.txt"), "--overlapping-eval", "8"],
                     ["lambada", "--data-path", str(tmp_path / "l.jsonl")],
                     ["generate", "--prompt", "The lobster", "--max-new-tokens", "6", "--temperature", "0"]):
            rc, result, err = _cli(capsys, *argv, *common)
            assert rc == 0, err
            results.append(result)
        runs.append(results)
    (wiki, lam, gen), (wiki4, lam4, gen4) = runs
    tok = build_tokenizer(None, None, "HuggingFaceTokenizer", str(hf_tokenizer))
    t = len(tok.encode(wikitext_detokenize(WIKI * 3)))
    assert (wiki["tokens"], wiki["scored_tokens"], wiki["windows"]) == (t, t - 1, ev.num_windows(t, 32, 8))
    assert wiki["windows"] > 4 and lam["n"] == 4 and lam["target_tokens"] >= 4
    assert all(np.isfinite(x) for x in (wiki["loss"], wiki["ppl"], wiki["adjusted_ppl"], lam["target_loss"]))
    assert abs(wiki["loss"] - np.log(tok.vocab_size)) < 1.0  # an untrained model is near uniform
    for one, four in ((wiki, wiki4), (lam, lam4)):
        assert {k: v for k, v in one.items() if "loss" not in k and "ppl" not in k} == {
            k: v for k, v in four.items() if "loss" not in k and "ppl" not in k}
        for key in one.keys() & {"loss", "ppl", "adjusted_ppl", "target_loss"}:
            assert four[key] == pytest.approx(one[key], rel=1e-5), key
    assert gen == gen4 and gen["samples"][0]["new_tokens"] == 6
