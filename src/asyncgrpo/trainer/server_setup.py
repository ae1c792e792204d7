"""Ask the generation server for its limits and capabilities once, at ``train()`` start (G5, G9, G12, G13).

Everything the rollout worker and the weight sync need to know about the server
is read here, in the trainer process, so misconfigurations fail before any work
starts and with a message that says what to change.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncgrpo.client.http_client import AsyncServerClient, base_model_card
from asyncgrpo.client.server_rules import DEV_MODE_HINT, NOT_CONFIGURED_HINT, kv_capacity
from asyncgrpo.errors import ServerError
from asyncgrpo.routed_experts import CONFIG_KEY
from asyncgrpo.vllm_traits import config_section

logger = logging.getLogger(__name__)

MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams rejects temperature > 2


@dataclass
class ServerFacts:
    model_name: str
    max_model_len: int
    kv_cache_tokens: int | None
    has_metrics: bool
    masks_supported: bool
    world_size: int
    dtype: str | None  # vllm_config.model_config.dtype as reported ("torch.bfloat16")
    weight_backend: str | None  # vllm_config.weight_transfer_config.backend ("nccl"; the embedded server: or "gloo")
    max_logprobs: int = 20  # --max-logprobs; -1 means the vocabulary size
    return_sampling_mask: bool = False  # --return-sampling-mask: every request needs temperature > 0, top_k > 0
    world_sizes: tuple[int, ...] = ()  # each server's world size, in the config's order (several servers, X5)
    max_lora_rank: int | None = None  # --max-lora-rank when the server runs with --enable-lora, else None
    max_loras: int | None = None  # --max-loras (with --enable-lora)
    lora_adapters: tuple[str, ...] = ()  # adapters already registered (their /v1/models cards have a parent)
    weight_transfer: bool = True  # started with --weight-transfer-config (merged sync needs it; adapter sync does not)
    routed_experts: bool = False  # --enable-return-routed-experts (vllm_config.aux_output_config): MoE routing replay
    ready_s: float | None = None  # the server's seconds from its process start to serving (ours only; vLLM: None)

    @property
    def lora_enabled(self) -> bool:
        """The server was started with ``--enable-lora`` (``vllm_config.lora_config`` is set): adapter sync (T6)."""
        return self.max_lora_rank is not None


async def _server_info(client: AsyncServerClient) -> dict:
    """``/server_info``; the trainer cannot sync weights without the dev-mode routes, so a 404 stops the run."""
    try:
        info = await client.server_info()
    except ServerError as exc:
        if exc.status == 404:
            raise RuntimeError(f"the generation server at {client.base_url} answers 404 on /server_info: "
                               f"{DEV_MODE_HINT}") from exc  # fmt: skip
        raise
    return info if isinstance(info, dict) else {}


def ready_seconds(info: dict) -> float | None:
    """``/server_info``'s ``asyncgrpo.ready_s`` (the embedded server's start-up time), None when absent."""
    value = config_section(info, "asyncgrpo").get("ready_s")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


async def _probe(base_url: str, timeout: float, want_masks: bool, connect_timeout: float | None) -> ServerFacts:
    async with AsyncServerClient(base_url) as client:
        await client.wait_until_ready(timeout, refused_timeout=connect_timeout)
        models = await client.models()
        if not models:
            raise RuntimeError(f"the generation server at {base_url} serves no model (/v1/models is empty)")
        base = base_model_card(models)
        max_len = base.get("max_model_len")
        if not max_len:
            raise RuntimeError(f"/v1/models of {base_url} reports no max_model_len; is it a vLLM-compatible server?")
        info = await _server_info(client)
        await resume_if_paused(client)
        model_cfg = config_section(info, "vllm_config", "model_config")
        transfer = config_section(info, "vllm_config", "weight_transfer_config")
        try:
            await client.metrics()
            has_metrics = True
        except (TimeoutError, ServerError, OSError):
            has_metrics = False
        masks = await client.supports_sampling_mask() if want_masks else False
        world = await client.world_size()
        max_logprobs = model_cfg.get("max_logprobs", 20)
        lora = config_section(info, "vllm_config", "lora_config")
        return ServerFacts(
            model_name=base["id"],
            max_model_len=int(max_len),
            kv_cache_tokens=kv_capacity(info),
            has_metrics=has_metrics,
            masks_supported=masks,
            world_size=int(world),
            dtype=model_cfg.get("dtype"),
            weight_backend=transfer.get("backend"),
            max_logprobs=int(max_logprobs) if isinstance(max_logprobs, int) else 20,
            return_sampling_mask=bool(model_cfg.get("return_sampling_mask", False)),
            max_lora_rank=int(lora.get("max_lora_rank") or 16) if lora else None,  # vLLM's default rank: 16
            max_loras=int(lora.get("max_loras") or 1) if lora else None,
            lora_adapters=tuple(m["id"] for m in models if m.get("parent") not in (None, "")),
            weight_transfer=bool(transfer) or "vllm_config" not in info,
            routed_experts=bool(config_section(info, "vllm_config", "aux_output_config").get(CONFIG_KEY, False)),
            ready_s=ready_seconds(info),
        )


async def resume_if_paused(client: AsyncServerClient) -> None:
    """A server left paused (e.g. by a run that crashed mid-sync) queues or refuses every request, so the run
    would wait out its timeouts: resume it, saying so (SPEC X4)."""
    try:
        paused = await client.is_paused()
    except ServerError as exc:
        logger.info("no /is_paused from %s (%s): not checking for a paused server", client.base_url, exc)
        return
    if paused:
        logger.warning("the generation server at %s is paused (left so by an earlier run or another client?): "
                       "resuming it before this run starts", client.base_url)  # fmt: skip
        await client.resume()


def check_weight_transfer(facts: ServerFacts, base_urls: Sequence[str], adapter_sync: bool) -> None:
    """Merged-weight sync needs the server's weight transfer; adapter sync (T6) only writes files and calls
    ``/v1/load_lora_adapter``, so a server with ``--enable-lora`` and no ``--weight-transfer-config`` is fine.

    Raises:
        RuntimeError: merged sync against a server without weight transfer (says which flag to add).
    """
    if adapter_sync or facts.weight_transfer:
        return
    raise RuntimeError(f"the generation server at {', '.join(base_urls)} has no weight transfer: "
                       f"{NOT_CONFIGURED_HINT} (or, for a PEFT model, start it with --enable-lora: adapter sync "
                       "needs no weight transfer)")  # fmt: skip


def check_sampling_limits(facts: ServerFacts, *, temperature: float, top_k: int, num_sampler_logprobs: int) -> None:
    """Fail at start on a setting the server would reject on every request (vLLM 0.33's limits).

    Raises:
        ValueError: every violated limit, each with the setting or server flag to change.
    """
    problems = []
    if temperature > MAX_TEMPERATURE:
        problems.append(f"temperature={temperature} is above {MAX_TEMPERATURE:g}, the most vLLM accepts: set "
                        f"temperature <= {MAX_TEMPERATURE:g}")  # fmt: skip
    if facts.return_sampling_mask and top_k < 1:
        problems.append("the server returns sampling masks, so every request needs top_k ≥ 1: set top_k, or restart "
                        "vLLM without --return-sampling-mask")  # fmt: skip
    if facts.return_sampling_mask and temperature <= 0:
        problems.append("the server returns sampling masks, so every request needs temperature > 0: set temperature, "
                        "or restart vLLM without --return-sampling-mask")  # fmt: skip
    if facts.max_logprobs != -1 and num_sampler_logprobs > facts.max_logprobs:
        problems.append(f"num_sampler_logprobs={num_sampler_logprobs} is above the server's --max-logprobs "
                        f"{facts.max_logprobs}: lower num_sampler_logprobs, or restart the server with --max-logprobs "
                        f"{num_sampler_logprobs}")  # fmt: skip
    if problems:
        raise ValueError("the generation server would reject every request:\n  - " + "\n  - ".join(problems))


def probe_server(base_url: str, timeout: float, want_masks: bool, connect_timeout: float | None = None) -> ServerFacts:
    """Read the server's facts (blocking; waits up to ``timeout`` seconds for it to answer, ``connect_timeout``
    while nothing listens at the address)."""
    facts = asyncio.run(_probe(base_url, timeout, want_masks, connect_timeout))
    if want_masks and not facts.masks_supported:
        logger.warning(
            "top_k/top_p/min_p truncate the sampling distribution but the server at %s does not return sampling "
            "masks: the trainer keeps full-vocabulary normalisation and importance ratios are biased. Start vLLM "
            "with --return-sampling-mask --enable-scale-out (>= 0.28), or use the embedded server with "
            "--return-sampling-mask.",
            base_url,
        )
    return facts


def probe_servers(
    base_urls: Sequence[str], timeout: float, want_masks: bool, connect_timeout: float | None = None
) -> ServerFacts:
    """:func:`probe_server` for every server of the run, combined into the facts the run must respect.

    Limits are the tightest (``max_model_len``, ``max_logprobs``), capabilities the common ones (metrics,
    masks), KV capacity the sum (the worker's concurrency cap covers all servers); ``world_sizes`` lists each
    server's for the weight sync.

    Raises:
        ValueError: the servers serve different models or use different weight-transfer backends.
    """
    each = [probe_server(url, timeout, want_masks, connect_timeout) for url in base_urls]
    first = each[0]
    if len(each) == 1:
        return dataclasses.replace(first, world_sizes=(first.world_size,))
    problems = [f"{url} serves {f.model_name!r} but {base_urls[0]} serves {first.model_name!r}"
                for url, f in zip(base_urls, each) if f.model_name != first.model_name]  # fmt: skip
    problems += [f"{url} transfers weights over {f.weight_backend!r} but {base_urls[0]} over {first.weight_backend!r}"
                 for url, f in zip(base_urls, each) if f.weight_backend != first.weight_backend]  # fmt: skip
    if problems:
        raise ValueError("the generation servers of vllm_server_base_url must be replicas of one model: "
                         + "; ".join(problems) + ". Start every server with the same model and flags")  # fmt: skip
    kv = [f.kv_cache_tokens for f in each]
    lora = all(f.lora_enabled for f in each)
    logprobs = [f.max_logprobs for f in each if f.max_logprobs != -1]  # -1: the vocabulary, no limit
    return dataclasses.replace(
        first,
        max_model_len=min(f.max_model_len for f in each),
        kv_cache_tokens=sum(kv) if all(k is not None for k in kv) else None,  # type: ignore[arg-type]
        has_metrics=all(f.has_metrics for f in each),
        masks_supported=all(f.masks_supported for f in each),
        max_logprobs=min(logprobs) if logprobs else -1,
        return_sampling_mask=any(f.return_sampling_mask for f in each),
        world_sizes=tuple(f.world_size for f in each),
        # adapter sync only when every server takes adapters, within the smallest limits (T6)
        max_lora_rank=min(f.max_lora_rank or 0 for f in each) if lora else None,
        max_loras=min(f.max_loras or 0 for f in each) if lora else None,
        lora_adapters=tuple(sorted({a for f in each for a in f.lora_adapters})),
        weight_transfer=all(f.weight_transfer for f in each),
        routed_experts=all(f.routed_experts for f in each),
        ready_s=max((f.ready_s for f in each if f.ready_s is not None), default=None),  # the slowest start
    )


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
