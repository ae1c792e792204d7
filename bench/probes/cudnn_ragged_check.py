"""cuDNN's ragged attention as torch exposes it (``aten::_cudnn_attention_forward/backward`` with cumulative sequence
lengths), checked against fp32 attention: the evidence behind keeping it out of the trainer (bench/LOG.md, issue 37,
fourth session).

Each case runs in its own process (an illegal memory access poisons the CUDA context of the process that made it):
bf16, 16 query heads, 8 or 16 key heads, head size 128, three ragged sequences; the kernel's own output and lse go
into its backward, and output and q/k/v gradients are compared as max difference over the reference's max magnitude.

- ``no_keys``: a sequence without keys (whether the outputs stay finite);
- ``causal_same_len``: causal, queries = keys per sequence (what a flat packed row needs);
- ``nc_same_len`` / ``nc_gqa`` / ``nc_mha``: no mask, equal or unequal query and key lengths, grouped-query or not;
- ``causal_gqa``: causal (torch aligns it to the top left) with more keys than queries.

    python bench/probes/cudnn_ragged_check.py --out cudnn_ragged_check.jsonl
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

RAW = {  # name: (causal, query heads, key heads, query lengths, key lengths)
    "causal_same_len": (True, 16, 8, [300, 200, 150], [300, 200, 150]),
    "nc_same_len": (False, 16, 8, [100, 200, 150], [100, 200, 150]),
    "nc_gqa": (False, 16, 8, [220, 40, 300], [40, 1, 170]),
    "nc_mha": (False, 16, 16, [220, 40, 300], [40, 1, 170]),
    "causal_gqa": (True, 16, 8, [220, 40, 300], [240, 60, 310]),
}
CASES = ("no_keys", *RAW)


def _rel(got, ref) -> list[float]:
    return [float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(got, ref)]


def run_case(case: str) -> dict:
    g = torch.Generator("cuda").manual_seed(0)
    if case in RAW:
        return _raw(*RAW[case], g)
    if case == "no_keys":
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
