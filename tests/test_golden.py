"""Golden snapshot of every GPT parameter's global shape and declared PartitionSpec (tests/golden/).

A refactor that changes a layout or a shape fails here and shows the diff. To accept an intended change:
MTX_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py
"""

import os
from pathlib import Path

import jax
from flax import nnx

from mtx.config import Config
from mtx.parallel.sharded import partition_specs, split_abstract
from mtx.presets import load_preset
from mtx.sharded_model import build_model

GOLDEN = Path(__file__).parent / "golden" / "gpt_tiny_params.txt"


def snapshot() -> str:
    _, abstract = split_abstract(build_model(Config().replace(**load_preset("configs/tiny.toml"))))
    specs = dict(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(partition_specs(abstract, 1))))
    rows = [f"{jax.tree_util.keystr(path)} {tuple(x.shape)} {specs[path]}"
            for path, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(abstract))]
    return "\n".join(rows) + "\n"


def test_parameter_shapes_and_layouts_match_the_golden_snapshot():
    current = snapshot()
    if os.environ.get("MTX_UPDATE_GOLDEN"):
        GOLDEN.write_text(current)
    assert current == GOLDEN.read_text(), f"parameter layout changed:\n{current}"
