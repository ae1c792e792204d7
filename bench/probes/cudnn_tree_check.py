"""The cuDNN tree backend on a real GPU, case by case, each in its own process (an illegal memory access poisons
the CUDA context of the process that made it, so one bad case must not hide the others).

Cases (bf16, 16 query heads, 8 key heads, head size 128):
- ``flat``: samples packed without sharing: the own (causal) call alone;
- ``groups``: GRPO groups (prompt + completions), small: own + ancestors, merged;
- ``tree``: the multi-level trie of the parity tests (shared system prompt, nested sharing, multi-turn);
- ``bench_row``: one G=8 group of ~8k tokens (prompt 512), the row on which the GPU test crashed;
- ``raw_no_keys``: the bare cuDNN backward over a ragged batch whose second sequence has no keys (what the first
  version handed it for root segments), to record what it does;
- ``raw_*``: the bare ragged forward + backward with its own output and lse against fp32 attention: non-causal with
  equal / unequal query and key lengths, grouped-query or not, and top-left causal with unequal lengths (which
  condition breaks the backward).
Small rows are checked against fp32 SDPA with the dense tree mask, the bench row against the varlen backend; output
and q/k/v gradients as max difference over the reference's max magnitude.

    python bench/probes/cudnn_tree_check.py --out cudnn_tree_check.jsonl
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tests.helpers
RAW = {  # name: (causal, query heads, key heads, query lengths, key lengths)
    "raw_nc_same_len": (False, 16, 8, [100, 200, 150], [100, 200, 150]),
    "raw_nc_gqa": (False, 16, 8, [220, 40, 300], [40, 1, 170]),
    "raw_nc_mha": (False, 16, 16, [220, 40, 300], [40, 1, 170]),
    "raw_causal_gqa": (True, 16, 8, [220, 40, 300], [240, 60, 310]),
}
CASES = ("flat", "groups", "tree", "bench_row", "raw_no_keys", *RAW)


def _row(case: str):
    import numpy as np

    from asyncgrpo.packing.row import pack_samples
    from tests.helpers.synthetic import grpo_samples, random_tree_samples

    if case == "flat":
        return pack_samples(grpo_samples(3, 4, 40, (20, 90), vocab_size=500, seed=1), share_prefixes=False)
    if case == "groups":
        return pack_samples(grpo_samples(3, 4, 40, (20, 90), vocab_size=500, seed=2))
    if case == "tree":
        return pack_samples(random_tree_samples(np.random.default_rng(5), vocab_size=61, num_groups=3))
    return pack_samples(grpo_samples(1, 8, prompt_len=512, completion_len=(128, 1536), vocab_size=500, seed=1))


def _rel(got, ref) -> list[float]:
    return [float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(got, ref)]


def run_case(case: str) -> dict:
    from asyncgrpo.packing import attention, cudnn_tree
    from asyncgrpo.packing.attention import build_plan

    g = torch.Generator("cuda").manual_seed(0)
    if case in RAW:
        return _raw(*RAW[case], g)
    if case == "raw_no_keys":
        q = torch.randn(24, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(16, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        cu_q = torch.tensor([0, 8, 24], device="cuda", dtype=torch.int32)
        cu_k = torch.tensor([0, 16, 16], device="cuda", dtype=torch.int32)  # the second sequence: no keys
        res = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu_q, cu_k, 16, 16, True, 0.0, False, False)
        zero = torch.zeros((), dtype=torch.int64, device="cuda")
        dq, dk, _ = torch.ops.aten._cudnn_attention_backward(
            torch.ones_like(q), q, k, v, res[0], res[1], zero, zero, None, cu_q, cu_k, 16, 16, 0.0, False
        )
        torch.cuda.synchronize()
        return {"out_finite": bool(res[0].isfinite().all()), "dq_finite": bool(dq.isfinite().all()),
                "dk_finite": bool(dk.isfinite().all()), "lse_shape": list(res[1].shape)}  # fmt: skip
    row = _row(case).to("cuda")
    total = row.num_tokens
    q0, k0, v0, go = (torch.randn(1, h, total, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                      for h in (16, 8, 8, 16))  # fmt: skip

    def run(fn, dtype=torch.bfloat16):
        leaves = [t.to(dtype).clone().requires_grad_() for t in (q0, k0, v0)]
        out = fn(*leaves)
        out.backward(go.to(dtype))
        return [out.detach()] + [t.grad for t in leaves]

    plan = build_plan(row, "cudnn")
    got = run(lambda q, k, v: attention._cudnn(q, k, v, plan, None))
    if case == "bench_row":
        vplan = build_plan(row, "varlen")
        ref = run(lambda q, k, v: attention._varlen(q, k, v, vplan, None))
    else:
        mask = build_plan(row, "sdpa").dense_mask
        ref = run(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                  enable_gqa=True), torch.float32)  # fmt: skip
    torch.cuda.synchronize()
    rel = _rel(got, ref)
    return {"tokens": total, "runs": 0 if plan.cudnn.cu_run_q is None else len(plan.cudnn.cu_run_q) - 1,
            "lse_layout": cudnn_tree._LSE_LAYOUT[0], "int64_offsets": cudnn_tree._INT64_OFFSETS[0],
            "rel_diff_out_dq_dk_dv": rel, "finite": all(bool(t.isfinite().all()) for t in got),
            "ok": max(rel) <= 2e-2}  # fmt: skip


def _raw(causal: bool, heads: int, kv_heads: int, q_lens: list, k_lens: list, g) -> dict:
    """The bare ragged cuDNN forward + backward (its own output and lse) against fp32 attention per sequence."""
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    q, do = (torch.randn(sum(q_lens), heads, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(sum(k_lens), kv_heads, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    res = torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu_q, cu_k, max(q_lens), max(k_lens), True, 0.0, causal, False
    )
    zero = torch.zeros((), dtype=torch.int64, device="cuda")
    got = [res[0], *torch.ops.aten._cudnn_attention_backward(do, q, k, v, res[0], res[1], zero, zero, None, cu_q, cu_k,
                                                             max(q_lens), max(k_lens), 0.0, causal)]  # fmt: skip
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    outs = []
    for s in range(len(q_lens)):
        qs, ks, vs = (t[c[s] : c[s + 1]].transpose(0, 1) for t, c in zip(leaves, (cu_q, cu_k, cu_k)))
        mask = None
        if causal:  # top left
            mask = torch.arange(k_lens[s], device="cuda")[None, :] <= torch.arange(q_lens[s], device="cuda")[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
        outs.append(o.transpose(0, 1))
    ref_out = torch.cat(outs)
    ref_out.backward(do.float())
    rel = _rel(got, [ref_out.detach()] + [t.grad for t in leaves])
    return {"lse_shape": list(res[1].shape), "rel_diff_out_dq_dk_dv": rel, "ok": max(rel) <= 2e-2}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=CASES, help="run one case here (the parent runs each in a child)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.case:
        print(json.dumps({"case": args.case, **run_case(args.case)}))
        return 0
    lines = []
    for case in CASES:
        child = subprocess.run(
            [sys.executable, __file__, "--case", case], check=False, capture_output=True, text=True, timeout=180
        )
        tail = child.stdout.strip().splitlines()
        if child.returncode == 0 and tail:
            line = json.loads(tail[-1])
        else:
            line = {"case": case, "error": (child.stderr or child.stdout)[-1200:]}
        print(json.dumps(line)[:1500])
        lines.append(line)
    if args.out:
        args.out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return 0 if all(x.get("ok") for x in lines if not x["case"].startswith("raw")) else 1


if __name__ == "__main__":
    sys.exit(main())
