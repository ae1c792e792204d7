"""PEFT LoRA adapters for the embedded engine.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors``
(or ``adapter_model.bin``). Supported: LoRA on any of the seven projections
(q/k/v/o/gate/up/down) of the decoder layers, ``use_rslora``, ``rank_pattern`` /
``alpha_pattern``. Rejected with a ValueError that names the cause: DoRA, LoRA
biases, ``modules_to_save``, adapters on other modules (lm_head, embeddings).

At run time a batch row with an adapter gets ``y += scale * (x @ A^T) @ B^T`` on
each adapted projection (scale = alpha / r, or alpha / sqrt(r) with rsLoRA);
rows without one are untouched (see ``DecoderLM._proj``).
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_ANY_LORA = re.compile(r"^(.*)\.lora_(?:A|B|embedding_A|embedding_B|magnitude_vector)\b")


@dataclass
class LoRAAdapter:
    """One loaded adapter: ``weights[(layer, module)] = (A [r, in], B [out, r], scale)``."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank/alpha patterns: a key matches a module by exact suffix or by regex."""
    for key, value in (patterns or {}).items():
        if module == key or module.endswith("." + key) or re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st, binf = path / "adapter_model.safetensors", path / "adapter_model.bin"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st))
    if binf.is_file():
        return torch.load(binf, map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {str(path)!r} has neither adapter_model.safetensors nor adapter_model.bin")


def read_adapter(
    name: str,
    path: str,
    *,
    max_rank: int,
    layer_shapes: dict[str, tuple[int, int]],
    num_layers: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LoRAAdapter:
    """Load and validate a PEFT LoRA directory. ``layer_shapes[module] = (out, in)`` of the base projections."""
    root = Path(path)
    cfg_path = root / "adapter_config.json"
    if not cfg_path.is_file():
        raise ValueError(f"LoRA path {path!r} has no adapter_config.json (expected a PEFT adapter directory)")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type", "LORA").upper() != "LORA":
        raise ValueError(f"adapter {name!r} is a {cfg.get('peft_type')} adapter; only LORA is supported")
    if cfg.get("use_dora"):
        raise ValueError(f"adapter {name!r} uses DoRA, which the embedded engine does not support")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"adapter {name!r} trains biases (bias={cfg['bias']!r}); only bias='none' is supported")
    if cfg.get("modules_to_save"):
        raise ValueError(f"adapter {name!r} has modules_to_save={cfg['modules_to_save']}; not supported")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, list):
        bad = [t for t in targets if t.split(".")[-1] not in SUPPORTED_TARGETS]
        if bad:
            raise ValueError(f"adapter {name!r} targets {bad}; supported modules: {', '.join(SUPPORTED_TARGETS)}")
    alpha, rslora = float(cfg.get("lora_alpha", 8)), bool(cfg.get("use_rslora", False))

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(root).items():
        m = _KEY.search(key)
        if m is None:
            lora = _ANY_LORA.match(key)
            module = lora.group(1).split(".")[-1] if lora else key
            raise ValueError(
                f"adapter {name!r} adapts {module!r} ({key}); supported modules: {', '.join(SUPPORTED_TARGETS)}"
            )
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in SUPPORTED_TARGETS or layer >= num_layers:
            raise ValueError(f"adapter {name!r} has weight {key} that matches no supported module of this model")
        pairs.setdefault((layer, module), {})[ab] = tensor

    adapter = LoRAAdapter(name=name, path=str(path), rank=0)
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter {name!r}: layer {layer} {module} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        out_f, in_f = layer_shapes[module]
        if a.shape != (r, in_f) or b.shape != (out_f, r):
            raise ValueError(
                f"adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)}, B {tuple(b.shape)}; "
                f"expected A ({r}, {in_f}) and B ({out_f}, {r}) for this model"
            )
        if r > max_rank:
            raise ValueError(f"adapter {name!r} has rank {r} > max_lora_rank={max_rank}; raise max_lora_rank")
        full = (
            f"model.layers.{layer}.{'mlp' if module in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{module}"
        )
        a_alpha = float(_pattern_value(cfg.get("alpha_pattern"), full, alpha))
        scale = a_alpha / math.sqrt(r) if rslora else a_alpha / r
        adapter.weights[(layer, module)] = (
            a.to(device=device, dtype=dtype).contiguous(),
            b.to(device=device, dtype=dtype).contiguous(),
            scale,
        )
        adapter.rank = max(adapter.rank, r)
    if not adapter.weights:
        raise ValueError(f"adapter {name!r} at {path!r} holds no LoRA weights")
    return adapter


class LoRAManager:
    """The loaded adapters by name (thread-safe registry; weights are read by the engine thread)."""

    def __init__(self, *, enabled: bool, max_rank: int, max_loras: int, model) -> None:
        self.enabled = enabled
        self.max_rank = max_rank
        self.max_loras = max_loras
        self._model = model
        self._adapters: dict[str, LoRAAdapter] = {}
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        with self._lock:
            return list(self._adapters)

    def get(self, name: str) -> LoRAAdapter:
        with self._lock:
            if name not in self._adapters:
                raise KeyError(name)
            return self._adapters[name]

    def load(self, name: str, path: str) -> None:
        if not self.enabled:
            raise ValueError("LoRA is disabled; start the engine with enable_lora=True")
        with self._lock:
            if name in self._adapters:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded; unload it or pick a new name")
            if len(self._adapters) >= self.max_loras:
                raise ValueError(
                    f"{len(self._adapters)} adapters already loaded (max_loras={self.max_loras}); unload one first"
                )
        layer0 = self._model.layers[0]
        shapes = {
            m: tuple(getattr(layer0, attr).weight.shape)
            for m, attr in zip(SUPPORTED_TARGETS, ("q", "k", "v", "o", "gate", "up", "down"))
        }
        adapter = read_adapter(
            name,
            path,
            max_rank=self.max_rank,
            layer_shapes=shapes,
            num_layers=len(self._model.layers),
            dtype=self._model.dtype,
            device=self._model.device,
        )
        with self._lock:
            if name in self._adapters or len(self._adapters) >= self.max_loras:
                raise ValueError(f"could not add LoRA adapter {name!r}: name taken or max_loras reached meanwhile")
            self._adapters[name] = adapter
        logger.info(
            "loaded LoRA adapter %r (rank %d, %d modules) from %s", name, adapter.rank, len(adapter.weights), path
        )

    def unload(self, name: str) -> None:
        with self._lock:
            if name not in self._adapters:
                raise KeyError(name)
            del self._adapters[name]
