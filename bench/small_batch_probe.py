"""Decode step time against batch size, engine in process (why a GRPO run's first group is slow).

The worker runs its first group alone (G3): 8 requests decode 256 steps at batch 8. On an H200 at the
Qwen3-0.6B shape those steps took ~2.1 ms each against ~3.8 ms at batch 256, although a batch-8 forward
reads the same weights and far less KV. This probe times decode steps at several batch sizes, with and
without top-N log-probs, so the fixed per-step cost (host work, graph launch, sampler) stands out.

    python bench/small_batch_probe.py --out bench/results/small_batch_probe_h200.json
    py-spy record -r 2000 -f raw -o prof.txt -- python bench/small_batch_probe.py --batches 8   # host profile
CPU smoke (tiny model; checks the script, not speed):  python bench/small_batch_probe.py --tiny
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.*
from bench.engine_run import submit_and_wait
from bench.rollout_path import QWEN3_06B, TINY, build_model_dir


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--batches", default="1,8,32,256")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()

    import torch

    from asyncgrpo.server.engine import Engine
    from asyncgrpo.server.request import Request, SamplingParams

    device = "cpu" if a.tiny else "cuda"
    shape = TINY if a.tiny else QWEN3_06B
    out_len = 8 if a.tiny else a.output_len
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(shape, device, "float32" if a.tiny else "bfloat16", Path(tmp) / "m")
        engine = Engine(str(model_dir), device=device, max_model_len=a.prompt_len + out_len + 16, max_num_seqs=256,
                        kv_cache_tokens=256 * (a.prompt_len + out_len + 16))  # fmt: skip
        engine.start()
        try:
            n = 0
            for logprobs in (8, 0):
                for b in [int(x) for x in a.batches.split(",")]:
                    for rep in range(2):  # the first run of a size compiles what it needs
                        reqs = [Request(f"r{n}-{i}", [(7 * i + 3 * j + n) % 1000 + 2 for j in range(a.prompt_len)],
                                        SamplingParams(max_tokens=out_len, min_tokens=out_len, ignore_eos=True,
                                                       temperature=1.0, logprobs=logprobs, seed=i))
                                for i in range(b)]  # fmt: skip
                        n += 1
                        engine.reset_prefix_cache()
                        before = engine.step_timings()
                        tokens, seconds = submit_and_wait(engine, reqs, f"b{b}", timeout=300)
                        after = engine.step_timings()
                        if rep == 0:
                            continue
                        steps = after["decode"]["steps"] - before["decode"]["steps"]
                        dec_s = after["decode"]["seconds"] - before["decode"]["seconds"]
                        row = {"batch": b, "logprobs": logprobs, "tokens": tokens, "seconds": seconds,
                               "decode_steps": steps, "decode_ms_per_step": 1e3 * dec_s / max(steps, 1),
                               "prefill_s": after["prefill"]["seconds"] - before["prefill"]["seconds"],
                               "tok_per_s": tokens / seconds}  # fmt: skip
                        results.append(row)
                        print(json.dumps(row), flush=True)
        finally:
            engine.shutdown()
    doc = {"benchmark": "decode step time against batch size (in process)", "shape": "tiny" if a.tiny else "qwen3-0.6b",
           "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "time": time.strftime("%Y-%m-%d %H:%M"),
           "results": results}  # fmt: skip
    if a.out:
        a.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
