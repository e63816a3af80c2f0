"""Presets: TOML files of flat Megatron-named config fields (configs/*.toml), read and checked field by field."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from mtx.config import FIELD_SECTION, FIELD_TYPES, coerce_field
from mtx.files import not_a_file
from mtx.schema_checks import MEGATRON_NEEDLESS, MEGATRON_UNIMPLEMENTED, check_field, flag_name


def load_preset(path: str | Path) -> dict[str, Any]:
    """Reads a TOML preset of flat Megatron-named keys (`hidden_size = 1024`); unknown keys are an error."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config {path}: {not_a_file(path)}; pass a preset file such as configs/gpt2_124m.toml.")
    try:
        values = tomllib.loads(path.read_bytes().decode("utf-8-sig"))  # a byte-order mark (Windows editors) read past
    except UnicodeDecodeError as e:
        raise ValueError(f"--config {path} is not UTF-8 text ({e.reason} at byte {e.start}); pass a TOML preset."
                         ) from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path} is not valid TOML ({e}); fix the file.") from None
    spelled = {}
    for key in values:  # hidden-size and hidden_size are one field: set once
        if (field := key.replace("-", "_")) in spelled:
            raise ValueError(f"--config {path} sets {field} twice ({spelled[field]} and {key}); keep one.")
        spelled[field] = key
    values = {k.replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(values) - set(FIELD_SECTION))
    megatron = [name for name in unknown if flag_name(name) in MEGATRON_UNIMPLEMENTED | MEGATRON_NEEDLESS.keys()]
    if megatron:  # as the flags say
        flag = flag_name(megatron[0])
        why = f"{flag}: {MEGATRON_NEEDLESS.get(flag, 'mtx does not implement it')}"
        which, them = (f"flags ({why})", "them") if megatron[1:] else (why, "it")
        raise ValueError(f"--config {path} sets {', '.join(megatron)}: Megatron-LM's {which}; remove {them}.")
    if unknown:
        raise ValueError(f"--config {path} sets unknown field(s) {', '.join(unknown)}; remove or rename them.")
    values = {k: coerce_field(k, v) for k, v in values.items()}
    for k, v in values.items():  # every value the file sets, also those a flag then replaces
        if not (isinstance(v, str) and v.lower() == "none"):  # "none": an optional setting off (parse_config)
            check_field(k, FIELD_TYPES[k], v)
    return values
