"""The tree-attention call of each CUDA backend, alone, on the B1/B2 rows of the 1.7B shape (issue 37).

The packed step spends 18 % (G=8) to 28 % (G=16) of its kernel time in torch's FlashAttention 2, at 200-280
TFLOP/s on an H100 against the GEMMs' ~790 (bench/LOG.md, issue 37, third session). Per row of the bench (flat and
tree, both shapes), this times the forward and forward+backward of the call the trainer makes
(``packing/attention.py``: gathers, kernels, merge; inputs [1, H, T, D] as transformers passes them):

- ``varlen``: FlashAttention 2 over each segment's path, K/V widened to the query heads;
- ``cudnn``: cuDNN's fused attention (``packing/cudnn_tree.py``: own tokens causal + ancestors unmasked, merged).

cudnn's output and the row's q/k/v gradients are compared with varlen's (max difference over max magnitude, bf16;
within 2e-2 counts as the same). CUDA events, median of ``--iters`` after two warm-up calls.

    python bench/probes/attention_kernels.py --out attention_kernels_h100.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*
from asyncgrpo.packing import attention, cudnn_tree
from asyncgrpo.packing.attention import build_plan
from bench.result_file import write_result
from bench.tree_packing import QWEN3_COMMON, SHAPES
from bench.tree_packing_inputs import make_samples, plan_rows

HEADS, KV_HEADS, DIM = (
    QWEN3_COMMON["num_attention_heads"],
    QWEN3_COMMON["num_key_value_heads"],
    QWEN3_COMMON["head_dim"],
)


def _timed(fn, iters: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` calls (CUDA events), after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_row(row, iters: int) -> dict[str, Any]:
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(row.num_tokens, h, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
                     for h in (HEADS, KV_HEADS, KV_HEADS, HEADS))  # fmt: skip
    return {"tokens": row.num_tokens, "backends": run_backends(row, q, k, v, dout, iters)}


def run_backends(row, q, k, v, dout, iters: int) -> dict[str, Any]:
    """The trainer's whole attention call per backend on [1, H, T, D] inputs; grads compared with varlen's."""
    res: dict[str, Any] = {}
    reference = None
    grad_out = dout.transpose(0, 1)[None]
    for backend, call in (("varlen", attention._varlen), ("cudnn", attention._cudnn)):
        try:
            plan = build_plan(row, backend, device="cuda")
            leaves = [t.transpose(0, 1)[None].detach().clone().requires_grad_() for t in (q, k, v)]
            got = call(*leaves, plan, None)
            got.backward(grad_out)
            got = [got.detach()] + [t.grad for t in leaves]
            reference = reference if reference is not None else got
            diff = [float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(got, reference)]

            def forward(leaves=leaves, call=call, plan=plan):
                with torch.no_grad():
                    call(*leaves, plan, None)

            def both(leaves=leaves, call=call, plan=plan):
                for t in leaves:
                    t.grad = None
                call(*leaves, plan, None).backward(grad_out)

            res[backend] = {"forward_ms": _timed(forward, iters), "forward_backward_ms": _timed(both, iters),
                            "max_rel_diff_out_dq_dk_dv": diff, "matches_varlen": max(diff) <= 2e-2}  # fmt: skip
            if backend == "cudnn":
                res[backend]["lse_layout"] = cudnn_tree._LSE_LAYOUT[0]
                res[backend]["runs"] = 0 if plan.cudnn.cu_run_q is None else len(plan.cudnn.cu_run_q) - 1
        except Exception as exc:  # noqa: BLE001 - a kernel this torch lacks is a finding, not the end of the probe
            res[backend] = {"error": f"{type(exc).__name__}: {exc}"[:600], "trace": traceback.format_exc()[-1500:]}
        torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--budget", type=int, default=16_384, help="token_budget of a row, as bench/tree_packing.py")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("attention_kernels: needs CUDA", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"benchmark": "attention_kernels", "torch": torch.__version__,
                              "cudnn": torch.backends.cudnn.version(), "shapes": {}}  # fmt: skip
    for shape_name, shape in SHAPES.items():
        samples = make_samples(shape, QWEN3_COMMON["vocab_size"], seed=0)
        rows = {
            "tree": plan_rows(samples, args.budget, share=True),
            "flat": plan_rows(samples, args.budget, share=False),
        }
        result["shapes"][shape_name] = {
            kind: [run_row(r.to("cuda"), args.iters) for r in rs] for kind, rs in rows.items()
        }
        for kind, per_row in result["shapes"][shape_name].items():
            for name in ("varlen", "cudnn"):
                got = [r["backends"][name] for r in per_row]
                err = next((g["error"] for g in got if "error" in g), None)
                line = f"{shape_name} {kind:<5} backend {name:<6}"
                if err:
                    print(f"{line} error: {err[:300]}")
                    continue
                fwd, both = sum(g["forward_ms"] for g in got), sum(g["forward_backward_ms"] for g in got)
                same = all(g["matches_varlen"] for g in got)
                print(f"{line} fwd {fwd:8.2f} ms, fwd+bwd {both:8.2f} ms, matches varlen: {same}")
        ok = all(r["backends"]["cudnn"].get("matches_varlen") for rs in result["shapes"][shape_name].values()
                 for r in rs)  # fmt: skip
        result.setdefault("cudnn_matches_varlen", {})[shape_name] = ok
    if args.out:
        write_result(args.out, result)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
