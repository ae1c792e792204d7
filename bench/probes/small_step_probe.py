"""The trainer's packed step at a small shape, alone on the GPU: where a ~900-token step's fixed cost goes.

    python bench/probes/small_step_probe.py --out small_step_probe_h200.json [--profile-dir DIR]
    python bench/probes/small_step_probe.py --tiny          # CPU smoke (checks the script, not speed)

SmolLM2-135M's shape (random init, bf16), one packed row of ``--groups`` groups (a 60-token prompt and G=8
completions of ~35 tokens), the step as the trainer runs it: ``build_plan`` -> ``packed_forward`` ->
``packed_policy_loss`` (score centering with top-8) -> backward -> the loss metrics read on the host. Per variant
(tree-attention backend x compiled decoder layers) the median of ``--iters`` steps after warm-up, split into plan,
forward, loss, backward and metrics (each region synchronised), and the first two calls' times (compile).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.result_file import write_result

SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
         "num_key_value_heads": 3, "head_dim": 64}  # fmt: skip
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip


def make_row(groups: int, seed: int, vocab: int):
    import numpy as np

    from asyncgrpo.packing.row import pack_samples
    from asyncgrpo.packing.sample import PackSample

    rng = np.random.default_rng(seed)
    samples = []
    for g in range(groups):
        prompt = rng.integers(3, vocab, 60).tolist()
        for _ in range(8):
            n = int(rng.integers(20, 50))
            ids = prompt + rng.integers(3, vocab, n).tolist()
            mask = [0] * 60 + [1] * n
            top_ids = [rng.integers(3, vocab, 8).tolist() if m else [] for m in mask]
            top_lp = [sorted((-rng.random(8) * 5).tolist(), reverse=True) if m else [] for m in mask]
            samples.append(PackSample(ids, mask, [-1.0 if m else 0.0 for m in mask], float(rng.normal()), g,
                                      sampler_topn_ids=top_ids, sampler_topn_logprobs=top_lp))  # fmt: skip
    return pack_samples(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--variants",
        default="flex:eager,flex:compiled,flex:graphed",
        help="backend:mode, mode in eager, compiled, graphed (cuda_graph_step), egraphed (its graphs over eager "
        "layers), graphs (per-layer "
        "reduce-overhead), decoder / dgraphs (the whole decoder compiled, without / with CUDA graphs)",
    )
    ap.add_argument("--profile-dir", default=None, help="a torch-profiler table of one step per variant")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--pure-bf16", action="store_true", help="bf16 weights without autocast (dtype='bfloat16')")
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from asyncgrpo import AsyncGRPOConfig
    from asyncgrpo.packing.attention import build_plan, use_tree_attention
    from asyncgrpo.trainer.compile import CompileSettings, compile_decoder_layers, uncompile_decoder_layers
    from asyncgrpo.trainer.graphed_step import GraphedDecoder
    from asyncgrpo.trainer.packed_forward import packed_forward
    from asyncgrpo.trainer.packed_loss import loss_settings, packed_policy_loss

    dev = "cpu" if a.tiny else "cuda"
    # as the trainer runs by default: fp32 weights (AsyncGRPOConfig.dtype) under bf16 autocast (bf16=True)
    dtype = torch.bfloat16 if (a.pure_bf16 and not a.tiny) else torch.float32
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=not a.tiny and not a.pure_bf16)
    cfg = LlamaConfig(**(TINY if a.tiny else SHAPE), vocab_size=49152, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(dev).train()
    use_tree_attention(model)
    settings = loss_settings(AsyncGRPOConfig(output_dir="/tmp/probe", report_to=[], use_cpu=a.tiny))
    rows = [make_row(a.groups, s, 49152).to(dev) for s in range(4)]  # lengths differ a little, as real steps do

    def sync() -> None:
        if dev == "cuda":
            torch.cuda.synchronize()

    def step(row, backend: str, times: dict | None) -> None:
        marks = [time.perf_counter()]

        def mark() -> None:
            if times is not None:
                sync()
            marks.append(time.perf_counter())

        plan = build_plan(row, backend=backend, device=dev) if graphed is None else None
        mark()
        with autocast:
            fwd = packed_forward(model, row, plan) if graphed is None else graphed.forward(row)
            mark()
            res = packed_policy_loss(fwd.hidden[row.pred_index], fwd.head_weight, row, float(row.num_trained), settings)
            loss = res.loss + fwd.anchor
        mark()
        loss.backward()
        mark()
        _ = res.metric_events()
        mark()
        model.zero_grad(set_to_none=True)
        if times is not None:
            for name, t0, t1 in zip(("plan", "forward", "loss", "backward", "metrics"), marks, marks[1:], strict=False):
                times.setdefault(name, []).append(t1 - t0)
            times.setdefault("total", []).append(marks[-1] - marks[0])

    results = {"tokens_per_row": [r.num_tokens for r in rows], "variants": {}}
    for variant in a.variants.split(","):
        backend, mode = variant.split(":")
        if dev == "cpu" and backend != "sdpa":
            continue
        uncompile_decoder_layers(model)
        model.get_decoder()._compiled_call_impl = None
        if mode == "compiled":
            compile_decoder_layers(model)
        elif mode == "graphs":  # CUDA graphs per layer (cudagraph trees): one recording per row length
            compile_decoder_layers(model, CompileSettings(mode="reduce-overhead"))
        elif mode == "decoder":  # the whole decoder stack as one compiled region (one guard check, one wrapper)
            model.get_decoder().compile(dynamic=True)
        elif mode == "dgraphs":  # the whole decoder as one region with CUDA graphs
            model.get_decoder().compile(dynamic=True, mode="reduce-overhead")
        graphed, capture_s = None, None
        if mode in ("graphed", "egraphed"):  # the trainer's cuda_graph_step: compiled (egraphed: eager) layers
            if mode == "graphed":  # inside CUDA graphs of the decoder; eager layers still run FlexAttention compiled
                compile_decoder_layers(model)
            t = time.perf_counter()
            graphed = GraphedDecoder(model, max(r.num_tokens for r in rows), None if a.pure_bf16 else torch.bfloat16)
            graphed.capture_all(verify_row=rows[0])
            if graphed.failed:
                results["variants"][variant] = {"error": graphed.failed}
                print(variant, "failed:", graphed.failed, flush=True)
                continue
            capture_s = time.perf_counter() - t
        first = []
        try:
            for i in range(len(rows) if "graphs" in mode else 2):  # compile (and record each length's graphs)
                sync()
                t = time.perf_counter()
                step(rows[i], backend, None)
                sync()
                first.append(time.perf_counter() - t)
        except Exception as exc:  # noqa: BLE001 - a probe: record why a variant cannot run and go on
            results["variants"][variant] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            print(variant, "failed:", results["variants"][variant]["error"], flush=True)
            continue
        times: dict = {}
        for i in range(a.iters):
            step(rows[i % len(rows)], backend, times)
        unsynced = []
        for i in range(a.iters):  # no sync between regions: the step as the trainer could run it
            sync()
            t = time.perf_counter()
            step(rows[i % len(rows)], backend, None)
            sync()
            unsynced.append(time.perf_counter() - t)
        med = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in times.items()}
        med["total_unsynced"] = 1e3 * sorted(unsynced)[len(unsynced) // 2]
        results["variants"][variant] = {"first_calls_s": first, "median_ms": med, "capture_s": capture_s}
        print(variant, {k: round(v, 2) for k, v in med.items()}, "first", [round(x, 2) for x in first],
              "capture", capture_s and round(capture_s, 2), flush=True)  # fmt: skip
        if a.profile_dir:
            Path(a.profile_dir).mkdir(parents=True, exist_ok=True)
            acts = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if dev == "cuda" else []
            )
            with torch.profiler.profile(activities=acts) as prof:
                for i in range(3):
                    step(rows[i], backend, None)
                sync()
            avg = prof.key_averages()
            name = variant.replace(":", "_")
            for key in ("self_cuda_time_total", "self_cpu_time_total"):
                if dev == "cuda" or key == "self_cpu_time_total":
                    (Path(a.profile_dir) / f"{name}_{key}.txt").write_text(avg.table(sort_by=key, row_limit=40))
    if a.out:
        write_result(a.out, {"what": __doc__.splitlines()[0], "command": " ".join(sys.argv), **results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
