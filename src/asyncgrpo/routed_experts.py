"""The ``routed_experts`` field of vLLM 0.33's generation answers: what it holds and how it is encoded.

With ``--enable-return-routed-experts`` a vLLM 0.33 server adds ``routed_experts`` to every choice of
``/v1/completions``, ``/v1/chat/completions`` and ``/inference/v1/generate``
(``vllm/entrypoints/openai/completion/serving.py``, ``.../chat_completion/serving.py``,
``.../scale_out/token_in_token_out/serving.py``): the expert ids each MoE layer's router chose for each token
the engine forwarded, as a ``.npy`` file in base64 (``vllm/utils/serial_utils.py: numpy2base64``), or null
when the flag is off.

Array layout (``vllm/distributed/aux_output_connector/connector.py: take_output``; the capturer in
``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py``):

    shape [prompt_len + num_output - 1 - start, num_hidden_layers, num_experts_per_tok]
    dtype uint8 when the model has <= 256 experts, else uint16

Row ``i`` is the routing of token ``start + i`` of ``prompt + output``; the last sampled token was never fed
back, so it has no row. ``start`` is the request's ``routed_experts_prompt_start`` (0 to the prompt length;
vLLM refuses other values): a multi-turn client sets it to the tokens whose routing it already holds.
Layers without a router (dense layers of a mixed model) hold zeros.

Numpy only: both the server's HTTP layer and the client import this module.
"""

from __future__ import annotations

import base64
import io

import numpy as np

FIELD = "routed_experts"  # the choice's field (all three endpoints)
PROMPT_START = "routed_experts_prompt_start"  # the request's field (completions: top level; generate: sampling_params)
SERVER_FLAG = "--enable-return-routed-experts"  # vLLM's (and the embedded server's) command-line flag
CONFIG_KEY = "enable_return_routed_experts"  # /server_info: vllm_config.aux_output_config.<this>
NO_ROUTING = -1  # the trainer's marker for a token without a sampler routing (int16 arrays)


def routed_dtype(num_experts: int) -> np.dtype:
    """vLLM's wire dtype: the narrowest unsigned type holding every expert id."""
    if num_experts <= 0:
        raise ValueError(f"a routed-experts array needs a model with experts, got num_experts={num_experts}")
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.uint16)


def encode(array: np.ndarray) -> str:
    """``.npy`` bytes in base64 (ASCII), as vLLM's ``numpy2base64`` writes them (no pickles)."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return base64.b64encode(buffer.getbuffer()).decode("ascii")


def decode(text: str) -> np.ndarray:
    """The array of a ``routed_experts`` field: ``[tokens, layers, top_k]`` unsigned ids.

    Raises:
        ValueError: not base64 ``.npy`` of a 3-d integer array (the server is not vLLM 0.33's protocol).
    """
    try:
        array = np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)
    except (ValueError, OSError, TypeError) as exc:
        raise ValueError(f"routed_experts is not base64 .npy data ({exc})") from exc
    if array.ndim != 3 or array.dtype.kind not in "ui":
        raise ValueError(
            f"routed_experts must decode to a [tokens, layers, top_k] integer array, got {array.dtype} {array.shape}"
        )
    return array


def bytes_per_token(num_layers: int, top_k: int, num_experts: int) -> float:
    """Wire bytes one routed token costs in JSON: base64 of ``layers * top_k`` ids (4/3 of the raw bytes)."""
    return num_layers * top_k * routed_dtype(num_experts).itemsize * 4 / 3
