"""Publish a built fixture model into the asset cache atomically (a crash never leaves half a model there)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any


def publish(out: Path, model: Any, tokenizer: Any) -> Path:
    """Save ``model`` and ``tokenizer`` beside ``out``, then rename the directory into place (replacing ``out``).

    Callers hold ``out``'s file lock: readers only ever see a complete directory (``config.json`` is the marker).
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out
