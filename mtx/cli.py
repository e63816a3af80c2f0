"""Command-line flags with Megatron-LM's names, generated from the config schema (one flag per field).

`--config FILE` loads a TOML preset; flags given on the command line override it. Each flag's type comes from its
field's annotation and its help from the field's `help` metadata (mtx/config.py, mtx/architecture.py), so the schema
stays the single source of truth. eval.py and `python -m mtx.audit` build their model and parallelism flags from it too
(`add_config_flags`), so a flag means the same in every entry point.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from mtx.config import DERIVED, FIELD_TYPES, SECTIONS, Config
from mtx.config_checks import yield_layer_calls
from mtx.errors import UsageError
from mtx.files import expand_home, refuse_empty
from mtx.flag_rules import check_unused_flags
from mtx.presets import load_preset
from mtx.schema_checks import (CHOICES, LIMITS, MEGATRON_NEEDLESS, MEGATRON_UNIMPLEMENTED, RANGES, check_field,
                               field_types, flag_name, in_range, is_path_list)

# Boolean fields take a flag each way, so a preset's setting can be undone: --name turns one on, --no-name (or
# Megatron's spelling of the off flag, where it has one) off.
_OFF_FLAGS = {"bert_binary_head": "--bert-no-binary-head"}
_SECTION_HELP = {f.name: f.metadata["help"] for f in dataclasses.fields(Config)}
# Every field of every section by its (unique) name: the dataclass field and its resolved annotation.
_SCHEMA = {f.name: (f, FIELD_TYPES[f.name]) for cls in SECTIONS.values() for f in dataclasses.fields(cls)}


def build_parser(prog: str = "train.py") -> argparse.ArgumentParser:
    """train.py's parser: --config and one flag per schema field, grouped by section (`prog`: the tool that takes
    them, which its messages name)."""
    parser = OneLineParser(prog=prog, description="Train a GPT or BERT with tensor, pipeline and data parallelism "
                                                  "(Megatron-LM flags).")
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
        flag = flag_name(name)
        kw = dict(dest=name, default=default,
                  help=f"{helps.get(name, f.metadata['help'])} (default: {shown})".replace("%", "%%"))
        kind = _scalar_type(hint)
        if kind is bool:  # --name turns it on (the field's help), the off flag turns it off
            parser.add_argument(flag, action="store_true", **kw)
            parser.add_argument(_off_flag(name), action="store_false",
                                dest=name, default=default, help=f"turn {flag} off")
        elif is_path_list(hint):  # --data-path and the per-split paths: weights and paths
            parser.add_argument(flag, nargs="+", metavar="PATH", type=expand_home, **kw)
        else:
            # the tools' flags (eval.py, the audit) are range-checked here: no Config.validate sees them; their paths
            # start at the home directory with a quoted ~ too (train.py's: Config expands them as well)
            checked = ranged(kind, RANGES[name]) if defaults is not None and name in RANGES else STRICT.get(kind, kind)
            if defaults is None and kind in STRICT and field_types(hint)[1]:  # an optional number: "none" unsets it
                checked = _or_none(checked)
            elif defaults is not None and kind in STRICT and default is None:  # a tool's "unset" (its help's None)
                checked = _or_none(checked, unset=None)
            if f.metadata.get("path"):
                checked = expand_home
            parser.add_argument(flag, type=checked, metavar=kind.__name__.upper(), **kw)


def flag_for(name: str, value) -> str:
    """The train.py flag (with its value) that sets field `name` to `value`: "--hidden-size 64", "--swiglu" or
    "--no-swiglu" for a boolean, "--ffn-hidden-size none" for an optional setting's None."""
    flag = flag_name(name)
    if isinstance(value, bool):
        return flag if value else _off_flag(name)
    if value is None:
        return f"{flag} none"
    return f"{flag} {' '.join(map(str, value)) if isinstance(value, tuple) else value}"


def _off_flag(name: str) -> str:
    """A boolean field's off flag: --no-name, or Megatron's spelling where it has one."""
    return _OFF_FLAGS.get(name, "--no-" + name.replace("_", "-"))


def _or_none(parse, unset="none"):
    """A number parser that also takes "none" (any case) as `unset`: "none" for parse_config to turn into None
    (train.py's preset can be unset), or a tool's None itself."""
    def parse_or_none(text: str):
        return unset if text.lower() == "none" else parse(text)

    parse_or_none.__name__ = parse.__name__
    return parse_or_none


def _scalar_type(hint):
    """int | None -> int, float -> float, tuple[str, ...] -> str (its items), ..."""
    kind = field_types(hint)[0][0]
    return str if kind is tuple else kind


_PATH_LISTS = {flag_name(name) for name, hint in FIELD_TYPES.items() if is_path_list(hint)}


def with_negative_values(argv: list[str] | None) -> list[str]:
    """`--flag -1e-3` -> `--flag=-1e-3`: argparse takes a value that starts with "-" for a flag unless it looks like
    a plain negative number, so `--lr -1e-3` would fail to parse (the range check then names the flag:
    mtx/schema_checks.py). Not for --data-path (nor the per-split paths), whose list of weights and paths argparse
    takes as it is (a negative weight is then refused by the blend's own check)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    out, i = [], 0
    while i < len(argv):
        if (argv[i].startswith("--") and "=" not in argv[i] and argv[i] not in _PATH_LISTS and i + 1 < len(argv)
                and _is_negative_number(argv[i + 1])):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors raise ValueError (message prefixed by the program and command) instead
    of printing the usage and exiting: the tools print every bad input as one "error: ..." line, exit status 2.

    An unknown flag is named with the closest flag that the tool (or the subcommand given) takes: "unknown flag
    --hiden-size; did you mean --hidden-size?". Flags are spelled whole (no abbreviations, as in Megatron-LM's
    parser): a prefix that means one flag today would silently mean another once a flag is added.
    """

    def __init__(self, *args, reads_checkpoint: bool = False, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.reads_checkpoint = reads_checkpoint  # its model is --load's (eval.py): train.py's flags are named so

    def print_help(self, file=None):
        """argparse's, but a failed write is not swallowed: --help into a closed pipe ends as any output does."""
        (file or sys.stdout).write(self.format_help())

    def parse_known_args(self, args=None, namespace=None):
        """A later flag overrides an earlier one (argparse's rule, which scripts use: base flags, then one changed),
        but a second --config would drop the whole first preset, and a second list (--data-path A --data-path B)
        the first one's values: refused."""
        argv = list(sys.argv[1:] if args is None else args)
        self._refuse_undecodable(argv)
        given = list(flags_in(argv))
        if given.count("--config") > 1:
            self.error("--config given twice; pass one preset (and flags to change it).")
        for action in self._actions:
            if action.nargs in ("+", "*") and (twice := [f for f in action.option_strings if given.count(f) > 1]):
                self.error(f"{twice[0]} given twice; pass all its values after one {twice[0]}.")
        return super().parse_known_args(argv, namespace)

    def _refuse_undecodable(self, argv: list[str]) -> None:
        """Bytes that are no UTF-8 (Python keeps them as lone surrogates): a path of them reaches the checkpoint and
        data libraries only to fail there, after training; text, the tokenizer. Refused while parsing, the value
        shown with its bytes."""
        for i, token in enumerate(argv):
            try:
                token.encode("utf-8")
            except UnicodeEncodeError:
                inline = token.startswith("-") and "=" in token  # --save=NAME
                flag = token.split("=")[0] if inline else argv[i - 1] if i and argv[i - 1].startswith("-") else ""
                value = token.split("=", 1)[1] if inline else token
                try:  # the bytes the shell passed; a lone surrogate of another origin (the API) as Python writes it
                    shown = value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                except UnicodeEncodeError:
                    shown = ascii(value)[1:-1]
                self.error(f"{flag + ' ' if flag else ''}'{shown}' is not valid UTF-8; pass UTF-8 text (a file or "
                           "directory: rename it, or link it, to a UTF-8 name).")

    def parse_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        try:
            namespace, extras = self.parse_known_args(argv, namespace)
        except ValueError:  # (a required flag missing, say): an unknown flag in argv is the likelier cause
            self.refuse_unknown_flags(argv)
            raise
        if extras:
            self.refuse_unknown_flags(extras, argv)
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace

    def refuse_unknown_flags(self, tokens: list[str], argv: list[str] | None = None) -> None:
        """Raises the one-line error of the flags among `tokens` that neither this parser nor the subcommand named in
        the command line `argv` (default: `tokens`) takes, if there are any (the subcommand's error: its name in the
        message). A tool that `reads_checkpoint` (eval.py) says of train.py's flags that they are train.py's."""
        parser, known = self, set()
        while parser is not None:
            known.update(s for action in parser._actions for s in action.option_strings)
            owner, parser = parser, subcommand(parser, tokens if argv is None else argv)
        unknown = [flag for flag in flags_in(tokens) if flag not in known]
        if unknown and self.reads_checkpoint:  # train.py's flags that no task takes (the model's, the tokenizer's)
            tasks = [t for a in self._actions if isinstance(a, argparse._SubParsersAction) for t in a.choices.values()]
            taken = {s for p in (self, *tasks) for a in p._actions for s in a.option_strings}
            trains = {s for a in build_parser()._actions for s in a.option_strings} - taken
            if train := [f for f in dict.fromkeys(unknown) if f in trains]:
                owner.error(f"{', '.join(train)}: train.py's; {self.prog} trains nothing and reads its model from "
                            f"--load's checkpoint; drop {'them' if train[1:] else 'it'}.")
        if unknown:
            owner.error(unknown_flags_message(unknown, known, f"{owner.prog} --help lists the flags"))

    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


def unknown_flags_message(unknown: Iterable[str], known: Iterable[str], hint: str) -> str:
    """"unknown flag --hiden-size; did you mean --hidden-size?": each unknown flag with the known one closest to it
    (difflib, underscores read as dashes; the likeliest flag it begins, if it is an abbreviation) where one is close,
    else `hint`."""
    known = sorted(known)

    def closest(flag: str) -> str | None:
        dashed = flag[:2] + flag[2:].replace("_", "-")
        longer = [k for k in known if k.startswith(dashed)]
        return next(iter(difflib.get_close_matches(dashed, longer or known, n=1, cutoff=0 if longer else 0.7)), None)

    megatron = [flag for flag in dict.fromkeys(unknown) if flag in MEGATRON_UNIMPLEMENTED]
    needless = [f"Megatron-LM's {flag}: {MEGATRON_NEEDLESS[flag]}; remove it." for flag in dict.fromkeys(unknown)
                if flag in MEGATRON_NEEDLESS]
    if megatron or needless:
        them = "them" if megatron[1:] else "it"
        return " ".join([f"Megatron-LM's {', '.join(megatron)}: mtx does not implement {them}; remove {them}."] *
                        bool(megatron) + needless)
    named = [(flag, closest(flag)) for flag in dict.fromkeys(unknown)]
    if len(named) == 1:
        flag, match = named[0]
        return f"unknown flag {flag}; " + (f"did you mean {match}?" if match else f"{hint}.")
    listed = ", ".join(flag + (f" (did you mean {match}?)" if match else "") for flag, match in named)
    return f"unknown flags {listed}; {hint}."


def flags_in(argv: Iterable[str]):
    """The flags of a command line, as argparse reads it: `--name` of `--name=value`, up to a `--`; not "-", a
    negative number or a token with a space (argparse takes those as values)."""
    for token in argv:
        if token == "--":
            return
        if token.startswith("-") and token != "-" and " " not in token and not _is_negative_number(token):
            yield token.split("=", 1)[0]


def subcommand(parser: argparse.ArgumentParser, argv: Iterable[str]) -> argparse.ArgumentParser | None:
    """The subparser of `parser` that `argv` names (eval.py's task, mtx.convert's direction), or None."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return next((action.choices[token] for token in argv if token in action.choices), None)
    return None


_NUMBER = {int: re.compile(r"[-+]?[0-9]+"),
           float: re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?|[-+]?(nan|inf|infinity)", re.I)}


def _strict(kind: type):
    """`kind` (int or float) for numbers as written in ASCII digits only: Python's own parsers also take "1_0",
    full-width digits and, for int, surrounding spaces, which a flag's value should not be."""
    def parse(text: str):
        if not _NUMBER[kind].fullmatch(text):
            raise ValueError(text)
        return kind(text)

    parse.__name__ = kind.__name__  # argparse's messages name the type
    return parse


STRICT = {int: _strict(int), float: _strict(float)}


# The tools' counts of timed steps, repeats and iterations, and of warm-up steps: enough to measure, never a run
# that goes on until killed (`--steps 1e20` once did)
COUNT, WARMUP = "[1, 10000]", "[0, 10000]"


def ranged(kind: type, valid: str):
    """An argparse `type` for a tool's own numeric flag: parses with `kind` and refuses values outside `valid` (a
    range written as in mtx/schema_checks.py's RANGES), so argparse names the flag in its one-line error."""
    def parse(text: str):
        value = STRICT[kind](text)  # a ValueError: argparse's "invalid int value: 'x'", as for any other flag
        if not (math.isfinite(value) and in_range(value, valid)):
            raise argparse.ArgumentTypeError(f"must be {'in ' if valid[0] in '[(' else ''}{valid}, got {text}")
        if abs(value) > LIMITS[kind]:  # in range, beyond what mtx can use ("must be >= 0" for 10^20 once)
            raise argparse.ArgumentTypeError(f"{text} is beyond what mtx can use (at most {LIMITS[kind]:.4g})")
        return value

    parse.__name__ = kind.__name__  # argparse's messages name the type
    return parse


def _is_negative_number(token: str) -> bool:
    """A negative number, or a list that starts with one (`--split -1,2,3`, refused by its own check then)."""
    try:
        float(token.split(",")[0].split("/")[0])
    except ValueError:
        return False
    return token.startswith("-")


def unset_nones(values: dict) -> dict:
    """"none" (any case) read as None: a flag's way to turn an optional setting of a preset off, e.g.
    --recompute-granularity none."""
    return {k: None if isinstance(v, str) and v.lower() == "none" else v for k, v in values.items()}


def parse_config(argv: list[str] | None = None, prog: str = "train.py") -> Config:
    """Flags (and an optional preset) -> a Config. Bad flags raise ValueError, one line naming them (and `prog`, the
    tool they were given to): an unknown flag with the closest one mtx has, a missing or mistyped value with its
    flag."""
    values = vars(build_parser(prog).parse_args(with_negative_values(argv)))  # "unknown flag --hiden-size; did you mean
    # --hidden-size?"
    preset = values.pop("config", None)
    # (an empty --config once trained the default model, silently)
    refuse_empty(preset, "--config", "a preset file such as configs/gpt2_124m.toml, or drop --config")
    fields = load_preset(preset) if preset is not None else {}
    null_preset = fields.get("tokenizer_type") == "NullTokenizer" and "vocab_size" in fields  # (a preset of ids)
    for target, sources in DERIVED.items():  # a count the command line sets replaces the preset's way of setting it
        if any(name in values for name in (target, *sources)):
            for name in (target, *sources):
                fields.pop(name, None)
    fields.update({k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
    cfg = Config().replace(**unset_nones(fields))
    cfg = yield_layer_calls(cfg, values)  # a preset's --layer-calls yields to a stack or to what they do not run
    for name in set(values) & set(CHOICES):  # a setting mtx lacks is named as such, not as a flag that does nothing
        check_field(name, FIELD_TYPES[name], cfg.value(name))
    check_unused_flags(cfg, values)
    if cfg.data.tokenizer_type == "NullTokenizer" and "vocab_size" not in values and not null_preset:
        raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size N: its ids are 0 .. N - 1 (a preset's "
                         "vocab_size is its tokenizer's, not these ids).")  # (Megatron's assert)
    return cfg
