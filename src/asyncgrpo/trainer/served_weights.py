"""Say so when a generation server holds other weights than the run's model (issue 30, item 1).

The trainer pushes its weights at ``train()`` start whatever the server reports
(``AsyncGRPOCallback.on_train_begin``): a name or a version string proves nothing
about the weights. This module only tells the user what the server held before
that push: another model (a server started on another checkpoint) or weights an
earlier run pushed (a weight version other than a fresh server's). Both are
legitimate workflows, so they warn; neither stops the run. A checkpoint derived
from the served one with the same config and tokens (docs/agents.md serves the
demo model and trains its tool warm-up) is the same model here (issue 44 item 5).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any

from asyncgrpo.client.http_client import AsyncServerClient, base_model_card
from asyncgrpo.errors import ServerError
from asyncgrpo.files import local_only

logger = logging.getLogger(__name__)

# What a server reports as its weight version before any weight update, one entry per source:
# - "0": asyncgrpo's own server (server/engine/loop.py sets it at start);
# - "default": vLLM 0.32 and 0.33 (vllm/v1/engine/core.py: EngineCore.__init__ sets it, only a weight update or
#   /update_weight_version changes it; /weight_info returns it as is, data-parallel engines agree or it fails);
# - "" and "None": a version field that is empty or a serialised null (no server we know of sends these; they name
#   no earlier push either, so they must not warn).
FRESH_VERSIONS = frozenset({"0", "default", "", "None"})
CHECK_TIMEOUT_S = 30.0  # two small GETs on a server that just answered the start-up probe


# Config entries that differ between a checkpoint and a copy saved from it (warm_up_tool_calls, a trainer's
# output_dir) without changing what the server computes with: the path, the writer's version, the saved dtype.
COPY_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "dtype", "torch_dtype"})


def _same_tokens_and_config(served_dir: str, model_dir: str) -> bool:
    """True when two local checkpoints share their config (but ``COPY_CONFIG_KEYS``) and their vocabulary and
    special tokens: what the warning below asks to match. The chat template may differ: the trainer renders the
    prompts and sends token ids (a warmed-up model's tool template is the usual difference)."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        configs = [AutoConfig.from_pretrained(d).to_dict() for d in (served_dir, model_dir)]
        toks = [AutoTokenizer.from_pretrained(d, **local_only(d)) for d in (served_dir, model_dir)]
    except (OSError, ValueError):  # not a loadable checkpoint: the names decide
        return False
    a, b = ({k: v for k, v in c.items() if k not in COPY_CONFIG_KEYS} for c in configs)
    specials = [(t.bos_token_id, t.eos_token_id, t.pad_token_id, t.unk_token_id) for t in toks]
    return a == b and specials[0] == specials[1] and toks[0].get_vocab() == toks[1].get_vocab()


def _same_model(served: Sequence[str | None], model_id: str) -> bool:
    """True when the server's model (id, root) is the trainer's: the same name or directory, or a local copy with
    the same config and tokens (the trainer pushes its own weights before the first sample)."""
    local = [name for name in served if name and os.path.isdir(name)]
    for name in served:
        if not name:
            continue
        if name == model_id:
            return True
        if os.path.exists(name) and os.path.exists(model_id) and os.path.samefile(name, model_id):
            return True
    return bool(local) and os.path.isdir(model_id) and _same_tokens_and_config(local[0], model_id)


def describe_served_weights(base_url: str, models: list[dict[str, Any]], info: dict[str, Any] | None,
                            model_id: str) -> list[str]:  # fmt: skip
    """The warnings for one server: its model name differs from ``model_id``, or it reports a weight version
    other than a fresh server's. ``info`` is its ``/weight_info`` answer (None: the server has none)."""
    base = base_model_card(models) or {}
    names = (base.get("id"), base.get("root"))
    lines = []
    if base and not _same_model(names, model_id):
        lines.append(
            f"the generation server at {base_url} serves {base.get('id')!r}, not the trainer's model {model_id!r}: "
            "the trainer pushes its own weights before the first sample, so training is correct, but the server's "
            "tokenizer and config must match the trainer's (start it on the same checkpoint to be sure)"
        )
    version = info.get("weight_version") if isinstance(info, dict) else None
    if version is not None and str(version) not in FRESH_VERSIONS:
        lines.append(
            f"the generation server at {base_url} holds weight version {version!r} from an earlier weight push "
            "(another run, or this one before a restart): the trainer replaces them with its own before the first "
            "sample"
        )
    return lines


async def _read(base_url: str) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    async with AsyncServerClient(base_url, timeout=CHECK_TIMEOUT_S, retries=1) as client:
        models = await client.models()
        try:
            info = await client.weight_info()
        except ServerError as exc:
            if exc.status in (404, 405):  # a server without /weight_info: no version to compare
                return models, None
            raise
    return models, info


def warn_on_foreign_weights(base_urls: Sequence[str], model_id: str) -> list[str]:
    """Log (and return) one warning line per server that holds another model or an earlier run's weights."""
    lines: list[str] = []
    for url in base_urls:
        try:
            models, info = asyncio.run(asyncio.wait_for(_read(url), CHECK_TIMEOUT_S + 5))
        except TimeoutError:
            raise TimeoutError(f"GET /v1/models and /weight_info of {url} took over {CHECK_TIMEOUT_S + 5:.0f}s: "
                               "is the generation server overloaded?") from None  # fmt: skip
        lines += describe_served_weights(url, models, info, model_id)
    for line in lines:
        logger.warning(line)
    return lines
