"""BERT's presets and parameter arithmetic (paper Table 4), its flags, and its golden parameter layout."""

import os
from pathlib import Path

import jax
import pytest
from flax import nnx

from mtx.cli import parse_config
from mtx.config import Config, ModelConfig
from mtx.parallel.sharded import partition_specs, split_abstract
from mtx.presets import load_preset
from mtx.sharded_model import build_model

GOLDEN = Path(__file__).parent / "golden" / "bert_tiny_params.txt"


@pytest.mark.parametrize("name,size,exact", [("bert_336m", "336M", 336_429_058), ("bert_1.3b", "1.3B", 1_281_001_474),
                                             ("bert_3.9b", "3.9B", 3_869_588_482)])
def test_paper_table4_sizes(name, size, exact):
    m = Config().replace(**load_preset(f"configs/{name}.toml")).model
    assert m.num_params() == exact
    shown = f"{m.num_params() / 1e6:.0f}M" if size.endswith("M") else f"{m.num_params() / 1e9:.1f}B"
    assert shown == size  # as the paper's Table 4 states it
    assert m.padded_vocab_size == 30_720 and m.seq_length == 512 and m.is_bert


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("binary_head", [True, False])
def test_num_params_counts_every_parameter_of_the_model(placement, binary_head):
    cfg = Config().replace(**load_preset("configs/bert_tiny.toml")).replace(
        vocab_size=30522, layernorm_placement=placement, bert_binary_head=binary_head)
    _, abstract = split_abstract(build_model(cfg))
    assert sum(x.size for x in jax.tree.leaves(abstract)) == cfg.model.num_params()


def test_gpt_count_is_unchanged_by_the_bert_fields():
    assert ModelConfig(num_tokentypes=5, bert_binary_head=True).num_params() == ModelConfig().num_params()


def test_flags():
    cfg = parse_config(["--config", "configs/bert_tiny.toml", "--bert-no-binary-head", "--layernorm-placement",
                        "post", "--mask-prob", "0.2"])
    m = cfg.model
    assert m.is_bert and not m.bert_binary_head and m.layernorm_placement == "post" and cfg.data.mask_prob == 0.2
    assert parse_config(["--model-type", "bert"]).model.bert_binary_head


def test_parameter_shapes_and_layouts_match_the_golden_snapshot():
    """Every BERT parameter's global shape and declared PartitionSpec; MTX_UPDATE_GOLDEN=1 accepts a change."""
    _, abstract = split_abstract(build_model(Config().replace(**load_preset("configs/bert_tiny.toml"),
                                                              vocab_size=30522)))
    specs = dict(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(partition_specs(abstract, 1))))
    current = "\n".join(f"{jax.tree_util.keystr(path)} {tuple(x.shape)} {specs[path]}"
                        for path, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(abstract))) + "\n"
    if os.environ.get("MTX_UPDATE_GOLDEN"):
        GOLDEN.write_text(current)
    assert current == GOLDEN.read_text(), f"parameter layout changed:\n{current}"
