"""The engine's general model path: any HF causal LM (or a vision-language checkpoint, text only) through its own forward.

:mod:`model` runs a compact forward of its own for Llama/Mistral/Qwen2/Qwen3. Every other family the trainer
accepts (Gated DeltaNet hybrids such as Qwen3.5/Qwen3-Next, MoE models, vision-language checkpoints) goes here:
the model's own ``forward`` with the model's own cache object (``DynamicCache`` or, for DeltaNet hybrids, the
cache that also holds convolution and recurrent state). It is slower, but everything after the logits — the
sampler, processed log-probs, top-N, masks, seeds — and the scheduler are shared with the native path, so
outputs agree with an HF forward on the same tokens.

A vision-language checkpoint (its config has ``vision_config``) loads through ``AutoModelForImageTextToText``,
like the trainer loads it, so parameter names (``model.language_model.*``, ``lm_head.*``) match the names the
trainer sends; its vision tower is loaded but never run (image prompts are refused upstream).
"""

from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from asyncgrpo.models.vlm import is_vision_language
from asyncgrpo.server.kv_cache import KVCache
from asyncgrpo.server.model import SUPPORTED_ARCHITECTURES, resolve_device, resolve_dtype
from asyncgrpo.server.scheduler import Sequence

logger = logging.getLogger(__name__)


def architecture_of(hf_model: nn.Module) -> str:
    archs = list(getattr(hf_model.config, "architectures", None) or [])
    return archs[0] if archs else type(hf_model).__name__


def is_native(hf_model: nn.Module) -> bool:
    """True for the families :class:`~asyncgrpo.server.model.DecoderLM` runs itself."""
    archs = list(getattr(hf_model.config, "architectures", None) or []) or [type(hf_model).__name__]
    return type(hf_model).__name__ in SUPPORTED_ARCHITECTURES and any(a in SUPPORTED_ARCHITECTURES for a in archs)


def load_any_model(model: str | os.PathLike | nn.Module, dtype: str | torch.dtype, device: str | torch.device):
    """An HF model on ``device`` in the resolved dtype, eval mode, no grads; from a directory or an instance.

    Causal LMs load through ``AutoModelForCausalLM``, vision-language checkpoints through
    ``AutoModelForImageTextToText``. An instance is used in place (its weights are shared, not copied).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    dev = resolve_device(device)
    if isinstance(model, nn.Module):
        hf = model
        want = resolve_dtype(dtype, hf.config, dev) if dtype != "auto" else hf.dtype
        if dev.type == "cpu" and dtype == "auto":
            want = torch.float32
        hf = hf.to(device=dev, dtype=want)
    else:
        config = AutoConfig.from_pretrained(model)
        # a vision-language config may keep the checkpoint dtype in its text config only
        has_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        want = resolve_dtype(dtype, config if has_dtype else _text_config(config), dev)
        auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
        kwargs = {"device_map": str(dev)} if dev.type == "cuda" else {}
        try:
            hf = auto.from_pretrained(model, dtype=want, **kwargs)
        except ValueError as exc:
            raise ValueError(
                f"{model}: transformers cannot load this checkpoint as a causal LM or a vision-language model "
                f"({exc}); the embedded server serves models that AutoModelForCausalLM or "
                "AutoModelForImageTextToText load"
            ) from exc
        hf = hf.to(dev)
    hf.eval()
    hf.requires_grad_(False)
    return hf


def text_model_aliases(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A vision-language model's text weights also under the names a causal-LM load of its text model uses
    (``model.language_model.X`` -> ``model.X``), where that name is free."""
    prefix = "model.language_model."
    return {
        "model." + name[len(prefix) :]: p
        for name, p in params.items()
        if name.startswith(prefix) and "model." + name[len(prefix) :] not in params
    }


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


class GeneralLM:
    """The facts the engine needs about a model it runs through HF's forward (sizes, dtype, device, names).

    ``num_kv_layers``/``num_kv_heads``/``head_dim`` size the engine's block accounting (the KV cache itself
    lives in each sequence's HF cache object); ``layers`` is empty because the engine allocates no paged cache.
    """

    def __init__(self, hf_model: nn.Module) -> None:
        self.hf_model = hf_model
        self.arch = architecture_of(hf_model)
        cfg = _text_config(hf_model.config)
        self.config = cfg
        self.layers: list = []
        types = list(getattr(cfg, "layer_types", None) or [])
        n_layers = int(getattr(cfg, "num_hidden_layers", 1) or 1)
        self.num_kv_layers = max(1, sum(t == "full_attention" for t in types) if types else n_layers)
        heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        hidden = int(getattr(cfg, "hidden_size", heads) or heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
        self.hidden_size = hidden
        self.intermediate_size = int(getattr(cfg, "intermediate_size", None) or 4 * hidden)
        emb = hf_model.get_input_embeddings()
        self.dtype = emb.weight.dtype
        self.device = emb.weight.device
        out = hf_model.get_output_embeddings()
        self.vocab_size = int(out.weight.shape[0] if out is not None else emb.weight.shape[0])


@dataclass(eq=False)
class _Cohort:
    """Sequences that share one batched HF cache: prefilled together at one length, decoded in lockstep.

    ``members[row]`` is None once that row's sequence has finished or been preempted; the row keeps decoding
    a filler token (rows of a batch never interact) until the whole cohort is gone, so the cache is never
    re-indexed, whatever cache class the model uses.
    """

    cache: Any
    members: list[Sequence | None]

    @property
    def alive(self) -> bool:
        return any(m is not None for m in self.members)


class GeneralRunner:
    """Prefill and decode through the HF model's own forward with the model's own cache objects.

    Same interface as :class:`~asyncgrpo.server.runner.ModelRunner`. Sequences prefilled in one step with the
    same length (a GRPO group: the same prompt sampled several times) form a :class:`_Cohort` and run as one
    batch ``[B, T]`` / ``[B, 1]`` without padding; others run alone. A preempted sequence (``num_cached`` reset to
    0) or a finished one leaves its cohort, and its next prefill recomputes from its tokens, as on the native path.
    """

    backend = "hf-general"

    def __init__(self, model: GeneralLM, kv: KVCache) -> None:
        self.model = model
        self.kv = kv
        self.device = model.device
        self._where: dict[Sequence, tuple[_Cohort, int]] = {}
        params = inspect.signature(model.hf_model.forward).parameters
        # transformers >= 5.2x names the cache argument ``cache``; earlier releases ``past_key_values``
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keep_arg = "logits_to_keep" if "logits_to_keep" in params else None

    def capture_graphs(self) -> None:
        """No CUDA graphs on the general path."""

    @property
    def num_cohorts(self) -> int:
        """Diagnostics: batched caches alive."""
        return len({id(c) for c, _ in self._where.values()})

    def release_finished(self) -> None:
        """Drop finished sequences from their cohorts (a cohort whose rows are all gone frees its cache)."""
        self._leave(lambda s: not s.finished)

    def _leave(self, keep) -> None:
        """Drop every sequence for which ``keep(seq)`` is False from its cohort."""
        for seq in [s for s in self._where if not keep(s)]:
            cohort, row = self._where.pop(seq)
            cohort.members[row] = None

    @torch.no_grad()
    def prefill(self, seqs: list[Sequence], lora: bool = False) -> torch.Tensor:
        """Forward all tokens of the new sequences (one batch per length); logits [N, V] of their last positions."""
        self._refuse_lora(lora)
        new = set(seqs)  # a re-admitted (preempted) sequence leaves its old cohort whatever num_cached says
        self._leave(lambda s: not s.finished and s.num_cached > 0 and s not in new)
        by_len: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            by_len.setdefault(len(s.token_ids), []).append(i)
        rows: list[torch.Tensor | None] = [None] * len(seqs)
        for idx in by_len.values():
            group = [seqs[i] for i in idx]
            logits, cache = self._forward([s.token_ids for s in group], None)
            cohort = _Cohort(cache, list(group))
            for r, (i, s) in enumerate(zip(idx, group)):
                self._where[s] = (cohort, r)
                s.num_cached = len(s.token_ids)
                rows[i] = logits[r]
        return torch.stack(rows)  # type: ignore[arg-type]

    @torch.no_grad()
    def decode(self, seqs: list[Sequence], lora: bool = False, next_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One token per sequence on top of its cohort's cache; logits [B, V].

        ``next_tokens`` [B]: decode one step ahead (each sequence's newest token is sampled but not yet appended).
        """
        self._refuse_lora(lora)
        ahead = 0 if next_tokens is None else 1
        feed = {s: s.token_ids[-1] for s in seqs} if next_tokens is None else dict(zip(seqs, next_tokens.tolist()))
        running = set(seqs)
        self._leave(lambda s: s in running)
        cohorts: dict[int, _Cohort] = {}
        for s in seqs:
            cohort, _ = self._where.get(s, (None, 0))
            if cohort is None or s.num_cached != len(s.token_ids) - 1 + ahead:
                raise RuntimeError(
                    f"request {s.request_id}: no cache for its {len(s.token_ids) - 1} earlier tokens on the general "
                    "model path (a scheduler/runner mismatch)"
                )
            cohorts.setdefault(id(cohort), cohort)
        out: dict[Sequence, torch.Tensor] = {}
        for cohort in cohorts.values():
            filler = next(feed[m] for m in cohort.members if m is not None)
            ids = [[feed[m] if m is not None else filler] for m in cohort.members]
            logits, cohort.cache = self._forward(ids, cohort.cache)
            for r, m in enumerate(cohort.members):
                if m is not None:
                    m.num_cached = len(m.token_ids) + ahead
                    out[m] = logits[r]
        return torch.stack([out[s] for s in seqs])

    def _forward(self, token_ids: list[list[int]], cache: Any) -> tuple[torch.Tensor, Any]:
        """Logits [B, V] at the last position of equal-length rows, and the updated cache."""
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": True, self._cache_arg: cache}
        if self._keep_arg is not None:
            kwargs[self._keep_arg] = 1
        out = self.model.hf_model(**kwargs)
        new_cache = getattr(out, "past_key_values", None)
        if new_cache is None:
            new_cache = getattr(out, "cache", None)
        if new_cache is None:
            raise RuntimeError(f"{self.model.arch} returned no cache from its forward; it cannot generate here")
        return out.logits[:, -1], new_cache

    @staticmethod
    def _refuse_lora(lora: bool) -> None:
        if lora:
            raise RuntimeError("LoRA adapters are not supported on the general model path")
