"""Server-side sampling defaults from the model's ``generation_config.json`` (vLLM's ``--generation-config``).

vLLM 0.33 fills the sampling fields a ``/v1/completions`` request omits from the
model's generation config (``--generation-config auto``, its default), so a bare
request may run with, say, ``repetition_penalty`` 1.1 or ``top_k`` 20. The
embedded server does the same, so a client that forgets a field sees the same
distribution on both servers. ``--generation-config vllm`` ignores the file.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo.server.http.protocol import GENERATION_CONFIG_FIELDS

logger = logging.getLogger(__name__)

_UNSUPPORTED = ("presence_penalty", "frequency_penalty")  # the embedded sampler has no such penalties


@dataclass(frozen=True)
class GenerationDefaults:
    """``sampling``: field -> value for omitted completion fields; ``max_new_tokens``: the file's cap (or None)."""

    source: str  # "auto", "vllm" or a directory, as given on the command line
    sampling: dict[str, Any] = field(default_factory=dict)
    max_new_tokens: int | None = None


def load_generation_defaults(
    source: str, model_dir: str | Path, overrides: dict[str, Any] | None = None
) -> GenerationDefaults:
    """Read the defaults vLLM would use for ``--generation-config source`` (``auto``: the model directory).

    Raises:
        ValueError: the file is not JSON, or sets a penalty the embedded server cannot apply.
    """
    config: dict[str, Any] = {}
    if source != "vllm":
        folder = Path(model_dir) if source == "auto" else Path(source)
        path = folder / "generation_config.json"
        if path.is_file():
            try:
                config = json.loads(path.read_text())
            except ValueError as exc:
                raise ValueError(f"{path} is not JSON ({exc}); fix it or start with --generation-config vllm") from exc
        elif source != "auto":
            raise ValueError(f"--generation-config {source}: no generation_config.json in that directory")
    config.update(overrides or {})
    sampling = {k: config[k] for k in GENERATION_CONFIG_FIELDS if config.get(k) is not None}
    bad = {k: sampling[k] for k in _UNSUPPORTED if sampling.get(k) not in (None, 0, 0.0)}
    if bad:
        raise ValueError(
            f"the generation config sets {bad}, which the embedded server does not implement; start it with "
            "--generation-config vllm (vLLM's neutral defaults) or remove them from generation_config.json"
        )
    for k in _UNSUPPORTED:
        sampling.pop(k, None)
    max_new = config.get("max_new_tokens")
    if sampling or max_new is not None:
        logger.warning(
            "default sampling parameters come from the generation config (%s): %s%s; requests that omit them get "
            "these values. Start with --generation-config vllm to use vLLM's neutral defaults.",
            source, sampling, f", max_new_tokens={max_new}" if max_new is not None else "",
        )  # fmt: skip
    return GenerationDefaults(source, sampling, int(max_new) if max_new is not None else None)
