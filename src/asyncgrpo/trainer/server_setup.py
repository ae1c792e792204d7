"""Ask the generation server for its limits and capabilities once, at ``train()`` start (G5, G9, G12, G13).

Everything the rollout worker and the weight sync need to know about the server
is read here, in the trainer process, so misconfigurations fail before any work
starts and with a message that says what to change.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import torch

from asyncgrpo.client.errors import ServerError
from asyncgrpo.client.http_client import AsyncServerClient

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
            dtype=engine_info.get("dtype") or info.get("dtype"),
            weight_backend=engine_info.get("weight_transfer_backend") or info.get("weight_transfer_backend"),
        )


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
