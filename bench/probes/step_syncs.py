"""Where the packed training step synchronises the host with the GPU (issue 37: the GPU idles ~4 % of a B2 step).

One warm pass of ``bench/tree_packing.py``'s step (compiled layers, fused head) at the 1.7B shape with fewer
layers, under torch.profiler with Python stacks: each sync event (``cudaStreamSynchronize`` and the like, and
``aten::item``) is listed with its chain of parent ops and the innermost frames of this repo, counted.

    python3 bench/probes/step_syncs.py --layers 4 --shape G16_P2048_C256-1024 --backend varlen
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from asyncgrpo.packing.attention import build_plan, use_tree_attention
from asyncgrpo.trainer.compile import compile_decoder_layers
from bench.probes.profile_table import SYNCS
from bench.tree_packing import MODELS, SHAPES, build_model, packed_step
from bench.tree_packing_inputs import make_samples, plan_rows


def where(evt) -> str:
    parents, p = [], evt.cpu_parent
    while p is not None and len(parents) < 4:
        parents.append(p.name)
        p = p.cpu_parent
    ours = [f for f in (evt.stack or []) if "asyncgrpo" in f or "bench/" in f or "transformers" in f][:4]
    return f"{' < '.join(parents) or '-'} | {' < '.join(ours) or 'no python stack (autograd thread?)'}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--shape", default="G16_P2048_C256-1024", choices=list(SHAPES))
    ap.add_argument("--backend", default="varlen", choices=["flex", "varlen"])
    ap.add_argument("--share", action=argparse.BooleanOptionalAction, default=True, help="tree rows (else flat)")
    args = ap.parse_args()
    model = build_model({**MODELS["qwen3-1.7b"], "num_hidden_layers": args.layers}, "cuda")
    use_tree_attention(model)
    compile_decoder_layers(model)
    samples = make_samples(SHAPES[args.shape], model.config.vocab_size, seed=0)
    rows = [r.to("cuda") for r in plan_rows(samples, 16_384, share=args.share)]
    plans = [build_plan(r, args.backend) for r in rows]
    for _ in range(2):  # compile and warm
        model.zero_grad(set_to_none=True)
        for r, p in zip(rows, plans):
            packed_step(model, r, p)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for r, p in zip(rows, plans):
            packed_step(model, r, p)
        torch.cuda.synchronize()
    counts = collections.Counter(f"{e.name}: {where(e)}" for e in prof.events() if e.name in SYNCS)
    print(f"{len(rows)} rows, {args.layers} layers, backend {args.backend}: {sum(counts.values())} sync events")
    for key, n in counts.most_common(30):
        print(f"{n:5d}  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
