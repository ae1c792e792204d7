"""B1/B2: tree packing vs flat packing vs padded HF batches — trained tokens/s over fwd+bwd, packing ratio, MFU.

Run on one GPU (about 4-5 minutes on an H200, < 100 GB):
    python bench/tree_packing.py --out bench/results/tree_packing_h200.json
CPU smoke run (tiny model, tiny shapes, no MFU):
    python bench/tree_packing.py --smoke

The same GRPO-shaped samples (random init models of Qwen3-0.6B/1.7B shape, bf16, random
tokens) are planned by the token-budget planner into rows of at most ``--budget``
tokens and run through fwd+bwd of the model plus the chunked log-prob module (with
the sampler's top-8 and entropy, as the trainer runs it):

- tree: prefix-trie rows, FlexAttention block mask (and the varlen backend for comparison);
- flat: the same samples without sharing (padding-free packing), FlashAttention varlen;
- padded: HF batches (right padding, B x max_len <= budget), SDPA with a padding mask.

Trained tokens/s = trained tokens of all samples / fwd+bwd seconds of all their rows (median
of ``--iters`` synchronised iterations after ``--warmup``). MFU = model FLOPs the method
needs (6 x matmul params x non-pad tokens + LM head on trained tokens + 12 x layers x heads x
head_dim x attended (query, key) pairs) / seconds / peak: model FLOPs only, so with gradient
checkpointing (``--checkpointing on``/``both``; methods named ``<method>+ckpt``) the recompute is
not counted. ``--compile`` compiles each decoder layer (``trainer/compile.py``) as the trainer
does with ``compile_decoder_layers=True``.

B1 bound: tree and flat do the same LM-head work (it runs on trained tokens, which are never
shared), so even at equal MFU the speedup over flat is at most ``flop_ratio`` = flat FLOPs / tree
FLOPs, which is below the packing ratio; both quotients are written.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from asyncgrpo.packing.attention import build_plan, packed_hidden_states, use_tree_attention
from asyncgrpo.trainer.compile import CompileSettings, compile_decoder_layers
from asyncgrpo.trainer.packed_loss import PolicyLossSettings, packed_policy_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests/helpers, bench.*
from bench.result_file import write_result

H200_BF16_PEAK = 989e12  # dense bf16 tensor-core FLOP/s of an H100/H200 SXM (no sparsity)
from bench.tree_packing_inputs import make_samples, padded_batches, plan_rows

MODELS = {
    "qwen3-1.7b": {"hidden_size": 2048, "intermediate_size": 6144},
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072},
}
QWEN3_COMMON = {
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151_936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40_960,
}
# name -> (groups, group size G, prompt tokens, completion range)
SHAPES = {
    "G8_P512_C128-1536": (4, 8, 512, (128, 1536)),
    "G16_P2048_C256-1024": (2, 16, 2048, (256, 1024)),
}
SMOKE_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 1000,
    "tie_word_embeddings": True,
}
SMOKE_SHAPES = {"G4_P32_C8-48": (2, 4, 32, (8, 48)), "G8_P64_C16-32": (1, 8, 64, (16, 32))}


# ---------------------------------------------------------------------------- steps
LOSS = PolicyLossSettings()  # main() sets fused_lm_head from --lm-head
KEEP_GROUPS = True  # main() sets it from --split-groups


def packed_step(model, row, plan):
    """The trainer's step: packed decoder forward, LM head + score-centering loss on trained tokens, backward."""
    hidden = packed_hidden_states(model, row, plan)
    head = model.get_output_embeddings().weight
    packed_policy_loss(hidden[row.pred_index], head, row, row.num_trained, LOSS).loss.backward()


def padded_step(model, batch):
    hidden = model.base_model(input_ids=batch["ids"], attention_mask=batch["mask"], use_cache=False).last_hidden_state
    head = model.get_output_embeddings().weight
    row = batch["loss_row"]
    packed_policy_loss(hidden[batch["rows"], batch["pos"]], head, row, len(row.target_ids), LOSS).loss.backward()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_method(model, run_all, device: str, warmup: int, iters: int) -> tuple[list[float], float | None]:
    """Seconds per pass over all rows (synchronised), and peak memory in GiB (None off CUDA)."""
    for _ in range(warmup):
        model.zero_grad(set_to_none=True)
        run_all()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        model.zero_grad(set_to_none=True)
        sync(device)
        t0 = time.perf_counter()
        run_all()
        sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return times, peak


def profile_once(model, name: str, run_all, path: Path) -> dict:
    """Append the top CUDA kernels of one pass of ``name`` (already warm) to ``path``, and the pass's time by kind
    of work (``bench/probes/profile_table.py``); returns that summary."""
    from torch.profiler import ProfilerActivity, profile

    from bench.probes.profile_table import events_of, format_table, idle_gaps, spans_of, summarize

    model.zero_grad(set_to_none=True)
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        run_all()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    table = prof.key_averages().table(
        sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=45, max_name_column_width=70
    )
    ckpt = bool(getattr(model, "is_gradient_checkpointing", False))
    summary = summarize(events_of(prof), 1, wall)
    summary["gaps"] = idle_gaps(spans_of(prof), 1)  # where the idle share sits on the device's timeline
    gaps = "\n".join(f"| {g['after']} | {g['before']} | {g['ms_per_step']} | {g['count_per_step']:g} |"
                      for g in summary["gaps"]["largest"])  # fmt: skip
    with path.open("a") as f:
        f.write(f"\n==== {name} (ckpt={ckpt})\n{table}\n\n{format_table(f'{name} (ckpt={ckpt})', summary)}\n")
        f.write(
            f"\nIdle between kernels: {summary['gaps']['gaps_ms']:.2f} ms of a {summary['gaps']['span_ms']:.2f} ms "
            f"timeline; the largest gaps:\n\n| after | before | ms | count |\n|---|---|---|---|\n{gaps}\n"
        )
    return summary


# ---------------------------------------------------------------------------- FLOPs
def model_flops(model, tokens: int, trained: int, pairs: int) -> float:
    """Training FLOPs the work needs: 6 x (decoder matmul params x tokens + LM head x trained) + attention."""
    cfg = model.config
    layer_params = sum(m.weight.numel() for m in model.base_model.layers.modules() if isinstance(m, torch.nn.Linear))
    head = cfg.vocab_size * cfg.hidden_size
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * pairs  # QK^T + PV, fwd + 2x bwd
    return 6 * layer_params * tokens + 6 * head * trained + attn


def measure(model, name: str, run_all, device: str, args, info: dict) -> dict:
    """Time one method; a failure (compile error, out of memory) is recorded and the run goes on."""
    try:
        times, peak = time_method(model, run_all, device, args.warmup, args.iters)
    except Exception as exc:  # noqa: BLE001 - one broken method must not void the other measurements
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"{name} failed: {exc!r}"[:2000], file=sys.stderr)
        return {**info, "error": traceback.format_exc()[-4000:]}
    t = statistics.median(times)
    mfu = info["flops"] / t / args.peak_flops if device == "cuda" else None
    return {**info, "times_s": times, "time_s": t, "peak_mem_gib": peak, "mfu": mfu}


def set_checkpointing(model, on: bool) -> None:
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    model.train()


def run_shape(model, samples, budget, device, args, tree_backends, flat_backend) -> dict:
    trained = sum(s.num_trained for s in samples)
    flat_pairs = sum(len(s) * (len(s) + 1) // 2 for s in samples)
    flat_tokens = sum(len(s) for s in samples)
    res: dict = {"samples": len(samples), "trained_tokens": trained, "flat_tokens": flat_tokens}
    methods = {}
    tree_rows = [r.to(device) for r in plan_rows(samples, budget, share=True, keep_groups=KEEP_GROUPS)]
    flat_rows = [r.to(device) for r in plan_rows(samples, budget, share=False)]
    use_tree_attention(model)
    runs = [(f"tree_{b}", tree_rows, b) for b in tree_backends] + [(f"flat_{flat_backend}", flat_rows, flat_backend)]
    ckpt_modes = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]
    runs = [(n + ("+ckpt" if ck else ""), r, b, ck) for ck in ckpt_modes for n, r, b in runs]
    for name, rows, backend, ckpt in runs:
        set_checkpointing(model, ckpt)
        sync(device)
        t0 = time.perf_counter()
        try:
            plans = [build_plan(r, backend) for r in rows]
        except Exception:  # noqa: BLE001 - recorded; the other methods still run
            tokens = sum(r.num_tokens for r in rows)
            methods[name] = {"rows": len(rows), "forwarded_tokens": tokens, "error": traceback.format_exc()[-4000:]}
            continue
        sync(device)
        tokens, pairs = sum(r.num_tokens for r in rows), sum(r.attention_cost for r in rows)
        info = {
            "rows": len(rows),
            "row_tokens": [r.num_tokens for r in rows],
            "forwarded_tokens": tokens,
            "attention_pairs": pairs,
            "plan_s": time.perf_counter() - t0,
            "flops": model_flops(model, tokens, trained, pairs),
        }

        def run_all(rows=rows, plans=plans):
            for r, p in zip(rows, plans):
                packed_step(model, r, p)

        methods[name] = measure(model, name, run_all, device, args, info)
        if args.profile and "time_s" in methods[name]:
            methods[name]["profile"] = profile_once(model, name, run_all, args.profile)
    set_checkpointing(model, False)
    res["methods"] = methods
    if args.skip_padded:
        return finish_shape(res, samples, tree_rows, flat_tokens, flat_backend)
    model.set_attn_implementation("sdpa")
    batches = padded_batches(samples, budget, device)
    info = {
        "rows": len(batches),
        "row_tokens": [len(b["ids"]) * b["width"] for b in batches],
        "forwarded_tokens": flat_tokens,
        "padded_tokens": sum(len(b["ids"]) * b["width"] for b in batches),
        "attention_pairs": flat_pairs,
        "plan_s": 0.0,
        "flops": model_flops(model, flat_tokens, trained, flat_pairs),
    }

    def run_padded():
        for b in batches:
            padded_step(model, b)

    methods["padded_sdpa"] = measure(model, "padded_sdpa", run_padded, device, args, info)
    use_tree_attention(model)
    return finish_shape(res, samples, tree_rows, flat_tokens, flat_backend)


def finish_shape(res: dict, samples: list, tree_rows: list, flat_tokens: int, flat_backend: str) -> dict:
    """Throughput per method and the B1 quotients (best tree method over flat, same checkpointing)."""
    methods = res["methods"]
    for m in methods.values():
        if "time_s" in m:
            m["trained_tokens_per_s"] = res["trained_tokens"] / m["time_s"]
    res["tree_tokens"] = sum(r.num_tokens for r in tree_rows)
    res["packing_ratio"] = flat_tokens / res["tree_tokens"]
    ok = {k: m for k, m in methods.items() if "time_s" in m}
    for suffix in ("", "+ckpt"):
        flat = ok.get(f"flat_{flat_backend}{suffix}")
        trees = [m for k, m in ok.items() if k.startswith("tree_") and k.endswith("+ckpt") == bool(suffix)]
        best_tree = max(trees, key=lambda m: m["trained_tokens_per_s"], default=None)
        if best_tree is None or flat is None:
            continue
        key = suffix.replace("+", "_")
        res["flop_ratio" + key] = flat["flops"] / best_tree["flops"]
        res["speedup_tree_over_flat" + key] = best_tree["trained_tokens_per_s"] / flat["trained_tokens_per_s"]
        res["speedup_over_flat_per_packing_ratio" + key] = res["speedup_tree_over_flat" + key] / res["packing_ratio"]
        res["speedup_over_flat_per_flop_ratio" + key] = res["speedup_tree_over_flat" + key] / res["flop_ratio" + key]
        if suffix == "" and "padded_sdpa" in ok:
            res["speedup_tree_over_padded"] = (
                best_tree["trained_tokens_per_s"] / ok["padded_sdpa"]["trained_tokens_per_s"]
            )
    return res


def build_model(overrides: dict, device: str):
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(**{**QWEN3_COMMON, **overrides})
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.train()  # dropout is 0 in Qwen3; gradient checkpointing stays off


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the JSON results here")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run (checks the script, no meaningful numbers)")
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--budget", type=int, default=16_384, help="token_budget of a row")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--peak-flops", type=float, default=H200_BF16_PEAK)
    ap.add_argument("--tree-backends", nargs="*", default=["flex", "varlen"], choices=["flex", "varlen", "sdpa"])
    ap.add_argument("--max-seconds", type=float, default=330, help="skip remaining configs past this wall time")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (trainer/compile.py)")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--checkpointing", choices=["off", "on", "both"], default="off", help="gradient checkpointing")
    ap.add_argument("--lm-head", choices=["fused", "recompute"], default="fused",
                    help="fused: gradient formed in the forward (the trainer's default); recompute: logits again in backward")  # fmt: skip
    ap.add_argument("--split-groups", action="store_true", help="plan sample by sample (groups may span rows)")
    ap.add_argument("--profile", type=Path, help="append a torch.profiler kernel table of each method here")
    ap.add_argument("--skip-padded", action="store_true", help="skip the padded HF batches (saves time)")
    ap.add_argument("--memory-budget", type=float, default=None,
                    help="compiled layers: the trainer's activation_memory_budget (keep that share, recompute the rest)")  # fmt: skip
    args = ap.parse_args()
    global LOSS, KEEP_GROUPS
    LOSS = PolicyLossSettings(fused_lm_head=args.lm_head == "fused")
    KEEP_GROUPS = not args.split_groups
    start = time.perf_counter()
    if args.smoke:
        device, models, shapes = "cpu", {"smoke": SMOKE_MODEL}, SMOKE_SHAPES
        args.budget, args.iters, args.tree_backends, flat_backend = 512, 1, ["sdpa"], "sdpa"
        args.warmup = 1 if args.compile else 0
    elif not torch.cuda.is_available():
        print(
            "tree_packing benchmark needs a CUDA device (use --smoke for a CPU check); no numbers made up",
            file=sys.stderr,
        )
        return 2
    else:
        device, flat_backend = "cuda", "varlen"
        models = {m: MODELS[m] for m in args.models}
        shapes = {s: SHAPES[s] for s in args.shapes}
    results: dict = {}
    skipped: list[str] = []
    for mname, overrides in models.items():
        model = None
        for sname, shape in shapes.items():
            if time.perf_counter() - start > args.max_seconds:
                skipped.append(f"{mname}/{sname}")
                continue
            if model is None:
                model = build_model({**QWEN3_COMMON, **overrides} if args.smoke else overrides, device)
                if args.compile:
                    budget = (
                        {} if args.memory_budget is None else {"memory_budget": args.memory_budget}
                    )  # old checkouts
                    settings = CompileSettings(backend=args.compile_backend, **budget)
                    compile_decoder_layers(model, settings)  # the trainer's activation_memory_budget, as it sets it
            samples = make_samples(shape, model.config.vocab_size, seed=0)
            r = run_shape(model, samples, args.budget, device, args, args.tree_backends, flat_backend)
            if args.compile:  # a compile failure falls back to eager with a warning: say so in the results
                r["compiled_layers_still_compiled"] = all(
                    layer._compiled_call_impl is not None for layer in model.model.layers
                )
            results[f"{mname}/{sname}"] = r
            print_result(f"{mname}/{sname}", r)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    report = {
        "benchmark": "B1/B2 tree packing",
        "smoke": args.smoke,
        "device": device_name(device),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "python": platform.python_version(),
        "peak_flops": args.peak_flops,
        "token_budget": args.budget,
        "warmup": args.warmup,
        "iters": args.iters,
        "gradient_checkpointing": args.checkpointing,
        "compile_decoder_layers": args.compile,
        "lm_head": args.lm_head,
        "keep_groups": not args.split_groups,
        "compile_backend": args.compile_backend if args.compile else None,
        "activation_memory_budget": args.memory_budget,
        "lm_head_weight_grad_in_gemm": head_grad_in_gemm(device),
        "dtype": "bfloat16" if device == "cuda" else "float32",
        "shapes": {
            k: {"groups": v[0], "group_size": v[1], "prompt": v[2], "completion": v[3]} for k, v in shapes.items()
        },
        "results": results,
        "skipped": skipped,
        "wall_s": time.perf_counter() - start,
    }
    print(f"fused head's weight gradient added inside the GEMM: {report['lm_head_weight_grad_in_gemm']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_result(args.out, report)
        print(f"wrote {args.out}")
    failed = [f"{k}/{m}" for k, r in results.items() for m, v in r["methods"].items() if "error" in v]
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


def head_grad_in_gemm(device: str) -> bool | None:
    """Whether the fused head added its fp32 weight gradient inside the GEMM; None for a checkout without it."""
    try:
        from asyncgrpo.trainer.fused_head import weight_grad_in_gemm
    except ImportError:  # a baseline from before the in-GEMM add
        return None
    return weight_grad_in_gemm(torch.device(device))


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"


def print_result(name: str, r: dict) -> None:
    print(
        f"\n== {name}: {r['samples']} samples, {r['trained_tokens']} trained tokens, "
        f"packing ratio {r['packing_ratio']:.2f}"
    )
    print(f"{'method':<14}{'rows':>5}{'fwd tokens':>12}{'time s':>9}{'trained tok/s':>15}{'MFU':>7}{'peak GiB':>10}")
    for k, m in r["methods"].items():
        if "error" in m:
            print(f"{k:<14}{m['rows']:>5}{m['forwarded_tokens']:>12}   FAILED (see JSON)")
            continue
        mfu = f"{100 * m['mfu']:.1f}%" if m["mfu"] is not None else "-"
        print(
            f"{k:<14}{m['rows']:>5}{m['forwarded_tokens']:>12}{m['time_s']:>9.3f}{m['trained_tokens_per_s']:>15.0f}"
            f"{mfu:>7}{m['peak_mem_gib'] or 0:>10.1f}"
        )
    for key in ("", "_ckpt"):
        if "speedup_tree_over_flat" + key in r:
            print(
                f"speedup best tree/flat{key} {r['speedup_tree_over_flat' + key]:.2f} = "
                f"{r['speedup_over_flat_per_packing_ratio' + key]:.2f} x packing ratio = "
                f"{r['speedup_over_flat_per_flop_ratio' + key]:.2f} x FLOP ratio {r['flop_ratio' + key]:.2f}"
            )
    if "speedup_tree_over_padded" in r:
        print(f"speedup best tree/padded {r['speedup_tree_over_padded']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
