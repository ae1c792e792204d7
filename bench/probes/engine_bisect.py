"""GPU bisect of the engine's new paths: each case runs in its own process with CUDA_LAUNCH_BLOCKING=1 (a CUDA
error is sticky and kills the process), so one run says which component fails and where.

Cases: the fused layer kernels and the sampling kernels alone at the B5 shapes (against their torch paths), then
the B5 engine warm-up (Qwen3-0.6B shape, 256 x (128 + 16)) with components switched off one at a time.

Run (GPU):  python bench/probes/engine_bisect.py [--out $OUT/bisect.json]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*
from bench.result_file import write_result

CASES = ["layer_kernels", "sampler_kernel", "engine_all", "engine_no_sampler_kernel", "engine_no_layer_kernels",
         "engine_no_look_ahead", "engine_no_prefix_cache", "engine_torch_only"]  # fmt: skip


def _layer_kernels() -> str:
    import torch

    from asyncgrpo.server.layers import fused

    g = torch.Generator(device="cuda").manual_seed(0)
    T, Hq, Hkv, D, L = 16384, 16, 8, 128, 384
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device="cuda", generator=g).bfloat16()
    pos = torch.arange(T, device="cuda") % 128
    ang = torch.arange(L, device="cuda")[:, None] * (1e-2 ** torch.linspace(0, 1, D // 2, device="cuda"))[None]
    cos, sin = torch.cat([ang, ang], 1).cos().bfloat16(), torch.cat([ang, ang], 1).sin().bfloat16()
    norm = (torch.rand(D, device="cuda").bfloat16(), 1e-6)
    slots = torch.randperm(6144 * 16, device="cuda", generator=g)[:T]
    out = []
    for force in (True, False):
        kc = torch.zeros(6145, 16, Hkv, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        q, k, v = fused.qkv_rope_write(qkv, pos, cos, sin, norm, norm, slots, kc, vc, Hq, Hkv, True, force=force)
        h, x = fused.add_rms_norm(qkv[:, :1024], qkv[:, 1024:2048], norm[0].repeat(8), 1e-6, force=force)
        a = fused.silu_mul(qkv[:, :6144], force=force)
        torch.cuda.synchronize()
        out.append([t.float() for t in (q, k, v, kc, vc, h, x, a)])
    errs = [(a - b).abs().max().item() for a, b in zip(*out)]
    return f"max |diff| q,k,v,kc,vc,h,x,silu = {[round(e, 4) for e in errs]}"


def _sampler_kernel() -> str:
    import torch

    from asyncgrpo.server.layers import sample_kernel

    B, V = 128, 151936
    logits = (torch.randn(B, V, device="cuda") * 3).bfloat16()
    modes = torch.tensor([i % 3 for i in range(B)], device="cuda")
    meta = torch.stack([torch.arange(B, device="cuda"), torch.zeros(B, dtype=torch.int64, device="cuda"),
                        torch.arange(B, device="cuda") % 7, modes])  # fmt: skip
    rand = torch.randint(0, 1 << 32, (B,), device="cuda")
    tok, _, lse = sample_kernel.fused_sample(logits, torch.ones(B, device="cuda"), meta, rand)
    torch.cuda.synchronize()
    greedy = (modes == 0).nonzero().squeeze(1)
    ok = bool((tok[greedy] == logits.float()[greedy].argmax(1)).all())
    lse_err = (lse - torch.logsumexp(logits.float(), 1)).abs().max().item()
    in_range = bool(((tok >= 0) & (tok < V)).all())
    return f"greedy==argmax {ok}, tokens in range {in_range}, max |lse diff| {lse_err:.2e}"


def _engine(case: str) -> str:
    import torch

    from asyncgrpo.server.layers import fused, sample_kernel
    from bench.generation import QWEN3_06B, build_model, run_engine

    if case in ("engine_torch_only", "engine_no_layer_kernels"):
        fused.ENABLED["layer"] = False
        fused.check_layer_kernels = lambda *a, **k: False
    if case in ("engine_torch_only", "engine_no_sampler_kernel"):
        sample_kernel.check_kernel = lambda device: False
    from asyncgrpo.server.engine.engine import Engine

    model = build_model(QWEN3_06B, torch.device("cuda", 0), torch.bfloat16)
    engine = Engine(model, dtype="bfloat16", device="cuda", max_model_len=384, max_num_seqs=256,
                    kv_cache_tokens=256 * 384, enable_prefix_caching=case != "engine_no_prefix_cache")  # fmt: skip
    engine.look_ahead = case not in ("engine_no_look_ahead", "engine_torch_only")
    engine.start()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, QWEN3_06B["vocab_size"], (256, 128), generator=gen).tolist()
    tokens, _ = run_engine(engine, prompts, 16, "bisect")
    tokens2, seconds2 = run_engine(engine, prompts, 32, "bisect2")
    engine.shutdown()
    return f"ok: {tokens} then {tokens2} tokens, {tokens2 / seconds2:.0f} tok/s (launch blocking: slow)"


def _child(case: str) -> None:
    start = time.perf_counter()
    msg = (
        _layer_kernels()
        if case == "layer_kernels"
        else _sampler_kernel()
        if case == "sampler_kernel"
        else _engine(case)
    )
    print(f"RESULT {case}: {msg} ({time.perf_counter() - start:.1f} s)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default=None, help="run one case in this process")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    args = ap.parse_args()
    if args.case:
        _child(args.case)
        return 0
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    report = {}
    for case in args.cases.split(","):
        try:
            done = subprocess.run([sys.executable, __file__, "--case", case], env=env, capture_output=True, text=True,
                                  timeout=args.timeout, check=False)  # fmt: skip
            lines = (done.stdout + done.stderr).splitlines()
            result = next((ln for ln in lines if ln.startswith("RESULT")), None)
            errors = [ln for ln in lines if "Error" in ln or "error" in ln or 'File "' in ln][-12:]
            report[case] = {"ok": done.returncode == 0 and result is not None, "result": result, "errors": errors}
        except subprocess.TimeoutExpired:
            report[case] = {"ok": False, "result": None, "errors": [f"timed out after {args.timeout} s"]}
        r = report[case]
        print(f"{'PASS' if r['ok'] else 'FAIL'} {case}: {r['result'] or ''}", flush=True)
        for ln in r["errors"] if not r["ok"] else []:
            print(f"    {ln}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_result(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
