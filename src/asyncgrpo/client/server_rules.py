"""What the client knows about vLLM 0.33's answers beyond the wire format (docs/protocol.md).

Pure functions, no I/O: which fields to always send (vLLM fills omitted completion
fields from the model's ``generation_config.json``), what to tell the user on a
dev-mode 404 or an unconfigured weight transfer, where ``/server_info`` keeps
the KV-cache capacity, and which 400s say a prompt is too long.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncgrpo.vllm_traits import config_section

# vLLM's neutral value of every sampling field /v1/completions would otherwise take from the model's
# generation_config.json (--generation-config auto): the client always sends them, so the processed
# log-probs come from the distribution the trainer recomputes, whatever that file says.
NEUTRAL_SAMPLING: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}  # fmt: skip

# Routes a vLLM server serves only with VLLM_SERVER_DEV_MODE=1 (a bare 404 otherwise).
DEV_MODE_ROUTES = frozenset({
    "/pause", "/resume", "/is_paused", "/get_world_size", "/server_info", "/reset_prefix_cache", "/weight_info",
    "/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
    "/shutdown_weight_transfer_engine", "/abort_requests",
})  # fmt: skip
DEV_MODE_HINT = (
    "the server has no RL routes: start vLLM with VLLM_SERVER_DEV_MODE=1 (the embedded server serves them unless "
    "VLLM_SERVER_DEV_MODE=0)"
)
NOT_CONFIGURED_HINT = (
    'the server was started without weight transfer: add --weight-transfer-config \'{"backend": "nccl"}\' to '
    "its command line"
)


def explain(path: str, status: int, message: str) -> str:
    """The server's error message, plus what to change when vLLM's answer alone does not say it."""
    if status == 404 and path in DEV_MODE_ROUTES:
        return f"{message or 'Not Found'}; {DEV_MODE_HINT}"
    if status == 500 and "Weight transfer not configured" in message:
        return f"{message}; {NOT_CONFIGURED_HINT}"
    return message


def with_explicit_sampling(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with every omitted (or null) sampling field set to vLLM's neutral value."""
    out = {k: v for k, v in params.items() if v is not None}
    for key, value in NEUTRAL_SAMPLING.items():
        out.setdefault(key, value)
    return out


def kv_capacity(info: Mapping[str, Any]) -> int | None:
    """KV capacity in tokens from a ``/server_info`` answer (see :meth:`AsyncServerClient.kv_cache_tokens`)."""
    cache = config_section(info, "vllm_config", "cache_config")
    dp = config_section(info, "vllm_config", "parallel_config").get("data_parallel_size", 1)
    tokens = cache.get("kv_cache_size_tokens")
    if isinstance(tokens, int) and tokens > 0:
        return tokens * (dp if isinstance(dp, int) and dp > 0 else 1)
    blocks, size = cache.get("num_gpu_blocks"), cache.get("block_size")
    if isinstance(blocks, int) and isinstance(size, int):
        return blocks * size
    return None


# Phrases of vLLM 0.33's (and the embedded server's) 400 answers to a prompt that leaves no room under
# max_model_len (renderers/params.py, v1/engine/input_processor.py, serve/utils/api_utils.py).
_LENGTH_PHRASES = ("maximum context length", "maximum model length", "max_model_len")


def is_length_error(message: str) -> bool:
    """Whether a 400's message says the prompt is too long (and not, say, a rejected sampling setting)."""
    text = message.lower()
    return any(p in text for p in _LENGTH_PHRASES)
