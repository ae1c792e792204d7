"""P6 on the GPU: Gated DeltaNet hybrids in the trie — exactness (fp32) and speed (bf16) of the packed forward.

Run on one GPU (about 2 minutes on an H200):
    python bench/deltanet_packing.py --out bench/results/deltanet_packing_h200.json
CPU smoke run (tiny shapes):
    python bench/deltanet_packing.py --smoke

1. Parity, fp32: a tiny random Qwen3.5 (text) and Qwen3-Next hybrid (3 DeltaNet + 1 attention layer);
   a packed trie row (forks at several depths, single-token segments) against each sample forwarded
   alone by transformers; max |log-prob diff| and max |grad diff| (both must be <= 1e-4).
2. Speed, bf16: a Qwen3.5-shaped hybrid (hidden 1024, 8 layers, 3 of 4 DeltaNet) on GRPO-shaped
   samples (G completions of one prompt). fwd+bwd seconds of the packed trie row (tree attention +
   trie DeltaNet) vs the same samples as one right-padded HF batch (transformers' own layers; torch
   kernels where fla/causal-conv1d are not installed). Trained tokens/s for both.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo.packing.attention import build_plan, packed_hidden_states, use_tree_attention
from asyncgrpo.packing.row import pack_samples
from asyncgrpo.trainer.logprobs import selective_logprobs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests/
from tests.helpers.synthetic import grpo_samples
from tests.unit.packing.test_packing_deltanet import VOCAB, _deep_tree_samples, hybrid_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.result_file
from bench.result_file import write_result


def parity(family: str, device: str) -> dict:
    """Max log-prob and gradient differences, packed vs unpacked, fp32."""
    rng = np.random.default_rng(3)
    samples = _deep_tree_samples(rng)
    row = pack_samples(samples)
    model = hybrid_model(family).to(device)
    weights = torch.from_numpy(rng.standard_normal(row.num_trained).astype(np.float32)).to(device)
    model.zero_grad()
    ref, start = [], 0
    for s in samples:
        ids = torch.from_numpy(s.token_ids)[None].to(device)
        logp = model(input_ids=ids, use_cache=False).logits[0].float().log_softmax(-1)
        t = torch.from_numpy(np.flatnonzero(s.loss_mask)).to(device)
        lp = logp[t - 1].gather(1, ids[0, t][:, None])[:, 0]
        (lp * weights[start : start + len(t)]).sum().backward()
        ref.append(lp.detach())
        start += len(t)
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    use_tree_attention(model)
    model.zero_grad()
    drow = row.to(device)
    hidden = packed_hidden_states(model, drow, build_plan(drow, "sdpa", device=device, linear_attention=True))
    lp = selective_logprobs(hidden[drow.pred_index], model.get_output_embeddings().weight, drow.target_ids).logprobs
    (lp * weights).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {
        "family": family,
        "tokens_packed": row.num_tokens,
        "tokens_flat": row.num_flat_tokens,
        "max_logprob_diff": (lp.detach() - torch.cat(ref)).abs().max().item(),
        "max_grad_diff": max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
        "same_grad_keys": sorted(grads) == sorted(ref_grads),
    }


def _speed_model(device: str, smoke: bool) -> torch.nn.Module:
    from transformers import Qwen3_5TextConfig

    n_layers = 4 if smoke else 8
    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB if smoke else 32000, hidden_size=64 if smoke else 1024, intermediate_size=128 if smoke else 3072,
        num_hidden_layers=n_layers, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (n_layers // 4),
        num_attention_heads=4 if smoke else 8, num_key_value_heads=2, head_dim=16 if smoke else 128,
        linear_key_head_dim=16 if smoke else 128, linear_value_head_dim=16 if smoke else 128,
        linear_num_key_heads=2 if smoke else 8, linear_num_value_heads=4 if smoke else 16, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    dtype = torch.float32 if smoke else torch.bfloat16
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device).train()


def _time(fn, warmup: int, iters: int, device: str) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def speed(device: str, smoke: bool, prompt: int, group: int, completion: int) -> dict:
    model = _speed_model(device, smoke)
    vocab = model.config.vocab_size
    samples = grpo_samples(1, group, prompt, (completion // 2, completion), vocab, seed=1)
    row = pack_samples(samples).to(device)
    head = model.get_output_embeddings().weight
    backend = "flex" if device == "cuda" else "sdpa"

    def packed() -> None:
        model.zero_grad(set_to_none=True)
        plan = build_plan(row, backend, device=device, linear_attention=True)
        hidden = packed_hidden_states(model, row, plan)
        selective_logprobs(hidden[row.pred_index], head, row.target_ids).logprobs.sum().backward()

    longest = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        ids[i, : len(s)] = torch.from_numpy(s.token_ids)
        mask[i, : len(s)] = 1
    ids, mask = ids.to(device), mask.to(device)
    reference = AutoModelForCausalLM.from_config(model.config, dtype=model.dtype).to(device).train()
    reference.load_state_dict(model.state_dict())

    def padded() -> None:
        reference.zero_grad(set_to_none=True)
        hidden = reference.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        sel = hidden[:, :-1][mask[:, 1:].bool()]
        selective_logprobs(sel, reference.lm_head.weight, ids[:, 1:][mask[:, 1:].bool()]).logprobs.sum().backward()

    use_tree_attention(model)
    warmup, iters = (1, 2) if smoke else (3, 10)
    t_packed = _time(packed, warmup, iters, device)
    t_padded = _time(padded, warmup, iters, device)
    trained = sum(s.num_trained for s in samples)
    return {
        "shape": {
            "prompt": prompt,
            "group": group,
            "completion_max": completion,
            "layers": model.config.num_hidden_layers,
        },
        "tokens_packed": row.num_tokens,
        "tokens_padded": int(ids.numel()),
        "fwd_bwd_s_packed": t_packed,
        "fwd_bwd_s_padded_hf": t_padded,
        "trained_tokens_per_s_packed": trained / t_packed,
        "trained_tokens_per_s_padded_hf": trained / t_padded,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on whatever device there is")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    import transformers

    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
                    "torch": torch.__version__, "transformers": transformers.__version__}  # fmt: skip
    result["parity"] = [parity(f, device) for f in ("qwen3_5", "qwen3_next")]
    print(json.dumps(result["parity"], indent=1), flush=True)
    shapes = [(32, 4, 48)] if args.smoke else [(512, 8, 1024), (1024, 16, 512)]
    result["speed"] = []
    for p, g, c in shapes:
        result["speed"].append(speed(device, args.smoke, p, g, c))
        print(json.dumps(result["speed"][-1], indent=1), flush=True)
    ok = all(r["max_logprob_diff"] <= 1e-4 and r["max_grad_diff"] <= 1e-4 for r in result["parity"])
    result["parity_ok"] = ok
    print("PARITY", "ok" if ok else "FAILED", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_result(args.out, result, indent=1)


if __name__ == "__main__":
    main()
