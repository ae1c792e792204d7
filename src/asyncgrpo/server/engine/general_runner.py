"""The runner of the general model path: steps an HF model's own forward with the model's own cache objects.

The engine's counterpart of ``runner.py`` for every family ``models/hf.py`` serves (the compact decoder's runner
owns CUDA graphs and the paged KV cache; this one keeps the HF caches of cohorts of sequences instead). The KV
cache here does block accounting only, so the scheduler treats both paths alike.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from asyncgrpo.server.engine.kv_cache import KVCache
from asyncgrpo.server.engine.routing_capture import RoutingCapture
from asyncgrpo.server.engine.scheduler import Sequence
from asyncgrpo.server.models.hf import GeneralLM


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

    Same interface as :class:`~asyncgrpo.server.engine.runner.ModelRunner`. Sequences prefilled in one step with the
    same length (a GRPO group: the same prompt sampled several times) form a :class:`_Cohort` and run as one
    batch ``[B, T]`` / ``[B, 1]`` without padding; others run alone. A preempted sequence (``num_cached`` reset to
    0) or a finished one leaves its cohort, and its next prefill recomputes from its tokens, as on the native path.
    """

    backend = "hf-general"

    def __init__(self, model: GeneralLM, kv: KVCache, routing: RoutingCapture | None = None) -> None:
        self.model = model
        self.kv = kv
        self.routing = routing  # --enable-return-routed-experts: each sequence keeps its routers' expert ids
        self.device = model.device
        self._where: dict[Sequence, tuple[_Cohort, int]] = {}
        params = inspect.signature(model.hf_model.forward).parameters
        # transformers >= 5.2x names the cache argument ``cache``; earlier releases ``past_key_values``
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keep_arg = "logits_to_keep" if "logits_to_keep" in params else None

    def check_kernels(self) -> None:
        """No Triton kernels of ours on the general path."""

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
            routed = self.routing.take(len(group), len(group[0].token_ids)) if self.routing else None
            cohort = _Cohort(cache, list(group))
            for r, (i, s) in enumerate(zip(idx, group)):
                self._where[s] = (cohort, r)
                s.num_cached = len(s.token_ids)
                rows[i] = logits[r]
                if routed is not None:  # the whole sequence was forwarded: its rows start again
                    s.routed_rows = [routed[r]]
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
            routed = self.routing.take(len(ids), 1) if self.routing else None
            for r, m in enumerate(cohort.members):
                if m is not None:
                    m.num_cached = len(m.token_ids) + ahead
                    out[m] = logits[r]
                    if routed is not None and m.routed_rows is not None:
                        m.routed_rows.append(routed[r])  # the fed token's routing, in position order
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
