"""Command-line flags with Megatron-LM's names, generated from the config schema (one flag per field).

`--config FILE` loads a TOML preset; flags given on the command line override it. Each flag's type comes from its
field's annotation and its help from the field's `help` metadata in mtx/config.py, so the schema stays the single
source of truth. eval.py and `python -m mtx.audit` build their model and parallelism flags from it too
(`add_config_flags`), so a flag means the same in every entry point.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from mtx.config import FIELD_TYPES, SECTIONS, Config, load_preset
from mtx.schema_checks import field_types, in_range

# Boolean fields take a flag each way, so a preset's setting can be undone: --name turns one on, --no-name (or
# Megatron's spelling of the off flag, where it has one) off.
_OFF_FLAGS = {"bert_binary_head": "--bert-no-binary-head"}
_SECTION_HELP = {f.name: f.metadata["help"] for f in dataclasses.fields(Config)}
# Every field of every section by its (unique) name: the dataclass field and its resolved annotation.
_SCHEMA = {f.name: (f, FIELD_TYPES[f.name]) for cls in SECTIONS.values() for f in dataclasses.fields(cls)}


def build_parser() -> argparse.ArgumentParser:
    """train.py's parser: --config and one flag per schema field, grouped by section."""
    parser = argparse.ArgumentParser(
        prog="train.py", description="Train a GPT with tensor and data parallelism (Megatron-LM flags).",
        allow_abbrev=False)
    parser.add_argument("--config", metavar="FILE",
                        help="TOML preset (configs/*.toml) of flat field names; flags override it")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section, description=_SECTION_HELP[section])
        add_config_flags(group, [f.name for f in dataclasses.fields(cls)])
    return parser


def add_config_flags(parser, fields: Iterable[str], *, defaults: Mapping[str, Any] | None = None,
                     helps: Mapping[str, str] | None = None) -> None:
    """Adds the schema's flag of each named field, in the order given, to `parser` (a parser or argument group):
    typed by the field's annotation, helped by its metadata (or `helps`), and for a boolean an off flag too.

    Without `defaults` a flag that is not given stays out of the namespace, so that a preset can set the field
    (train.py). With `defaults` every named field gets a value: the mapping's where it has one, else the schema's.
    """
    helps = helps or {}
    for name in fields:
        if name not in _SCHEMA:
            raise ValueError(f"{name!r} is not a config field (mtx/config.py)")
        f, hint = _SCHEMA[name]
        schema_default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        default = argparse.SUPPRESS if defaults is None else defaults.get(name, schema_default)
        shown = schema_default if defaults is None else default
        flag = "--" + name.replace("_", "-")
        kw = dict(dest=name, default=default,
                  help=f"{helps.get(name, f.metadata['help'])} (default: {shown})".replace("%", "%%"))
        kind = _scalar_type(hint)
        if kind is bool:  # --name turns it on (the field's help), the off flag turns it off
            parser.add_argument(flag, action="store_true", **kw)
            parser.add_argument(_OFF_FLAGS.get(name, "--no-" + name.replace("_", "-")), action="store_false",
                                dest=name, default=default, help=f"turn {flag} off")
        elif name == "data_path":
            parser.add_argument(flag, nargs="+", metavar="PATH", **kw)
        else:
            parser.add_argument(flag, type=kind, metavar=kind.__name__.upper(), **kw)


def _scalar_type(hint):
    """int | None -> int, float -> float, tuple[str, ...] -> str (its items), ..."""
    kind = field_types(hint)[0][0]
    return str if kind is tuple else kind


def with_negative_values(argv: list[str] | None) -> list[str]:
    """`--flag -1e-3` -> `--flag=-1e-3`: argparse takes a value that starts with "-" for a flag unless it looks like
    a plain negative number, so `--lr -1e-3` would fail to parse (the range check then names the flag:
    mtx/schema_checks.py)."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    out, i = [], 0
    while i < len(argv):
        if argv[i].startswith("--") and "=" not in argv[i] and i + 1 < len(argv) and _is_negative_number(argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors raise ValueError (message prefixed by the program and command) instead
    of printing the usage and exiting: the tools print every bad input as one "error: ..." line, exit status 2."""

    def error(self, message):
        raise ValueError(f"{self.prog}: {message}")


def ranged(kind: type, valid: str):
    """An argparse `type` for a tool's own numeric flag: parses with `kind` and refuses values outside `valid` (a
    range written as in mtx/schema_checks.py's RANGES), so argparse names the flag in its one-line error."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not (math.isfinite(value) and in_range(value, valid)):
            raise argparse.ArgumentTypeError(f"must be {'in ' if valid[0] in '[(' else ''}{valid}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse's messages name the type
    return parse


def _is_negative_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return token.startswith("-")


def parse_config(argv: list[str] | None = None) -> Config:
    """Flags (and an optional preset) -> a Config; unknown flags are an error that names them."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(with_negative_values(argv))
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
