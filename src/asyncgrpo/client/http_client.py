"""Async client of the generation-server protocol (docs/protocol.md), on aiohttp.

The same client talks to a real ``vllm serve`` and to our embedded server. This file holds the protocol's
endpoints; each goes through ``HttpTransport.request`` (``transport.py``), which checks the HTTP status, raises
:class:`ServerError` naming the endpoint, the status and the server's message, and retries connection errors,
timeouts and 503 with exponential backoff.

    async with AsyncServerClient("http://localhost:8000") as client:
        await client.wait_until_ready(timeout=300)
        out = await client.generate([1, 2, 3], {"max_tokens": 8, "temperature": 1.0, "seed": 0})
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

from asyncgrpo.client.answer_parse import parse_choices
from asyncgrpo.client.metrics_text import vllm_metrics
from asyncgrpo.client.results import GenerationResult
from asyncgrpo.client.server_rules import (  # noqa: F401 - config_section re-exported (weights/sender.py)
    config_section,
    kv_capacity,
    with_explicit_sampling,
)
from asyncgrpo.client.transport import HttpTransport
from asyncgrpo.errors import ServerError, ServerTimeoutError

logger = logging.getLogger(__name__)

WAIT_LOG_INTERVAL_S = 30.0  # X4: a waiting client says what it waits for at least this often
SERVER_HINT = "is `asyncgrpo serve` (or `vllm serve`) running and reachable at that address?"


def not_answering_message(
    base_url: str, waited_s: float, timeout_s: float, last_error: str, refused_timeout_s: float | None = None
) -> str:
    """The X4 line of a wait on an unreachable server: URL, time so far, when the wait gives up, last error, hint.

    ``refused_timeout_s``: the shorter bound that holds while every connection so far was refused (issue 44 item
    4: the line said "timeout 1800s" of a wait that gives up at 60 s).
    """
    if refused_timeout_s is not None and refused_timeout_s < timeout_s:
        bound = (
            f"gives up in {max(refused_timeout_s - waited_s, 0.0):.0f}s more if every connection stays refused "
            f"(vllm_server_connect_timeout={refused_timeout_s:g}), at {timeout_s:.0f}s in all once one is accepted"
        )
    else:
        bound = f"gives up in {max(timeout_s - waited_s, 0.0):.0f}s more, at {timeout_s:.0f}s in all"
    return f"server {base_url} not answering /health for {waited_s:.0f}s ({bound}; last error: {last_error}) - {SERVER_HINT}"


def _check_single(sampling_params: Mapping[str, Any], method: str) -> None:
    """``generate``/``complete`` return one sequence: refuse ``n`` > 1 with the method that returns several."""
    if sampling_params.get("n", 1) != 1:
        raise ValueError(f"{method}() returns one sequence but n={sampling_params['n']}; use {method}_n()")


def base_model_card(models: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The base model's card among ``GET /v1/models``' cards: the one without a ``parent`` (LoRA adapters name
    theirs), else the first; None when there is no card."""
    return next((m for m in models if m.get("parent") in (None, "")), models[0] if models else None)


class AsyncServerClient(HttpTransport):
    """Client of one generation server (vLLM or embedded), bound to the event loop it is first used in.

    Constructor arguments and the retried ``request`` call: ``HttpTransport`` (``transport.py``).
    """

    def clone(self) -> AsyncServerClient:
        """A new client with the same settings (for use in another event loop or thread)."""
        return AsyncServerClient(
            self.base_url,
            timeout=self.timeout,
            max_connections=self.max_connections,
            retries=self.retries,
            backoff=self.backoff,
            retry_for_s=self.retry_for_s,
            timeout_name=self.timeout_name,
        )

    # ------------------------------------------------------------------ basic endpoints

    async def health(self) -> bool:
        """True when ``GET /health`` answers 200 (no retries)."""
        try:
            await self.request("GET", "/health", retries=0, timeout=min(self.timeout, 10.0), parse="none")
        except ServerError:
            return False
        return True

    async def wait_until_ready(
        self,
        timeout: float,
        poll_s: float = 0.5,
        log_every: float = WAIT_LOG_INTERVAL_S,
        refused_timeout: float | None = None,
    ) -> None:
        """Poll ``GET /health`` until it answers 200, logging what it waits for every ``log_every`` seconds (X4).

        ``refused_timeout``: give up sooner when every attempt so far was refused (nothing listens at the URL: a
        typo, a server not started) instead of waiting the whole ``timeout`` meant for a server that is loading.

        Raises:
            ServerTimeoutError: not ready within ``timeout`` seconds, or refused for ``refused_timeout`` seconds
                (names the URL and the last error).
        """
        t0 = time.monotonic()
        deadline = t0 + timeout
        next_log = t0 + log_every
        last = "no attempt"
        always_refused = True
        while True:
            try:
                await self.request("GET", "/health", retries=0, timeout=min(10.0, timeout), parse="none")
                return
            except ServerError as exc:
                last = exc.message
                always_refused = always_refused and exc.refused
            now = time.monotonic()
            if always_refused and refused_timeout is not None and now - t0 >= refused_timeout:
                raise ServerTimeoutError(
                    "GET /health",
                    None,
                    f"nothing listens at {self.base_url}: every connection was refused for {now - t0:.0f}s "
                    f"(vllm_server_connect_timeout={refused_timeout:g}); last error: {last}. Start `asyncgrpo serve "
                    "MODEL` (or vllm serve) there, fix vllm_server_base_url, or raise vllm_server_connect_timeout "
                    "for a server that opens its port late",
                    base_url=self.base_url,
                )
            if now >= next_log:
                refused_bound = refused_timeout if always_refused else None
                logger.warning("%s", not_answering_message(self.base_url, now - t0, timeout, last, refused_bound))
                next_log = now + log_every
            if now + poll_s > deadline:
                raise ServerTimeoutError(
                    "GET /health",
                    None,
                    f"server not ready after waiting {timeout:.0f}s; last error: {last}. {SERVER_HINT}",
                    base_url=self.base_url,
                )
            await asyncio.sleep(poll_s)

    async def version(self) -> str:
        return str((await self.request("GET", "/version"))["version"])

    async def models(self) -> list[dict[str, Any]]:
        """The model cards of ``GET /v1/models`` (base model first, then LoRA adapters)."""
        return list((await self.request("GET", "/v1/models"))["data"])

    async def max_model_len(self) -> int:
        """``max_model_len`` of the base model card (SPEC G12)."""
        for card in await self.models():
            if card.get("max_model_len") is not None:
                return int(card["max_model_len"])
        raise ServerError("GET /v1/models", 200, "no model card carries max_model_len", base_url=self.base_url)

    async def server_info(self) -> dict[str, Any]:
        """``GET /server_info?config_format=json`` (vLLM dev mode)."""
        return await self.request("GET", "/server_info", params={"config_format": "json"})

    async def kv_cache_tokens(self, info: Mapping[str, Any] | None = None) -> int | None:
        """KV-cache capacity in tokens of the whole server, None when it does not say.

        vLLM 0.33 reports ``cache_config.kv_cache_size_tokens`` per data-parallel engine (group-aware, right
        for hybrid models) and ``num_gpu_blocks`` summed over engines; prefer the first × DP size.
        """
        if info is None:
            try:
                info = await self.server_info()
            except ServerError as exc:
                logger.info("no KV-cache capacity from %s: %s", self.base_url, exc)
                return None
        return kv_capacity(info)

    async def world_size(self) -> int:
        return int((await self.request("GET", "/get_world_size", params={"include_dp": "true"}))["world_size"])

    async def load(self) -> int:
        """``GET /load``: requests the server is working on."""
        return int((await self.request("GET", "/load"))["server_load"])

    async def metrics(self, model_name: str | None = None) -> dict[str, float]:
        """The ``vllm:*`` values of ``GET /metrics`` (engines summed; KV usage: the fullest engine)."""
        return vllm_metrics(await self.request("GET", "/metrics", parse="text"), model_name)

    # ------------------------------------------------------------------ generation

    async def generate_n(
        self,
        token_ids: list[int],
        sampling_params: Mapping[str, Any],
        *,
        model: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> list[GenerationResult]:
        """``POST /inference/v1/generate``; one result per choice (``n`` of them).

        ``sampling_params`` uses vLLM's SamplingParams names; ``logprobs`` defaults to 0
        (the sampled token's log-prob only); omitted sampling fields are sent at vLLM's neutral values.
        """
        params = with_explicit_sampling(sampling_params)
        params.setdefault("logprobs", 0)
        rid = request_id or f"gen-{uuid.uuid4().hex}"
        body: dict[str, Any] = {"token_ids": list(token_ids), "sampling_params": params, "request_id": rid}
        return await self._post_choices("/inference/v1/generate", body, model, timeout, "generate", rid)

    async def generate(
        self, token_ids: list[int], sampling_params: Mapping[str, Any], **kwargs: Any
    ) -> GenerationResult:
        """Like :meth:`generate_n` for one sequence (``n`` must be 1)."""
        _check_single(sampling_params, "generate")
        return (await self.generate_n(token_ids, sampling_params, **kwargs))[0]

    async def complete_n(
        self,
        token_ids: list[int],
        sampling_params: Mapping[str, Any],
        *,
        model: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> list[GenerationResult]:
        """``POST /v1/completions`` with a token-id prompt; one result per choice.

        Sends ``return_tokens_as_token_ids`` and ``return_token_ids`` so top-N keys are
        token ids, and ``return_weight_versions`` (vLLM returns the spans only when asked);
        ``logprobs`` defaults to 0. Every sampling field goes out explicitly (omitted ones at
        vLLM's neutral values): vLLM fills omitted fields from the model's generation_config.json.
        Always pass ``max_tokens`` (vLLM's default is 16).
        """
        body = with_explicit_sampling({k: v for k, v in sampling_params.items() if k not in ("detokenize",)})
        body.setdefault("logprobs", 0)
        body.update(
            prompt=list(token_ids), return_tokens_as_token_ids=True, return_token_ids=True, return_weight_versions=True
        )
        if request_id is not None:
            body["request_id"] = request_id
        return await self._post_choices("/v1/completions", body, model, timeout, "completions", request_id)

    async def _post_choices(
        self,
        path: str,
        body: dict[str, Any],
        model: str | None,
        timeout: float | None,
        kind: str,
        request_id: str | None,
    ) -> list[GenerationResult]:
        """POST a generation body and parse its choices in index order; large answers go to the answer-parsing
        helpers when the client has them (``answer_parse``)."""
        if model is not None:
            body["model"] = model
        raw = await self.request("POST", path, json_body=body, timeout=timeout, parse="bytes")
        parsers = self.answer_parsers
        if parsers is not None and parsers.active:
            return await parsers.parse(raw, kind, request_id)
        t_parse = time.perf_counter()
        try:
            return parse_choices(raw, kind, request_id)
        finally:
            self.parse_seconds += time.perf_counter() - t_parse

    async def complete(
        self, token_ids: list[int], sampling_params: Mapping[str, Any], **kwargs: Any
    ) -> GenerationResult:
        """Like :meth:`complete_n` for one sequence (``n`` must be 1)."""
        _check_single(sampling_params, "complete")
        return (await self.complete_n(token_ids, sampling_params, **kwargs))[0]

    async def supports_sampling_mask(self, probe_token_ids: list[int] | None = None) -> bool:
        """Whether the server answers ``/inference/v1/generate`` with sampling masks (SPEC G9).

        Sends a one-token request with ``top_k`` > 0; False on 403/404 (endpoint off) or a null mask.
        """
        body = {
            "token_ids": probe_token_ids or [0],
            "sampling_params": {"max_tokens": 1, "temperature": 1.0, "top_k": 8, "logprobs": 0},
        }
        try:
            data = await self.request("POST", "/inference/v1/generate", json_body=body, retries=1)
        except ServerError as exc:
            if exc.status in (400, 403, 404, 405, 501):
                logger.info("no sampling masks from %s: %s", self.base_url, exc)
                return False
            raise
        choices = data.get("choices") or []
        return bool(choices) and choices[0].get("sampling_mask") is not None

    # ------------------------------------------------------------------ pause / resume

    async def pause(
        self, mode: str = "abort", timeout: float | None = None, *, clear_cache: bool | None = None
    ) -> None:
        """``POST /pause?mode=...``; returns once the pause is in effect (``wait`` drains first).

        ``clear_cache`` is sent only when given. Weight rounds pass True: vLLM's router calls the parameter
        deprecated, yet its engine core still preempts the frozen requests and clears the caches only with it, so
        their KV is recomputed with the new weights; relying on the default would break silently if it changed.
        """
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode {mode!r} is not one of 'abort', 'wait', 'keep'")
        params = {"mode": mode}
        if clear_cache is not None:
            params["clear_cache"] = "true" if clear_cache else "false"
        await self.request("POST", "/pause", params=params, timeout=timeout)

    async def resume(self, timeout: float | None = None) -> None:
        await self.request("POST", "/resume", timeout=timeout)

    async def is_paused(self) -> bool:
        return bool((await self.request("GET", "/is_paused"))["is_paused"])

    # ------------------------------------------------------------------ LoRA

    async def load_lora_adapter(self, name: str, path: str, *, load_inplace: bool = False) -> None:
        """``POST /v1/load_lora_adapter``; the server needs ``--enable-lora``."""
        body = {"lora_name": name, "lora_path": str(path), "load_inplace": load_inplace}
        await self.request("POST", "/v1/load_lora_adapter", json_body=body, retries=0, parse="text")

    async def unload_lora_adapter(self, name: str) -> None:
        await self.request("POST", "/v1/unload_lora_adapter", json_body={"lora_name": name}, retries=0, parse="text")

    # ------------------------------------------------------------------ weight transfer (dev mode)
    # Never retried: a repeated call would enter the collective twice.

    async def init_weight_transfer_engine(self, init_info: Mapping[str, Any], timeout: float | None = None) -> None:
        await self.request(
            "POST", "/init_weight_transfer_engine", json_body={"init_info": dict(init_info)}, timeout=timeout, retries=0
        )

    async def start_weight_update(self, timeout: float | None = None) -> None:
        await self.request("POST", "/start_weight_update", timeout=timeout, retries=0)

    async def update_weights(self, update_info: Mapping[str, Any], timeout: float | None = None) -> Any:
        """``POST /update_weights``; returns the server's answer (ours adds a ``profile`` when asked to)."""
        return await self.request(
            "POST", "/update_weights", json_body={"update_info": dict(update_info)}, timeout=timeout, retries=0
        )

    async def finish_weight_update(self, weight_version: str | None = None, timeout: float | None = None) -> None:
        body = {"weight_version": weight_version} if weight_version is not None else {}
        await self.request("POST", "/finish_weight_update", json_body=body, timeout=timeout, retries=0)

    async def weight_round_step(
        self,
        update_info: Mapping[str, Any] | None,
        *,
        begin: bool,
        end: bool,
        weight_version: str | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Ours: ``POST /weight_round_step``, one update call with ``begin`` (pause + start) and ``end`` (finish +
        resume) folded in (the embedded server only: ``/server_info`` ``asyncgrpo.weight_round_step``)."""
        body: dict[str, Any] = {"begin": begin, "end": end}
        if update_info is not None:
            body["update_info"] = dict(update_info)
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self.request("POST", "/weight_round_step", json_body=body, timeout=timeout, retries=0)

    async def shutdown_weight_transfer_engine(self, timeout: float | None = None) -> None:
        await self.request("POST", "/shutdown_weight_transfer_engine", timeout=timeout, retries=0)

    async def weight_info(self) -> dict[str, Any]:
        return await self.request("GET", "/weight_info")

    async def reset_prefix_cache(self) -> bool:
        data = await self.request("POST", "/reset_prefix_cache")
        return bool((data or {}).get("success", True))
