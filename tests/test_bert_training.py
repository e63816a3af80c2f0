"""BERT end to end: the mesh does not change the math (data, pipeline and tensor parallelism, both LayerNorm
placements), it learns, evaluates, resumes, and bad input fails in one line before any device work."""

import json
import sys

import jax
import numpy as np
import pytest

from mtx.config import Config
from mtx.parallel import make_mesh
from mtx.presets import load_preset
from mtx.run import prepare, train
from mtx.state import state_shardings
from mtx.step import TrainStep

EXACT = dict(hidden_dropout=0.0, attention_dropout=0.0)


@pytest.fixture(scope="module")
def tiny(bert_toy):
    vocab, corpus = bert_toy
    return Config().replace(**load_preset("configs/bert_tiny.toml")).replace(
        seq_length=32, vocab_file=str(vocab), data_path=(str(corpus),), eval_interval=0, lr_warmup_iters=2)


def curve(result, steps):
    return np.array([result.losses[s] for s in steps])


def run(cfg, mesh, tmp_path, name, **flags):
    dp, pp, tp = mesh
    where = {} if "save" in flags else {"run_dir": str(tmp_path / name)}  # --save is the run directory then
    return train(cfg.replace(data_parallel_size=dp, pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                             train_iters=10, log_interval=5, **where, **flags), progress=False)


def direct_curve(cfg, mesh, steps=10):
    """The training losses of `steps` steps on `mesh`, the loop of mtx.run without its files. The initial state is
    built once per config on one device and placed on each mesh: it does not depend on the mesh (docs/design.md,
    decision 2; tests/test_training.py), and building it costs more than a step's compile on CPU."""
    dp, pp, tp = mesh
    plan = prepare(cfg.replace(run_dir="unused", train_iters=steps))
    train_step = TrainStep.build(plan.cfg.replace(data_parallel_size=dp, pipeline_model_parallel_size=pp,
                                                  tensor_model_parallel_size=tp),
                                 make_mesh(dp, pp, tp, devices=jax.devices()[: dp * pp * tp]))
    if plan.cfg not in _INITIAL:
        _INITIAL[plan.cfg] = jax.device_get(
            TrainStep.build(plan.cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1])).init_state())
    state = jax.device_put(_INITIAL[plan.cfg], state_shardings(train_step.model))
    losses = []
    for step in range(steps):
        state, metrics = train_step(state, train_step.model.put_batch(plan.dataset.batch("train", step, 16)))
        losses.append(metrics["loss"])
    return np.asarray(jax.device_get(losses))


_INITIAL = {}


def test_pre_layernorm_loss_is_the_same_on_every_mesh_and_resumes(tiny, tmp_path):
    """fp32, no dropout: 10 steps agree on five meshes. The (2, 2, 2) run is a full `train` that also evaluates
    (validation MLM + SOP loss) and saves at step 5; resuming that checkpoint on (4, 1, 2) continues the curve (with
    Megatron's every-position MLM head: where the head runs is the step's choice, not the checkpoint's)."""
    cfg = tiny.replace(split="90,10,0", **EXACT)
    curves = {mesh: direct_curve(cfg, mesh) for mesh in [(1, 1, 1), (2, 1, 4), (1, 2, 2)]}
    curves["(2, 1, 4), sequence parallel"] = direct_curve(cfg.replace(sequence_parallel=True, micro_batch_size=4),
                                                          (2, 1, 4))
    full = run(cfg, (2, 2, 2), tmp_path, "full", save=str(tmp_path / "ckpt"), save_interval=5, eval_interval=5,
               eval_iters=1, generate_tokens=20)
    curves[(2, 2, 2)] = curve(full, range(1, 11))
    resumed = run(cfg, (4, 1, 2), tmp_path, "resumed", load=str(tmp_path / "ckpt"), ckpt_step=5,
                  mlm_head_positions="all")
    assert min(resumed.losses) == 6
    curves[(4, 1, 2)] = np.concatenate([curves[(2, 2, 2)][:5], curve(resumed, range(6, 11))])
    reference = curves[(1, 1, 1)]
    for mesh, c in curves.items():
        np.testing.assert_allclose(c, reference, rtol=1e-5, err_msg=f"pre-LN on (data, pipeline, model) {mesh}")
    assert reference[-1] < reference[0] - 0.1, reference  # and it is learning
    assert full.sample is None  # BERT generates no sample
    records = [json.loads(x) for x in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    vals = [x["val_loss"] for x in records if "val_loss" in x]
    assert len(vals) == 2 and np.all(np.isfinite(vals)) and vals[1] < vals[0], vals


def test_post_layernorm_with_dropout_is_the_same_on_every_mesh(tiny):
    """Dropout masks follow the sequence (and head), not the device, so even with dropout the meshes agree, also with
    each microbatch's rows split over "model" (sequence parallelism, pipelined)."""
    cfg = tiny.replace(layernorm_placement="post", hidden_dropout=0.1, attention_dropout=0.1)
    one, many = direct_curve(cfg, (1, 1, 1)), direct_curve(cfg, (2, 2, 2))
    np.testing.assert_allclose(many, one, rtol=1e-5, err_msg="post-LN with dropout on (2, 2, 2)")
    sp = direct_curve(cfg.replace(sequence_parallel=True, micro_batch_size=4), (1, 2, 4))
    np.testing.assert_allclose(sp, one, rtol=1e-5, err_msg="post-LN with dropout, sequence parallel on (1, 2, 4)")
    assert one[-1] < one[0] - 0.1, one


def test_mlm_head_at_the_masked_positions_only_equals_every_position(tiny):
    """--mlm-head-positions masked (the default: the head runs at each sequence's masked positions only) trains the
    curve of Megatron's every-position head, on one device and on (2, 1, 2) with sequence parallelism."""
    cfg = tiny.replace(**EXACT)
    everywhere = direct_curve(cfg.replace(mlm_head_positions="all"), (1, 1, 1), steps=4)
    np.testing.assert_allclose(direct_curve(cfg, (1, 1, 1), steps=4), everywhere, rtol=1e-5)
    sp = direct_curve(cfg.replace(sequence_parallel=True, micro_batch_size=4), (2, 1, 2), steps=4)
    np.testing.assert_allclose(sp, everywhere, rtol=1e-5)


def test_no_sequence_masks_more_positions_than_the_head_runs_at(tiny):
    """The masked-only head reads round-up(--mask-prob x S) positions a sequence: BERT's dataset never masks more,
    whatever the sequence length, mask rate and short-sequence draws."""
    for seq_length, mask_prob in [(32, 0.15), (45, 0.15), (64, 0.3), (33, 0.02)]:
        cfg = tiny.replace(seq_length=seq_length, max_position_embeddings=64, mask_prob=mask_prob,
                           short_seq_prob=0.5)
        dataset = prepare(cfg.replace(run_dir="unused", train_iters=1)).dataset
        masked = np.concatenate([dataset.batch("train", i, 64)["loss_mask"].sum(axis=1) for i in range(4)])
        assert masked.max() <= cfg.mlm_positions, (seq_length, mask_prob, masked.max(), cfg.mlm_positions)
        assert masked.max() >= int(mask_prob * (seq_length - 3))  # nearly tight: [CLS] A [SEP] B [SEP] is full


# ---- bad input: one line naming the fix, exit code 2, nothing touched ----

def main(argv):
    sys.path.insert(0, ".")
    import train as train_script

    return train_script.main(argv)


@pytest.mark.parametrize("flags,needle", [
    (["--layernorm-placement", "middle"], "--layernorm-placement must be pre or post"),
    (["--model-type", "t5"], "--model-type must be gpt or bert"),
    (["--tokenizer-type", "GPT2BPETokenizer"], "--model-type bert needs BERT's WordPiece"),
    (["--merge-file", "vocab.bpe"], "--model-type bert needs BERT's WordPiece"),
    (["--num-tokentypes", "1"], "--bert-no-binary-head"),
    (["--mask-prob", "1.5"], "--mask-prob"),
    (["--data-path", "0.5", "a.txt", "0.5", "b.txt"], "does not blend"),
    (["--data-path", "no/such/file.txt"], "no/such/file.txt"),
])
def test_bad_bert_input_is_one_line(flags, needle, bert_toy, tmp_path, capsys):
    argv = ["--config", "configs/bert_tiny.toml", "--vocab-file", str(bert_toy[0]), "--run-dir", str(tmp_path / "r")]
    assert main(argv + flags) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and err.startswith("error: ") and "\n" not in err, err
    assert not (tmp_path / "r").exists()


def test_post_layernorm_gpt_and_a_gpt2_vocab_are_refused(tmp_path, capsys, shared_data):
    assert main(["--config", "configs/tiny.toml", "--layernorm-placement", "post", "--run-dir", str(tmp_path)]) == 2
    assert "only implemented for --model-type bert" in capsys.readouterr().err
    assert main(["--config", "configs/bert_tiny.toml", "--vocab-file", str(shared_data / "gpt2" / "encoder.json"),
                 "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a BERT WordPiece vocab.txt" in err and "\n" not in err


def test_builtin_corpus_needs_a_vocab(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MTX_DATA_DIR", str(tmp_path / "nothing"))
    assert main(["--config", "configs/bert_tiny.toml", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--vocab-file" in err and "\n" not in err


def test_eval_and_to_hf_refuse_a_model_that_is_no_causal_lm(tiny, tmp_path, capsys):
    """A BERT checkpoint given to eval.py or to-hf: one line before any array is read (eval.py
    once failed in the model with a traceback, to-hf wrote BERT's weights as a GPT2LMHeadModel)."""
    from pathlib import Path

    import eval as eval_cli
    from mtx.convert import to_hf

    root = Path(__file__).resolve().parents[1]
    train(tiny.replace(train_iters=1, save=str(tmp_path / "bert")), progress=False)
    for task in (["generate", "--prompt", "the"], ["wikitext", "--data-path", str(root / "README.md")]):
        assert eval_cli.main([*task, "--load", str(tmp_path / "bert")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "holds a BERT model" in err and "--model-type gpt" in err, err
    with pytest.raises(ValueError, match="holds a BERT model; to-hf writes causal language models only"):
        to_hf(tmp_path / "bert", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
