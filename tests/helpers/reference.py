"""Independent references for the model-level tests: HF forwards, LoRA adapters, weight perturbations.

Every check of "the server/engine generates like this model" goes through here, so
the reference is written once: greedy tokens and log-probs come from plain
Hugging Face forwards (fp64 log-softmax), never from asyncgrpo code.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

PROMPT = [1, 504, 3032, 314, 260, 3241]
TOL = 1e-4
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # LoRA on every Linear


def hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The checkpoint in ``model_dir`` as a plain HF model (eval mode, CPU); a vision-language checkpoint (its
    config has ``vision_config``) as the ``AutoModelForImageTextToText`` model the trainer loads."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vlm = getattr(AutoConfig.from_pretrained(model_dir), "vision_config", None) is not None
    auto = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    return auto.from_pretrained(model_dir, dtype=dtype).eval()


def unpacked_logprobs_and_grads(
    model: torch.nn.Module, samples: Sequence[Any], weights: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The packed-training reference: each sample alone through the model's own forward.

    Returns the trained tokens' log-probs (samples in order, ``loss_mask`` positions) and the parameter gradients
    of ``sum(weights * logp)``; inputs go to ``weights``' device.
    """
    import numpy as np

    dev = weights.device
    model.zero_grad()
    out, start = [], 0
    for s in samples:
        ids = torch.from_numpy(s.token_ids)[None].to(dev)
        logp = model(input_ids=ids, use_cache=False).logits[0].log_softmax(-1)
        t = torch.from_numpy(np.flatnonzero(s.loss_mask)).to(dev)
        lp = logp[t - 1].gather(1, ids[0, t][:, None])[:, 0]
        (lp * weights[start : start + len(t)]).sum().backward()
        out.append(lp.detach())
        start += len(t)
    return torch.cat(out), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def write_tiny_llama(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random-init fp32 Llama (default: hidden 64, 2 layers, vocab 4096) without a tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape: dict[str, Any] = {
        "vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "eos_token_id": 2, "bos_token_id": 1,
    }  # fmt: skip
    shape.update(overrides)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.float32).save_pretrained(path)
    return Path(path)


def perturb(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """Add seeded Gaussian noise to every parameter in place (a stand-in for an optimizer step)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g).to(p.device, p.dtype))


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: Sequence[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy continuation of ``prompt`` and its log-probs, by ``n`` full forwards (no KV cache)."""
    device = next(model.parameters()).device
    ids, logprobs = list(prompt), []
    for _ in range(n):
        logp = torch.log_softmax(model(torch.tensor([ids], device=device)).logits[0, -1].double(), dim=-1)
        tok = int(logp.argmax())
        ids.append(tok)
        logprobs.append(float(logp[tok]))
    return ids[len(prompt) :], logprobs


@torch.no_grad()
def check_greedy(model: torch.nn.Module, result: Any, prompt: Sequence[int] = PROMPT, tol: float = TOL) -> None:
    """Assert a greedy server result (``token_ids``, ``logprobs``, ``top_logprobs``) is ``model``'s, to ``tol``.

    One forward over prompt + generated tokens gives every position's reference distribution.
    """
    ids = list(prompt) + list(result.token_ids)
    device = next(model.parameters()).device
    logits = model(torch.tensor([ids[:-1]], device=device)).logits[0, len(prompt) - 1 :]
    ref = torch.log_softmax(logits.double(), -1).cpu()
    assert result.token_ids == ref.argmax(-1).tolist()
    for i, t in enumerate(result.token_ids):
        assert abs(result.logprobs[i] - ref[i, t].item()) <= tol
        for tok, v in result.top_logprobs[i].items():
            assert abs(v - ref[i, tok].item()) <= tol


def server_greedy(base_url: str, prompt: Sequence[int] = PROMPT, max_tokens: int = 8) -> tuple[Any, str]:
    """Ask a running server for a greedy continuation with top-3 log-probs; also its weight version now."""
    from asyncgrpo.client.http_client import AsyncServerClient

    async def go() -> tuple[Any, str]:
        async with AsyncServerClient(base_url, retries=0) as c:
            sp = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "logprobs": 3}
            return await c.generate(list(prompt), sp), (await c.weight_info())["weight_version"]

    return asyncio.run(go())


def lora_model(
    base: torch.nn.Module, *, seed: int, rank: int = 4, alpha: float | None = None, rslora: bool = False,
    targets: Sequence[str] = ("q_proj", "v_proj", "down_proj"), modules_to_save: Sequence[str] | None = None,
) -> torch.nn.Module:  # fmt: skip
    """``base`` (modified in place) wrapped in a PEFT LoRA adapter with random A *and* B, so it changes the
    forward; ``alpha`` defaults to ``2 * rank``; ``modules_to_save`` get a trainable full copy."""
    import peft

    torch.manual_seed(seed)
    cfg = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank if alpha is None else alpha, target_modules=list(targets), use_rslora=rslora,
        lora_dropout=0.0, init_lora_weights=False, modules_to_save=list(modules_to_save) if modules_to_save else None,
    )  # fmt: skip
    return peft.get_peft_model(base, cfg)


def make_lora_adapter(base: str | Path | torch.nn.Module, out_dir: str | Path, **lora: Any) -> torch.nn.Module:
    """Save a random LoRA adapter (:func:`lora_model` arguments) for ``base`` (a checkpoint directory, or a
    model that is left untouched); return the merged reference model."""
    model = hf_model(base) if isinstance(base, (str, Path)) else copy.deepcopy(base)
    peft_model = lora_model(model, **lora)
    peft_model.save_pretrained(out_dir)
    return peft_model.merge_and_unload().eval()
