"""The one configurable path to the reference data (GPT-2 vocab files, WikiText, LAMBADA, ...)."""

from __future__ import annotations

import os
from pathlib import Path

ENV = "MTX_DATA_DIR"
_DEFAULT = Path(__file__).resolve().parent.parent.parent / "shared" / "data"


def shared_data_dir() -> Path | None:
    """$MTX_DATA_DIR if set, else ../shared/data beside the repository; None where neither exists."""
    path = Path(os.environ[ENV]) if os.environ.get(ENV) else _DEFAULT
    return path if path.is_dir() else None
