"""Which tensors the server gets after an optimizer step (G10, T6 merged mode).

The server loads weights by their Hugging Face checkpoint names. A plain model
sends its parameters as they are (a tied LM head once, as the embedding). A PEFT
model sends *merged* weights — ``W + scale · B A`` for every LoRA-wrapped
layer — under the base model's names, so any server (vLLM or embedded) needs no
adapter support.

Streaming: :func:`policy_weight_metadata` reads names, dtypes and *global* shapes
without gathering or merging anything (a DTensor reports its global shape), so
the update can be announced up front; :func:`policy_weights` then makes one full
tensor at a time (a DTensor ``full_tensor()`` gather under FSDP2, a merged LoRA
weight under PEFT) and drops it before making the next, so no rank holds more
than two full tensors beyond its shards (the one being sent and, under FSDP2, the
next one's gather, issued early so that it overlaps the send). Both walk the same list, in the same
order; every rank must iterate :func:`policy_weights` to the end (the gathers
are collective).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from asyncgrpo.models.vlm import non_text_parameter_ids
from asyncgrpo.weights.collectives import TensorMeta

_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class _Source:
    """One weight the server gets: its HF name, the (possibly sharded) parameter, the LoRA layer merged into it."""

    name: str
    param: torch.Tensor
    lora_layer: torch.nn.Module | None = None


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a possibly sharded parameter (collective on every rank for a DTensor)."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else t


def is_peft_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a PEFT wrapper (its LoRA layers are merged on the way to the server)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _active_adapter(model: torch.nn.Module) -> str:
    adapter = getattr(model, "active_adapter", "default")
    return adapter[0] if isinstance(adapter, list) else adapter


def _sources(model: torch.nn.Module) -> list[_Source]:
    """The server's weights in send order; nothing is gathered or merged here."""
    tower = non_text_parameter_ids(model)  # a vision-language model syncs its text model only (T4)
    if not is_peft_model(model):
        return [_Source(name, p) for name, p in model.named_parameters() if id(p) not in tower]
    adapter = _active_adapter(model)
    lora_layers = {
        name: module
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")
    }
    out = []
    for name, p in model.named_parameters():
        if id(p) in tower:
            continue
        # LoRA factors travel merged; a modules_to_save wrapper sends its trained copy, not the frozen original.
        if "lora_" in name or ".original_module." in name:
            continue
        layer = None
        if name.endswith(".base_layer.weight"):
            candidate = lora_layers.get(name.removesuffix(".base_layer.weight"))
            if candidate is not None and adapter in candidate.lora_A and not getattr(candidate, "merged", False):
                layer = candidate
        clean = name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")
        clean = clean.replace(f".modules_to_save.{adapter}.", ".")
        out.append(_Source(clean, p, layer))
    return out


def policy_weight_metadata(model: torch.nn.Module) -> list[TensorMeta]:
    """``TensorMeta(name, dtype, global shape)`` of every tensor :func:`policy_weights` yields, in its order.

    Local and cheap: no gather, no merge (a merged weight keeps its base weight's dtype and shape).
    """
    return [TensorMeta(s.name, s.param.dtype, tuple(s.param.shape)) for s in _sources(model)]


def _sharded(t: torch.Tensor) -> bool:
    return callable(getattr(t, "full_tensor", None))


def _start_gather(t: torch.Tensor) -> torch.Tensor:
    """Issue the all-gather of a sharded parameter without waiting for it (funcol's async tensor); plain tensors
    and torch versions without ``async_op`` fall back to :func:`_full`."""
    if not _sharded(t):
        return t
    try:
        from torch.distributed.tensor import Replicate

        return t.redistribute(placements=[Replicate()] * t.device_mesh.ndim, async_op=True).to_local()
    except (ImportError, TypeError, AttributeError):
        return _full(t)


def _finish_gather(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor of a gather from :func:`_start_gather` (on NCCL the current stream waits; the host
    does not)."""
    if type(t).__name__ == "AsyncCollectiveTensor":
        return t.wait()
    return t


def policy_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full detached tensor)`` of every weight the server needs, one at a time.

    Each yielded tensor is released by the generator before the next is made; a consumer that drops it
    too keeps at most two full tensors alive: under FSDP2 the gather of the next sharded weight is issued
    before the current one is yielded, so it runs on the collective's stream while the current one is packed
    and sent (prefetch one ahead; every rank issues the same gathers in the same order). Merged LoRA weights
    are made one at a time. (No ``@torch.no_grad()`` here: its generator wrapper holds the last yielded
    tensor while the next one is made.)
    """
    adapter = _active_adapter(model)
    sources = _sources(model)
    ahead: tuple[int, torch.Tensor] | None = None  # (index, gather in flight) of the next sharded weight
    for index, source in enumerate(sources):
        with torch.no_grad():
            if ahead is not None and ahead[0] == index:
                tensor = _finish_gather(ahead[1])
            else:
                tensor = _full(source.param.detach())
            ahead = None
            if source.lora_layer is not None:
                # The fresh delta takes the sum in place: one new tensor per merged weight (x + y == y + x).
                merged = _full(source.lora_layer.get_delta_weight(adapter).detach()).to(tensor.dtype)
                tensor = merged.add_(tensor)
                del merged
            following = sources[index + 1] if index + 1 < len(sources) else None
            if following is not None and following.lora_layer is None and _sharded(following.param):
                ahead = (index + 1, _start_gather(following.param.detach()))
        yield source.name, tensor
        del tensor
    del ahead


def join_policy_gathers(model: torch.nn.Module) -> None:
    """Ranks other than the sender: take part in :func:`policy_weights`' collective gathers, keeping nothing."""
    for item in policy_weights(model):
        del item


class GatherFollower:
    """``WeightSync`` of a trainer process other than rank 0 under merged sync (rank 0 holds the sender).

    It meets rank 0 in the barrier rank 0 enters once the servers are paused, then joins the same gathers in the
    same order: the gathers start together, and a failed round is never replayed by rank 0 alone.
    """

    backend: str | None = None
    served_model: str | None = None

    def push(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        torch.distributed.barrier()
        join_policy_gathers(model)
        return {}

    def close(self) -> None:
        """Nothing to leave: the groups are rank 0's."""
