"""Tiny random-init models with the real SmolLM2 tokenizer, for tests and CPU smoke runs.

They run the real architecture code of transformers (Llama, Qwen2, Qwen3, and
the families the embedded server serves through its general path: a Qwen3.5
Gated DeltaNet hybrid, Qwen3-MoE, a Qwen3-VL and a Qwen3.5 vision-language checkpoint) in
milliseconds on two CPU cores; only the weights are random.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from filelock import FileLock

from asyncgrpo.assets.demo_model import cache_dir, smollm2_tokenizer_dir

TINY_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_5", "qwen3_moe", "olmoe", "qwen3_vl", "qwen3_5_vlm")


def tiny_config(arch: str = "llama", **overrides: Any):
    """A small config of the given family sized for the SmolLM2 vocabulary (49,152 tokens)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    from asyncgrpo.assets.demo_model import smollm2_tokenizer

    tok = smollm2_tokenizer()
    base: dict[str, Any] = dict(  # noqa: C408 - reads like the config's keyword arguments
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        cls = LlamaConfig
    elif arch == "qwen2":
        cls = Qwen2Config
    elif arch == "qwen3":
        cls = Qwen3Config
        base["head_dim"] = 16
    elif arch in ("qwen3_5", "qwen3_moe", "olmoe", "qwen3_vl", "qwen3_5_vlm"):
        return _family_config(arch, base, overrides)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {TINY_ARCHS}")
    base.update(overrides)
    return cls(**base)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides: Any):
    """A random-init fp32 model of the tiny config (deterministic for a given seed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    return model.eval()


def _family_config(arch: str, base: dict[str, Any], overrides: dict[str, Any]):
    """Tiny configs of the general-path families: ``qwen3_5`` (three Gated DeltaNet layers, one attention layer),
    ``qwen3_moe`` (4 experts, top-2), ``olmoe`` (8 experts, top-2, un-normalised top-k weights), ``qwen3_vl`` (a 1-block vision tower in front of a tiny Qwen3 text model)
    and ``qwen3_5_vlm`` (the same in front of the ``qwen3_5`` hybrid: the family of the reference's quick start,
    Qwen/Qwen3.5-2B; docs/spec.md). For the two vision-language ones ``overrides`` go to the text config."""
    from transformers import OlmoeConfig, Qwen3_5Config, Qwen3_5TextConfig, Qwen3MoeConfig, Qwen3VLConfig

    if arch == "qwen3_5_vlm":
        text = _family_config("qwen3_5", base, {"head_dim": 32}).to_dict()
        for key in ("architectures", "model_type", "transformers_version", "dtype", "torch_dtype"):
            text.pop(key, None)
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                   "mrope_section": [2, 1, 1], "mrope_interleaved": True}  # fmt: skip
        text.update(overrides)
        vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 8,
                  "out_hidden_size": text["hidden_size"], "num_position_embeddings": 64}  # fmt: skip
        return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False,
                             eos_token_id=base["eos_token_id"])  # fmt: skip
    base = dict(base, head_dim=16)
    if arch == "qwen3_5":
        base.update(
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        )
        base.update(overrides)
        return Qwen3_5TextConfig(**base)
    if arch == "qwen3_moe":
        base.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        base.update(overrides)
        return Qwen3MoeConfig(**base)
    if arch == "olmoe":
        base.update(num_experts=8, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False)
        base.pop("head_dim")
        base.update(overrides)
        return OlmoeConfig(**base)
    text = dict(base, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    text.update(overrides)
    vision = dict(  # noqa: C408 - keyword arguments of the vision config
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
        temporal_patch_size=2, out_hidden_size=text["hidden_size"], num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )  # fmt: skip
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"],
        pad_token_id=base["pad_token_id"],
    )


def tiny_model_dir(arch: str = "llama", tmp_dir: str | Path | None = None, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny model + the SmolLM2 tokenizer to a directory and return it.

    Without ``tmp_dir`` the directory is cached by (arch, seed, overrides) so test
    modules share it.
    """
    key = hashlib.sha1(json.dumps([arch, seed, overrides], sort_keys=True, default=str).encode()).hexdigest()[:12]
    out = Path(tmp_dir) if tmp_dir is not None else cache_dir() / "tiny" / f"{arch}-{key}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock", timeout=600):
        if (out / "config.json").is_file():
            return out
        staging = Path(tempfile.mkdtemp(dir=out.parent))
        tiny_model(arch, seed=seed, **overrides).save_pretrained(staging)
        tok_dir = smollm2_tokenizer_dir()
        for f in tok_dir.iterdir():
            shutil.copy(f, staging / f.name)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    return out
