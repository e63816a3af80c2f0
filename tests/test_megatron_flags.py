"""Megatron's everyday flags: sample counts, the warmup fraction, the recompute alias, profiling, the multi-host
timeout, the document flags of packed GPT samples (the numbers, and the same losses on two meshes), the mock data
and the NullTokenizer."""

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mtx.cli import build_parser, parse_config
from mtx.presets import load_preset
from mtx.schema_checks import MEGATRON_NEEDLESS, MEGATRON_UNIMPLEMENTED
from mtx.config import Config
from mtx.data.documents import document_fields
from mtx.data.indexed import IndexedDataset
from mtx.data.preprocess import main as preprocess
from mtx.evaluation import make_scorer
from mtx.models.transformer import attention_core, fused_attention
from mtx.parallel.mesh import DATA, PIPELINE, make_mesh
from mtx.run import prepare, train
from mtx.sharded_model import ShardedModel

TINY = Config().replace(**load_preset("configs/tiny.toml"), hidden_dropout=0.0, attention_dropout=0.0)
DOCS = dict(eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
EOD = 256  # the byte tokenizer's end-of-document id


def test_sample_counts_and_warmup_fraction_become_steps():
    cfg = parse_config(["--global-batch-size", "32", "--train-samples", "3200", "--lr-decay-samples", "1600",
                        "--lr-warmup-fraction", "0.1", "--recompute-activations"]).validate()
    t, o = cfg.training, cfg.optimizer
    assert (t.train_iters, o.lr_decay_iters, o.lr_warmup_iters) == (100, 50, 5)  # 0.1 of the 50 decay steps
    assert t.recompute_granularity == "selective"
    assert Config.from_dict(cfg.to_dict()) == cfg  # a saved config reloads (its derived counts recomputed)
    cfg = parse_config(["--global-batch-size", "8", "--train-iters", "40", "--lr-warmup-samples", "20"])
    assert (cfg.training.train_iters, cfg.optimizer.lr_warmup_iters) == (40, 2)  # rounded down, as Megatron's
    assert parse_config(["--train-iters", "90", "--lr-warmup-fraction", "0.25"]).optimizer.lr_warmup_iters == 22


def test_a_count_on_the_command_line_replaces_the_presets_way_of_setting_it():
    """The 1.2B preset sets train_iters and lr_warmup_iters: --lr-warmup-fraction or --train-samples on the command
    line replace them (flags override a preset), where both in one place stay refused (below)."""
    preset = str(Path(__file__).resolve().parent.parent / "configs" / "gpt_1.2b.toml")
    cfg = parse_config(["--config", preset, "--lr-warmup-fraction", "0.1"])
    assert cfg.optimizer.lr_warmup_fraction == 0.1 and cfg.optimizer.lr_warmup_iters == 30000  # of 300,000 steps
    cfg = parse_config(["--config", preset, "--train-samples", "3200", "--global-batch-size", "32"])
    assert cfg.training.train_iters == 100
    with pytest.raises(ValueError, match="--lr-warmup-fraction sets --lr-warmup-iters; pass only one"):
        parse_config(["--config", preset, "--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"])


@pytest.mark.parametrize("flags, message", [
    (dict(train_samples=64, train_iters=3), "--train-samples sets --train-iters; pass only one"),
    (dict(lr_decay_samples=64, lr_decay_iters=3), "--lr-decay-samples sets --lr-decay-iters"),
    (dict(lr_warmup_fraction=0.1, lr_warmup_iters=3), "--lr-warmup-fraction sets --lr-warmup-iters"),
    (dict(lr_warmup_fraction=0.1, lr_warmup_samples=32), "--lr-warmup-fraction and --lr-warmup-samples"),
    (dict(lr_decay_samples=8), "--lr-decay-samples 8 is less than one --global-batch-size 32"),
    (dict(train_samples=8), "--train-samples 8 is less than one --global-batch-size 32"),  # trained 0 steps, exit 0
    (dict(lr_warmup_samples=8), "--lr-warmup-samples 8 is less than one --global-batch-size 32"),
    (dict(profile=True, train_iters=3), "--profile traces steps 11..12, beyond --train-iters 3"),  # wrote nothing
    (dict(fp16=True, min_loss_scale=1e6, initial_loss_scale=2.0),
     "--min-loss-scale 1e+06 is above --initial-loss-scale 2"),
    (dict(lr_warmup_fraction=1.5), "--lr-warmup-fraction must be in [0, 1], got 1.5"),
    (dict(train_samples=-1), "--train-samples must be >= 0"),
    (dict(recompute_activations=True, recompute_granularity="full"), "alias of --recompute-granularity selective"),
    (dict(profile=True, profile_step_start=5, profile_step_end=5), "--profile-step-end 5 must be after"),
    (dict(distributed_timeout_minutes=0), "--distributed-timeout-minutes must be >= 1"),
    (dict(eod_mask_loss=True, model_type="bert", vocab_file="v.txt"), "--eod-mask-loss acts on GPT's packed"),
    (dict(tokenizer_type="HuggingFaceTokenizer"), "--tokenizer-model DIR"),
    (dict(tokenizer_model="tok/"), "--tokenizer-type HuggingFaceTokenizer and --tokenizer-model"),
])
def test_megatron_flags_in_conflict_are_refused(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Config().replace(**flags).validate()


def test_unimplemented_megatron_flags_say_so(tmp_path):
    preset = tmp_path / "moe.toml"
    preset.write_text("hidden_size = 64\nnum_experts = 4\n")  # in a preset too (was "unknown field")
    with pytest.raises(ValueError, match="sets num_experts: Megatron-LM's --num-experts: mtx does not implement it; "
                                         "remove it.$"):
        parse_config(["--config", str(preset)])
    preset.write_text("log_throughput = true\n")  # what mtx always does: refused with what it does instead
    with pytest.raises(ValueError, match="sets log_throughput: Megatron-LM's --log-throughput: mtx always logs it"):
        parse_config(["--config", str(preset)])
    parse_config(["--recompute-activations", "--eod-mask-loss", "--profile", "--position-embedding-type", "rope",
                  "--use-rope-scaling"])  # implemented
    with pytest.raises(ValueError, match="Megatron-LM's --num-experts: mtx does not implement it; remove it.$"):
        parse_config(["--num-experts", "8", "--lr", "1e-3"])
    with pytest.raises(ValueError, match="--rotary-interleaved, --profile-ranks: mtx does not implement them"):
        parse_config(["--swiglu", "--rotary-interleaved", "--profile-ranks", "0"])  # --swiglu is implemented
    with pytest.raises(ValueError, match="py: Megatron-LM's --num-experts: mtx does not implement it; remove it. "
                                         "Megatron-LM's --use-mcore-models: mtx has one model implementation; "
                                         "remove it. "
                                         "Megatron-LM's --no-bias-dropout-fusion: a switch of Megatron's CUDA kernels"):
        parse_config(["--use-mcore-models", "--num-experts", "2", "--no-bias-dropout-fusion"])
    with pytest.raises(ValueError, match="--apply-query-key-layer-scaling: mtx's attention scores are float32"):
        parse_config(["--apply-query-key-layer-scaling"])  # (the scores' einsum: preferred_element_type float32)
    with pytest.raises(ValueError, match="did you mean --hidden-size"):
        parse_config(["--hiden-size", "8"])
    mtx_flags = {s for action in build_parser()._actions for s in action.option_strings}
    assert not (MEGATRON_UNIMPLEMENTED | MEGATRON_NEEDLESS.keys()) & mtx_flags
    assert not MEGATRON_UNIMPLEMENTED & MEGATRON_NEEDLESS.keys()


def test_distributed_timeout_minutes_is_jax_initialization_timeout(monkeypatch):
    from mtx import distributed

    seen = {}
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: seen.update(kw))
    distributed.initialize_from(Config().replace(coordinator_address="h:1", num_processes=2, process_id=0,
                                                 distributed_timeout_minutes=7).parallel)
    assert seen["initialization_timeout"] == 7 * 60 and seen["heartbeat_timeout_seconds"] == 2 * 100 + 10  # backstop
    distributed.initialize_from(Config().replace(coordinator_address="h:1", num_processes=2, process_id=0).parallel)
    assert seen["initialization_timeout"] == 100  # without it: as before, max(--distributed-timeout, 60)
    # train.py and eval.py pass it on (stopped right after joining, before any device work)
    import eval as eval_script
    import train as train_script

    def join_then_stop(*a, **kw):
        seen.update(kw)
        raise ValueError("stopped after joining")

    monkeypatch.setattr(jax.distributed, "initialize", join_then_stop)
    flags = ["--coordinator-address", "h:1", "--num-processes", "2", "--process-id", "0",
             "--distributed-timeout-minutes", "3"]
    for main, argv in ((train_script.main, flags), (eval_script.main, ["wikitext", "--data-path", "x", *flags])):
        seen.clear()
        assert main(argv) == 2 and seen["initialization_timeout"] == 3 * 60


def test_document_fields_by_hand():
    tokens = np.array([[5, EOD, 7, 8, EOD, 3, 4], [1, 2, 3, 4, 5, 6, 7]])  # (G, S + 1): inputs are the first 6
    f = document_fields(tokens, EOD, **DOCS)
    np.testing.assert_array_equal(f["loss_mask"], [[1, 0, 1, 1, 0, 1], [1] * 6])
    np.testing.assert_array_equal(f["position_ids"], [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(f["segments"], [[1, 1, 2, 2, 2, 3], [1] * 6])
    assert set(document_fields(tokens, EOD, reset_position_ids=True)) == {"tokens", "position_ids"}


def test_attention_does_not_cross_segments():
    q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 6, 2, 4))
    segments = jnp.array([[1, 1, 2, 2, 2, 3]])
    out = attention_core(q, k, v, mask_BS=segments)
    k2, v2 = k.at[:, :2].set(9.0), v.at[:, :2].set(-9.0)  # document 1's keys and values changed
    again = attention_core(q, k2, v2, mask_BS=segments)
    np.testing.assert_allclose(again[:, 2:], out[:, 2:], rtol=1e-6)
    assert not np.allclose(again[:, :2], out[:, :2])
    # one segment: plain causal attention
    np.testing.assert_allclose(attention_core(q, k, v, mask_BS=jnp.ones((1, 6), jnp.int32)), attention_core(q, k, v),
                               rtol=1e-6)
    # --use-flash-attn (on in the GPU presets) keeps the documents apart too: XLA's attention with the full mask
    np.testing.assert_allclose(fused_attention(q, k, v, mask_BS=segments), out, rtol=1e-5, atol=1e-6)
    Config().replace(reset_attention_mask=True, use_flash_attn=True).validate()


def _hidden(model, params, batch):
    """Final hidden states (B, S, D) of a batch through the objective's embedding and mask, on one device."""
    def local(p, b):
        m, objective = model.merge(p), model.objective
        x = m.transform(objective.embed(m, b, None), mask_BS=objective.attention_mask(b))
        return jax.lax.pmean(m.final_hidden(x), PIPELINE)

    return np.asarray(jax.jit(jax.shard_map(local, mesh=model.mesh, in_specs=(model.param_specs, P(DATA)),
                                            out_specs=P(DATA)))(params, model.put_batch(batch)))


@pytest.mark.parametrize("blocks", [{}, {"position_embedding_type": "rope"}])
def test_a_packed_document_reads_as_if_alone(blocks):
    """Rotary positions need no restart: within a document only their differences count (the config allows
    --reset-position-ids with rope only beside --reset-attention-mask)."""
    model = ShardedModel(TINY.replace(tensor_model_parallel_size=1, global_batch_size=2, **blocks),
                         make_mesh(1, 1, 1))
    params = model.init_params()
    rng = np.random.default_rng(0)
    doc1, doc2 = rng.integers(0, 256, (2, 12))
    packed = np.concatenate([doc1, [EOD], doc2, rng.integers(0, 256, 20)])[None, :33]
    other = packed.copy()
    other[0, :12] = rng.integers(0, 256, 12)  # document 1 rewritten
    alone = np.concatenate([doc2, rng.integers(0, 256, 21)])[None]
    batch = lambda t, **flags: document_fields(np.repeat(t, 2, 0), EOD, **flags)
    h = _hidden(model, params, batch(packed, **DOCS))[0, 13:25]  # document 2's states
    np.testing.assert_allclose(_hidden(model, params, batch(other, **DOCS))[0, 13:25], h, atol=1e-5)
    np.testing.assert_allclose(_hidden(model, params, batch(alone, **DOCS))[0, :12], h, atol=1e-5)
    # without the document mask, document 1 is seen
    no_mask = dict(reset_position_ids=True)
    assert not np.allclose(_hidden(model, params, batch(other, **no_mask))[0, 13:25],
                           _hidden(model, params, batch(packed, **no_mask))[0, 13:25], atol=1e-3)


def test_eod_masked_loss_is_the_mean_over_the_weighted_tokens():
    model = ShardedModel(TINY.replace(tensor_model_parallel_size=2, global_batch_size=4, micro_batch_size=2),
                         make_mesh(2, 1, 2))
    params = model.init_params()
    tokens = np.random.default_rng(1).integers(0, 256, (4, 33))
    tokens[:, [3, 10, 11, 20]] = EOD
    batch = document_fields(tokens, EOD, eod_mask_loss=True)
    inputs = [model.put_batch(a) for a in (tokens[:, :-1], tokens[:, 1:], np.ones((4, 32), np.int32))]
    nll, _ = make_scorer(model)(params, *inputs)
    weights = batch["loss_mask"]
    assert weights.sum() == 4 * (32 - 4)
    expected = (np.asarray(nll, np.float64) * weights).sum() / weights.sum()
    np.testing.assert_allclose(float(model.eval_loss(params, model.put_batch(batch))), expected, rtol=1e-5)
    assert abs(float(model.eval_loss(params, model.put_batch(tokens))) - expected) > 1e-4  # the mask matters


@pytest.fixture(scope="module")
def packed_corpus(tmp_path_factory):
    """Byte tokens of documents 3 to 20 tokens long, each ended by EOD: several documents a 32-token sample."""
    rng = np.random.default_rng(2)
    docs = [np.append(rng.integers(97, 123, rng.integers(3, 21)), EOD) for _ in range(1200)]
    path = tmp_path_factory.mktemp("docs") / "docs.npy"
    np.save(path, np.concatenate(docs).astype(np.int32))
    return str(path)


def test_document_flags_give_the_same_losses_on_two_meshes(tmp_path, packed_corpus):
    curves = {}
    for name, (dp, pp, tp, sp) in {"dp2": (2, 1, 1, False), "pp2tp2sp": (1, 2, 2, True)}.items():
        cfg = TINY.replace(data_path=(packed_corpus,), train_iters=3, log_interval=1, data_parallel_size=dp,
                           pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp, sequence_parallel=sp,
                           run_dir=str(tmp_path / name), **DOCS)
        r = train(cfg, progress=False)
        curves[name] = np.array([r.losses[s] for s in (1, 2, 3)])
    np.testing.assert_allclose(curves["pp2tp2sp"], curves["dp2"], rtol=1e-5)
    plain = train(TINY.replace(data_path=(packed_corpus,), train_iters=1, tensor_model_parallel_size=1,
                               data_parallel_size=2, run_dir=str(tmp_path / "plain")), progress=False)
    assert abs(plain.losses[1] - curves["dp2"][0]) > 1e-3  # the flags change the loss


def test_profile_traces_the_asked_steps_and_stops_early_runs(tmp_path):
    cfg = TINY.replace(train_iters=4, tensor_model_parallel_size=1, data_parallel_size=1, profile=True,
                       profile_step_start=1, profile_step_end=3, run_dir=str(tmp_path / "p"))
    train(cfg, progress=False)
    assert list((tmp_path / "p" / "profile").rglob("*.xplane.pb"))
    stopped = cfg.replace(exit_interval=2, profile_step_end=4, run_dir=str(tmp_path / "q"),
                          tensorboard_dir=str(tmp_path / "tb"))
    assert train(stopped, progress=False).stopped
    assert list((tmp_path / "tb").rglob("*.xplane.pb"))  # written when the run stopped inside the window
    jax.profiler.start_trace(str(tmp_path / "after"))  # and no trace is left running
    jax.profiler.stop_trace()


def test_mock_data_is_megatrons_documents():
    from mtx.data.build import mock_documents
    from mtx.data.tokenizer import ByteTokenizer

    tokens, offsets = mock_documents(ByteTokenizer(), 8, seed=0, documents=50)
    assert offsets[0] == 0 and len(offsets) == 51 and offsets[-1] == len(tokens)
    for start, end in zip(offsets[:-1], offsets[1:]):  # 1, 2, ..., n - 1, end-of-document; 1 <= n < 8
        assert 1 <= end - start < 8 and list(tokens[start:end]) == [*range(1, end - start), 256]
    np.testing.assert_array_equal(mock_documents(ByteTokenizer(), 8, seed=0, documents=50)[0], tokens)
    assert mock_documents(ByteTokenizer(), 300, seed=1)[0].max() == 256  # ids past the bytes wrap below eod


def test_mock_data_trains_alike_on_two_meshes_and_is_refused_beside_data(tmp_path):
    curves = []
    for dp, pp, tp in ((1, 1, 1), (2, 2, 2)):
        r = train(TINY.replace(mock_data=True, train_iters=3, eval_interval=2, eval_iters=1, data_parallel_size=dp,
                               pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                               run_dir=str(tmp_path / f"{dp}{pp}{tp}")), progress=False)
        curves.append([r.losses[s] for s in (1, 2, 3)])
    np.testing.assert_allclose(curves[1], curves[0], rtol=1e-5)
    for argv, match in ((["--mock-data", "--data-path", "a.txt"], "--mock-data and --data-path both give data"),
                        (["--mock-data", "--model-type", "bert"], "--mock-data is GPT's")):
        with pytest.raises(ValueError, match=match):
            parse_config(argv).validate()


def test_null_tokenizer_reads_ids_and_refuses_words():
    from mtx.data.build import mock_documents
    from mtx.data.tokenizer import build_tokenizer

    tok = build_tokenizer(None, None, "NullTokenizer", vocab_size=10)
    assert (tok.vocab_size, tok.eod) == (11, 10)  # Megatron's: end-of-document one id past --vocab-size
    assert tok.encode("3 4  5\n10\t0") == [3, 4, 5, 10, 0] and tok.decode([3, 4, 10]) == "3 4 10"
    assert tok.encode("007 0000000000000000000001") == [7, 1]  # leading zeros are digits too
    for text in ("3 x", "11", "-1", "²", "9" * 30, "+5"):
        with pytest.raises(ValueError, match=r"NullTokenizer reads text as token ids \(decimal digits\) between "
                                             "spaces, each 0 to 10,"):
            tok.encode(text)
    for kwargs, match in (({}, "needs --vocab-size N >= 1"), ({"vocab_size": 0}, "needs --vocab-size N >= 1")):
        with pytest.raises(ValueError, match=match):
            build_tokenizer(None, None, "NullTokenizer", **kwargs)
    with pytest.raises(ValueError, match="NullTokenizer does not read --vocab-file; drop it"):
        build_tokenizer("encoder.json", None, "NullTokenizer", vocab_size=10)
    with pytest.raises(ValueError, match="the built-in corpus is read byte by byte; pass --mock-data or --data-path"):
        train(TINY.replace(tokenizer_type="NullTokenizer", vocab_size=300), progress=False)
    with pytest.raises(ValueError, match="NullTokenizer does not read --tokenizer-model; drop it"):
        build_tokenizer(None, None, "NullTokenizer", "tok/", vocab_size=10)
    for preset in ([], ["--config", "configs/llama_1b.toml"]):  # (a preset's vocab_size is its tokenizer's)
        with pytest.raises(ValueError, match="^--tokenizer-type NullTokenizer needs --vocab-size N"):  # (Megatron's)
            parse_config(["--mock-data", "--tokenizer-type", "NullTokenizer", *preset])
    tokens, offsets = mock_documents(tok, 64, seed=0, documents=20)  # long documents wrap below end-of-document
    inside = np.delete(tokens, offsets[1:] - 1)
    assert inside.min() == 1 and inside.max() == 9 and (tokens[offsets[1:] - 1] == 10).all()
    with pytest.raises(ValueError, match="--mock-data counts 1, 2, ... in ids other than end-of-document"):
        mock_documents(build_tokenizer(None, None, "NullTokenizer", vocab_size=1), 8, seed=0)
    with pytest.raises(ValueError, match="pads the vocabulary of 2,147,483,000 ids .*pass a smaller --vocab-size"):
        TINY.replace(vocab_size=2_147_483_000).validate()


def test_null_tokenizer_trains_resumes_and_scores_from_its_checkpoint(tmp_path, capsys):
    from mtx.evaluation import checkpoint_config, checkpoint_tokenizer

    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str(i % 300) for i in range(4000)))
    null = TINY.replace(tokenizer_type="NullTokenizer", vocab_size=300, train_iters=4, lr_decay_iters=4, log_interval=1)
    whole = train(null.replace(mock_data=True, generate_tokens=3, run_dir=str(tmp_path / "whole")), progress=False)
    assert all(0 <= int(i) <= 300 for i in whole.sample.split())  # the sample starts a document: no words to prompt
    out = capsys.readouterr()
    assert "(vocab 301 padded to 1024)" in out.out and "replaced by the tokenizer" not in out.err
    train(null.replace(mock_data=True, train_iters=2, save=str(tmp_path / "ckpt")), progress=False)
    resumed = null.replace(mock_data=True, load=str(tmp_path / "ckpt"), run_dir=str(tmp_path / "r"))
    resumed = train(resumed, progress=False)
    np.testing.assert_allclose([resumed.losses[s] for s in (3, 4)], [whole.losses[s] for s in (3, 4)], rtol=1e-6)
    saved = checkpoint_config(str(tmp_path / "ckpt"), None)
    tok = checkpoint_tokenizer(saved)  # the checkpoint's: the saved vocabulary counts the end-of-document id
    assert (tok.name, tok.vocab_size, tok.eod) == ("null", 301, 300)
    with pytest.raises(ValueError, match=r"trained with \(--tokenizer-type NullTokenizer --vocab-size 300\)"):
        train(null.replace(mock_data=True, vocab_size=299, load=str(tmp_path / "ckpt")), progress=False)
    text = train(null.replace(data_path=(str(ids),), train_iters=1, run_dir=str(tmp_path / "t")), progress=False)
    assert np.isfinite(text.losses[1])  # a text of ids is read as Megatron's NullTokenizer reads one
    null_flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]
    docs = tmp_path / "ids.jsonl"
    docs.write_text("".join(json.dumps({"text": " ".join(map(str, range(k, k + 100)))}) + "\n" for k in (0, 200)))
    prefix = preprocess(["--input", str(docs), "--output-prefix", str(tmp_path / "p"), "--append-eod", *null_flags])
    np.testing.assert_array_equal(IndexedDataset(prefix[0]).tokens, [*range(100), 300, *range(200, 300), 300])
    for drop in ([0, 1], [2, 3]):  # preprocess's --vocab-size is NullTokenizer's, and NullTokenizer needs it
        with pytest.raises(SystemExit):
            preprocess(["--input", str(ids), "--output-prefix", str(tmp_path / "q"),
                        *[f for i, f in enumerate(null_flags) if i not in drop]])
        assert "--vocab-size is NullTokenizer's and NullTokenizer needs it" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"^--data-path {ids}: NullTokenizer reads text as token ids"):
        ids.write_text("1 2 three")
        train(null.replace(data_path=(str(ids),), train_iters=1), progress=False)
    capsys.readouterr()
    prepare(null.replace(vocab_size=400, data_path=tuple(prefix), run_dir=str(tmp_path / "e")))  # made at 300
    assert f"every document of --data-path {prefix[0]} ends in id 300, and this tokenizer's end-of-document is 400" \
        in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"drop the tokenizer flags \(the checkpoint's own is then read: "
                                         "--tokenizer-type NullTokenizer --vocab-size 300"):
        checkpoint_tokenizer(saved, tokenizer_type="byte")
    import eval as eval_script

    assert eval_script.main(["generate", "--load", str(tmp_path / "ckpt"), "--prompt", "1", "--vocab-size", "300"]) == 2
    assert "--vocab-size: train.py's; eval.py trains nothing and reads its model from --load's checkpoint; drop it." \
        in capsys.readouterr().err


def test_manual_gc_collects_where_megatron_does_and_restores_the_collector(tmp_path, monkeypatch):
    import gc

    from mtx import loop_controls

    seen = []
    monkeypatch.setattr(loop_controls, "_collect", lambda generation=2: seen.append((generation, gc.isenabled())))
    runs = TINY.replace(train_iters=4, eval_interval=2, eval_iters=1, split="90,10,0", manual_gc=True,
                        manual_gc_interval=3)
    train(runs.replace(run_dir=str(tmp_path / "a")), progress=False)
    # the start; before the validation of step 2 and, of what it made, after; step 3; the validation of step 4
    assert seen == [(2, False), (2, False), (0, False), (2, False), (2, False), (0, False)] and gc.isenabled()
    seen.clear()
    gc.disable()  # off before: off after
    try:
        train(runs.replace(manual_gc_eval=False, run_dir=str(tmp_path / "b")), progress=False)
        assert len(seen) == 2 and not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ValueError, match="--manual-gc-interval .*--manual-gc"):
        parse_config(["--manual-gc-interval", "5"]).validate()
