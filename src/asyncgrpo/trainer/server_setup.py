"""Ask the generation server for its limits and capabilities once, at ``train()`` start (G5, G9, G12, G13).

Everything the rollout worker and the weight sync need to know about the server
is read here, in the trainer process, so misconfigurations fail before any work
starts and with a message that says what to change.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Any

import torch

from asyncgrpo.client.errors import ServerError
from asyncgrpo.client.http_client import AsyncServerClient, config_section

logger = logging.getLogger(__name__)


@dataclass
class ServerFacts:
    model_name: str
    max_model_len: int
    kv_cache_tokens: int | None
    has_metrics: bool
    masks_supported: bool
    world_size: int
    dtype: str | None  # as the server reports it (embedded server only)
    weight_backend: str | None  # "nccl" | "gloo" (embedded server) or None (vLLM: NCCL)


async def _probe(base_url: str, timeout: float, want_masks: bool) -> ServerFacts:
    async with AsyncServerClient(base_url) as client:
        await client.wait_until_ready(timeout)
        models = await client.models()
        if not models:
            raise RuntimeError(f"the generation server at {base_url} serves no model (/v1/models is empty)")
        base = next((m for m in models if m.get("parent") in (None, "")), models[0])
        max_len = base.get("max_model_len")
        if not max_len:
            raise RuntimeError(f"/v1/models of {base_url} reports no max_model_len; is it a vLLM-compatible server?")
        try:
            info = await client.server_info()
        except ServerError:
            info = {}
        try:
            await client.metrics()
            has_metrics = True
        except (TimeoutError, ServerError, OSError):
            has_metrics = False
        kv = await client.kv_cache_tokens()
        masks = await client.supports_sampling_mask() if want_masks else False
        try:
            world = await client.world_size()
        except ServerError:
            world = 1
        engine_info = info.get("asyncgrpo", {}) if isinstance(info, dict) else {}
        return ServerFacts(
            model_name=base["id"],
            max_model_len=int(max_len),
            kv_cache_tokens=kv,
            has_metrics=has_metrics,
            masks_supported=masks,
            world_size=int(world),
            dtype=server_dtype(info),
            weight_backend=engine_info.get("weight_transfer_backend") or info.get("weight_transfer_backend"),
        )


def server_dtype(info: Any) -> str | None:
    """The dtype a server generates in, from ``/server_info``: vLLM's ``vllm_config.model_config.dtype`` (a JSON
    object, or the text form some vLLM versions send), else the embedded server's own section (G13)."""
    if not isinstance(info, dict):
        return None
    found = config_section(info, "vllm_config", "model_config").get("dtype")
    if found is None and isinstance(info.get("vllm_config"), str):
        m = re.search(r"dtype=(?:torch\.)?(\w+)", info["vllm_config"])
        found = m.group(1) if m else None
    found = found or config_section(info, "asyncgrpo").get("dtype") or info.get("dtype")
    return str(found).removeprefix("torch.") if found else None


def probe_server(base_url: str, timeout: float, want_masks: bool) -> ServerFacts:
    """Read the server's facts (blocking; waits up to ``timeout`` seconds for it to answer)."""
    facts = asyncio.run(_probe(base_url, timeout, want_masks))
    if want_masks and not facts.masks_supported:
        logger.warning(
            "top_k/top_p/min_p truncate the sampling distribution but the server at %s does not return sampling "
            "masks: the trainer keeps full-vocabulary normalisation and importance ratios are biased. Start vLLM "
            "with --return-sampling-mask --enable-scale-out (>= 0.28), or use the embedded server with "
            "--return-sampling-mask.",
            base_url,
        )
    return facts


def check_dtype(trainer_dtype: torch.dtype, server_dtype: str | None) -> None:
    """G13: a trainer/server precision mismatch shows up as importance ratios away from 1."""
    if server_dtype is None:
        return
    name = str(trainer_dtype).removeprefix("torch.")
    if name != server_dtype.removeprefix("torch."):
        logger.warning(
            "the trainer computes in %s but the server generates in %s: the train-inference mismatch grows; "
            "serve with --dtype %s (or set AsyncGRPOConfig.dtype to match)",
            name,
            server_dtype,
            name,
        )


def check_completion_length(max_completion_length: int, max_model_len: int, base_url: str) -> None:
    """Refuse a ``max_completion_length`` the server can never produce: prompt + completion must fit
    ``max_model_len``, so every completion would be cut (``completions/clipped_ratio`` = 1) and never end with EOS.

    Raises:
        ValueError: ``max_completion_length`` >= the server's ``max_model_len`` (names both and what to change).
    """
    if max_completion_length >= max_model_len:
        raise ValueError(
            f"max_completion_length={max_completion_length} does not fit the server at {base_url}: its max_model_len "
            f"is {max_model_len} tokens for prompt + completion, so every completion would be cut. Lower "
            f"max_completion_length below {max_model_len} minus your longest prompt, or start the server with a larger "
            "--max-model-len"
        )
