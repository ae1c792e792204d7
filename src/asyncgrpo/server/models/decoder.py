"""A compact decoder-only forward (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

The weights stay in the module tree they were loaded into (transformers' model, or the same tree built
without transformers by ``direct_load.py``), under their checkpoint names (``q_proj``/``k_proj``/``v_proj``,
``gate_proj``/``up_proj``), so a weight update can be copied in place by name and CUDA graphs that read those
tensors stay valid. The q/k/v (and gate/up) parameters are views into one fused
matrix each, so the forward runs one matmul for them. Only the forward is ours:
it works on a flat batch of tokens ``[T, hidden]`` (several sequences packed
together, no padding), fuses the small element-wise steps into Triton kernels
(``layers/fused.py``) and reads/writes K/V through ``layers/attention.py``.

RoPE: the loaded model's own ``model.model.rotary_emb`` module computes cos/sin
for positions ``0..max_model_len-1`` once, which covers every rope-scaling
variant the installed transformers knows (dynamic NTK is evaluated at the full
length once rather than per call).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from asyncgrpo.server.layers import attention, fused
from asyncgrpo.server.models.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class _Layer:
    """Direct references to one decoder layer's HF modules (avoids attribute walks in the hot loop).

    The q/k/v and gate/up weights are re-seated as *views* into one fused buffer each (``qkv_w``,
    ``gate_up_w``): the HF parameters keep their names, shapes and identity, so an in-place weight
    update by name writes straight into the fused matrix and one matmul serves all three (or both).
    """

    def __init__(self, hf_layer: nn.Module) -> None:
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.q, self.k, self.v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.ln1, self.ln2 = hf_layer.input_layernorm, hf_layer.post_attention_layernorm
        self.qkv_w, self.qkv_b = _fuse([self.q, self.k, self.v])
        self.gate_up_w, self.gate_up_b = _fuse([self.gate, self.up])
        self.qkv_slices = _slices([("q_proj", self.q), ("k_proj", self.k), ("v_proj", self.v)])
        self.gate_up_slices = _slices([("gate_proj", self.gate), ("up_proj", self.up)])


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) along the output dim and make each parameter a view of its rows."""
    out = []
    for attr in ("weight", "bias"):
        params = [getattr(lin, attr, None) for lin in linears]
        if any(p is None for p in params):
            out.append(None)
            continue
        fused = torch.cat([p.data for p in params], dim=0)
        start = 0
        for p in params:
            p.data = fused[start : start + p.shape[0]]
            start += p.shape[0]
        out.append(fused)
    return out[0], out[1]


def _slices(named: list[tuple[str, nn.Linear]]) -> list[tuple[str, int, int]]:
    out, start = [], 0
    for name, lin in named:
        out.append((name, start, start + lin.weight.shape[0]))
        start += lin.weight.shape[0]
    return out


def _eps(norm: nn.Module) -> float:
    return getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """HF's RMSNorm arithmetic: normalise in fp32, cast back, then scale."""
    return fused.rms_norm(x, norm.weight, _eps(norm))  # one Triton kernel on CUDA, the same torch ops elsewhere


def check_architecture(hf_model: nn.Module) -> str:
    """Name of a supported architecture or a ValueError naming the supported ones."""
    archs = list(getattr(hf_model.config, "architectures", None) or []) or [type(hf_model).__name__]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ValueError(
        f"architecture {archs} is not supported by the embedded engine; supported: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}. Use a real vLLM server for other models."
    )


class DecoderLM:
    """Our forward over an HF decoder-only causal LM's weights.

    Args:
        hf_model: a loaded ``*ForCausalLM`` of a supported family (weights used in place).
        max_model_len: positions for which RoPE tables are precomputed.
    """

    def __init__(self, hf_model: nn.Module, max_model_len: int) -> None:
        self.arch = check_architecture(hf_model)
        cfg = hf_model.config
        self.hf_model = hf_model
        self.config = cfg
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None) or []
        uses_window = "sliding_attention" in layer_types or (self.arch == "MistralForCausalLM" and window)
        if uses_window and window is not None and window < max_model_len:
            raise ValueError(
                f"sliding-window attention (window {window}) is not implemented; pass max_model_len <= {window}"
            )
        base = hf_model.model
        self.embed = base.embed_tokens
        self.layers = [_Layer(layer) for layer in base.layers]
        self.norm = base.norm
        self.lm_head = hf_model.lm_head
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden_size = cfg.hidden_size
        self.intermediate_size = self.layers[0].gate_up_w.shape[0] // 2  # the fused gate/up rows, halved
        self.scale = self.head_dim**-0.5
        self.act = _activation(cfg.hidden_act)
        self.silu = cfg.hidden_act in ("silu", "swish")
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        self.vocab_size = self.lm_head.weight.shape[0]
        self.cos, self.sin = self._rope_tables(base.rotary_emb, max_model_len)

    @torch.no_grad()
    def _rope_tables(self, rotary: nn.Module, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        pos = torch.arange(max_len, device=self.device)[None]
        cos, sin = rotary(probe, pos)  # [1, L, D] each, already in the model dtype like HF
        return cos[0].contiguous(), sin[0].contiguous()

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states after the final norm. input_ids/positions: [T]; returns [T, hidden].

        Per layer: fused QKV matmul -> one kernel for q/k norm + RoPE + KV write -> attention -> o_proj ->
        residual add fused with the next RMSNorm -> fused gate/up matmul -> SiLU*up -> down_proj.
        """
        h = self.embed.weight[input_ids]  # [T, hidden]
        lora = batch.lora_groups
        need_kv = batch.is_prefill and (batch.row_idx is None or batch.fresh_idx is not None)
        T = h.shape[0]
        x = _rms_norm(h, self.layers[0].ln1)
        for i, layer in enumerate(self.layers):
            qkv = self._fused_proj(x, layer.qkv_w, layer.qkv_b, layer.qkv_slices, i, lora)
            qn = (layer.q_norm.weight, _eps(layer.q_norm)) if layer.q_norm is not None else None
            kn = (layer.k_norm.weight, _eps(layer.k_norm)) if layer.k_norm is not None else None
            k_cache, v_cache = kv_caches[i]
            q, k, v = fused.qkv_rope_write(
                qkv, positions, self.cos, self.sin, qn, kn, batch.slot_mapping, k_cache, v_cache,
                self.num_heads, self.num_kv_heads, need_kv,
            )  # fmt: skip
            if batch.copy_src is not None:  # last-token blocks start as copies of cached ones (prefix caching)
                for cache in (k_cache, v_cache):
                    cache.index_copy_(0, batch.copy_dst, cache.index_select(0, batch.copy_src))
            if batch.is_prefill:
                o = attention.prefill_attention(q, k, v, batch, self.scale, k_cache, v_cache)
            else:
                o = attention.decode_attention(q, k_cache, v_cache, batch, self.scale)
            h, x = fused.add_rms_norm(h, self._proj(o.reshape(T, -1), layer.o, i, "o_proj", lora), layer.ln2.weight,
                                      _eps(layer.ln2))  # fmt: skip
            gate_up = self._fused_proj(x, layer.gate_up_w, layer.gate_up_b, layer.gate_up_slices, i, lora)
            act = fused.silu_mul(gate_up) if self.silu else self._act_mul(gate_up)
            nxt = self.layers[i + 1].ln1 if i + 1 < len(self.layers) else self.norm
            h, x = fused.add_rms_norm(h, self._proj(act, layer.down, i, "down_proj", lora), nxt.weight, _eps(nxt))
        return x

    def _act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        n = gate_up.shape[-1] // 2
        return self.act(gate_up[:, :n]) * gate_up[:, n:]

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in the model dtype; ``out``: written there (a decode graph's shared logits
        buffer: no copy of [N, vocab] after the matmul)."""
        bias = getattr(self.lm_head, "bias", None)
        if out is None or bias is not None:
            logits = F.linear(hidden, self.lm_head.weight, bias)
            return logits if out is None else out.copy_(logits)
        return torch.mm(hidden, self.lm_head.weight.t(), out=out)

    @staticmethod
    def _fused_proj(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        slices: list[tuple[str, int, int]],
        layer: int,
        lora: list[tuple[object, torch.Tensor]] | None,
    ) -> torch.Tensor:
        """One matmul for several projections; LoRA deltas are added to each one's column slice."""
        y = F.linear(x, weight, bias)
        if lora:
            for adapter, idx in lora:
                for name, a0, a1 in slices:
                    ab = adapter.weights.get((layer, name))  # type: ignore[attr-defined]
                    if ab is None:
                        continue
                    a, b, scale = ab
                    delta = (x.index_select(0, idx) @ a.t()) @ b.t()
                    y[:, a0:a1].index_add_(0, idx, delta, alpha=scale)
        return y

    @staticmethod
    def _proj(
        x: torch.Tensor, lin: nn.Linear, layer: int, name: str, lora: list[tuple[object, torch.Tensor]] | None
    ) -> torch.Tensor:
        y = F.linear(x, lin.weight, lin.bias)
        if lora:
            for adapter, idx in lora:
                ab = adapter.weights.get((layer, name))  # type: ignore[attr-defined]
                if ab is None:
                    continue
                a, b, scale = ab  # a: [r, in], b: [out, r]
                delta = (x.index_select(0, idx) @ a.t()) @ b.t()
                y.index_add_(0, idx, delta, alpha=scale)
        return y


def _activation(name: str):
    if name in ("silu", "swish"):  # transformers' ACT2FN maps both to SiLU; the direct load imports no transformers
        return F.silu
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        raise ValueError(f"hidden_act {name!r} is not known to transformers")
    return ACT2FN[name]


# ---------------------------------------------------------------------- loading
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was asked for but CUDA is not available; use device='cpu'")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(dtype: str | torch.dtype, config, device: torch.device) -> torch.dtype:
    """``"auto"``: the checkpoint's dtype on CUDA, float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        ckpt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        return _DTYPES[ckpt] if isinstance(ckpt, str) else ckpt
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use 'auto' or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]
