"""Command-line flags with Megatron-LM's names, generated from the config schema (one flag per field).

`--config FILE` loads a TOML preset; flags given on the command line override it. The help text of each flag is the
comment on its field in mtx/config.py, so the schema stays the single source of truth.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import types
import typing

from mtx import config as config_lib
from mtx.config import SECTIONS, Config, load_preset

# Boolean fields take a flag each way, so a preset's setting can be undone: --name turns one on, --no-name (or
# Megatron's spelling of the off flag, where it has one) off.
_OFF_FLAGS = {"bert_binary_head": "--bert-no-binary-head"}


def _field_help() -> dict[str, str]:
    """Each field's trailing comment in mtx/config.py, keyed by field name."""
    pattern = re.compile(r"^\s+(\w+): [^=]+=.*?#\s*(.+)$")
    return {m.group(1): m.group(2) for m in map(pattern.match, inspect.getsource(config_lib).splitlines()) if m}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train.py", description="Train a GPT with tensor and data parallelism (Megatron-LM flags).",
        allow_abbrev=False)
    parser.add_argument("--config", metavar="FILE", help="TOML preset (configs/*.toml) of flat field names; flags override it")
    helps = _field_help()
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kind = _scalar_type(hints[f.name])
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            kw = dict(dest=f.name, default=argparse.SUPPRESS, help=f"{helps.get(f.name, '')} (default: {default})".replace("%", "%%"))
            if kind is bool:  # --name turns it on (the field's help), the off flag turns it off
                off = _OFF_FLAGS.get(f.name, "--no-" + f.name.replace("_", "-"))
                group.add_argument(flag, action="store_true", **kw)
                group.add_argument(off, action="store_false", dest=f.name, default=argparse.SUPPRESS,
                                   help=f"turn {flag} off")
            elif f.name == "data_path":
                group.add_argument(flag, nargs="+", metavar="PATH", **kw)
            else:
                group.add_argument(flag, type=kind, metavar=kind.__name__.upper(), **kw)
    return parser


def _scalar_type(hint):
    """int | None -> int, float -> float, ..."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = args[0]
    if typing.get_origin(hint) is tuple:
        return str
    return hint


def parse_config(argv: list[str] | None = None) -> Config:
    """Flags (and an optional preset) -> a Config; unknown flags are an error that names them."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flags = [u for u in unknown if u.startswith("-")] or unknown
        parser.error(f"unsupported flag(s) {' '.join(flags)}: mtx does not implement them; see --help for the "
                     "supported Megatron-LM flags.")
    values = vars(args)
    preset = values.pop("config", None)
    fields = load_preset(preset) if preset else {}
    fields.update({k: tuple(v) if k == "data_path" else v for k, v in values.items()})
    # "none" turns an optional setting of a preset off, e.g. --recompute-granularity none
    fields = {k: None if isinstance(v, str) and v.lower() == "none" else v for k, v in fields.items()}
    return Config().replace(**fields)
