"""B4: weight sync pause -> resume for a Qwen3-1.7B-shaped bf16 model, against a bare NCCL broadcast.

Run on a machine with 2 GPUs (about 2 minutes on H200s, mostly writing and loading the 3.4 GB model):
    python bench/weight_sync.py --out bench/results/weight_sync_h200x2.json

In one run:
1. bare: a helper process on GPU 0 and this process on GPU 1 form a raw NCCL communicator
   (``weights/nccl_lib``, as the sender does) and broadcast the model's bytes GPU 1 -> GPU 0,
   (a) as one buffer and (b) one broadcast per parameter tensor; median of ``--iters``.
2. sync: ``asyncgrpo serve`` on GPU 0 serves the model (random init, bf16); a ``WeightSender``
   on GPU 1 pushes the trainer's copy with ``update_model`` (pause, start, broadcast, finish,
   reset prefix cache, resume), packed in 1 GiB chunks (vLLM's default), in 64 MiB chunks, and
   unpacked; median of ``--iters`` rounds after ``--warmup``. One server per mode (packing is fixed
   when the group forms).

The JSON holds every timing, the bytes moved, and ``ratio`` = sync total / bare one-buffer broadcast.
A machine without 2 GPUs exits 2 (no numbers made up).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
QWEN3_1_7B = {
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151_936, "tie_word_embeddings": True,
    "max_position_embeddings": 40_960, "eos_token_id": 2, "bos_token_id": 1,
}  # fmt: skip
SMOKE = {**QWEN3_1_7B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 4096}  # fmt: skip


def _peer(uid: bytes, sizes: list[int], iters: int, warmup: int, done) -> None:
    """GPU 0 side of the bare broadcasts: rank 1 of a 2-rank communicator."""
    from asyncgrpo.weights import nccl_lib

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    comm = nccl_lib.Communicator(2, uid, 1, dev)
    total = sum(sizes)
    buf = torch.empty(total, dtype=torch.uint8, device=dev)
    pieces = list(torch.split(buf, sizes))
    for _ in range(warmup + iters):
        comm.broadcast(buf, root=0)
    for _ in range(warmup + iters):
        for p in pieces:
            comm.broadcast(p, root=0)
    torch.cuda.synchronize()
    done.put("ok")  # before destroy: NCCL's destroy may wait for the peer's, which comes after this "ok"
    comm.destroy()


def bare_broadcast(sizes: list[int], iters: int, warmup: int) -> dict:
    """Seconds per broadcast of ``sum(sizes)`` bytes from GPU 1 to a peer process on GPU 0."""
    from asyncgrpo.weights import nccl_lib

    ctx = mp.get_context("spawn")
    uid = nccl_lib.unique_id()
    done = ctx.Queue()
    proc = ctx.Process(target=_peer, args=(uid, sizes, iters, warmup, done), daemon=True)
    proc.start()
    dev = torch.device("cuda", 1)
    torch.cuda.set_device(dev)
    comm = nccl_lib.Communicator(2, uid, 0, dev)
    buf = torch.empty(sum(sizes), dtype=torch.uint8, device=dev)
    pieces = list(torch.split(buf, sizes))
    out = {}
    for name, run in (("one_buffer", lambda: comm.broadcast(buf, root=0)),
                      ("per_tensor", lambda: [comm.broadcast(p, root=0) for p in pieces])):  # fmt: skip
        times = []
        for i in range(warmup + iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        out[name] = {"times_s": times, "median_s": statistics.median(times)}
    done.get(timeout=120)
    comm.destroy()  # both ranks destroy together (the peer right after its "ok")
    proc.join(30)
    out["bytes"] = sum(sizes)
    out["one_buffer"]["gb_per_s"] = out["bytes"] / out["one_buffer"]["median_s"] / 1e9
    return out


def sync_rounds(model_dir: Path, model, iters: int, warmup: int, mode: str, server_args: list[str]) -> dict:
    """``mode``: "unpacked", or "packed:<MiB>" (packed_buffer_size_bytes; 1024 is vLLM's default)."""
    from asyncgrpo.client.http_client import AsyncServerClient
    from asyncgrpo.server.launcher import launch_server
    from asyncgrpo.weights.sender import WeightSender

    server = launch_server(
        model_dir, extra_args=server_args, env={"CUDA_VISIBLE_DEVICES": "0", **NO_MULTICAST}, timeout=600
    )
    packed = mode.startswith("packed")
    size = int(mode.split(":")[1]) << 20 if packed else 1 << 30
    sender = WeightSender(timeout_s=300, packed_buffer_size_bytes=size)
    try:
        sender.init(AsyncServerClient(server.base_url), backend="nccl", device="cuda:1", packed=packed)
        rounds = []
        for i in range(warmup + iters):
            t = sender.update_model(model, version=f"bench-{mode}-{i}")
            if i >= warmup:
                rounds.append(t)
    finally:
        sender.close()
        server.stop()
    keys = rounds[0].keys()
    return {"rounds": rounds, "median": {k: statistics.median(r[k] for r in rounds) for k in keys}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny model (still needs 2 GPUs)")
    ap.add_argument("--modes", nargs="*", default=["packed:1024", "packed:64", "unpacked"],
                    help="unpacked, or packed:<buffer MiB>")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("weight_sync benchmark needs 2 CUDA devices (server on GPU 0, trainer on GPU 1); no numbers made up",
              file=sys.stderr)  # fmt: skip
        return 2
    os.environ.update({k: os.environ.get(k, v) for k, v in NO_MULTICAST.items()})
    from transformers import AutoModelForCausalLM, Qwen3Config

    from asyncgrpo.weights.policy import policy_weight_metadata

    start = time.perf_counter()
    shape = SMOKE if args.smoke else QWEN3_1_7B
    torch.manual_seed(0)
    with torch.device("cuda:1"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=torch.bfloat16)
    metas = policy_weight_metadata(model)
    sizes = [m.nbytes for m in metas]
    report: dict = {
        "benchmark": "B4 weight sync",
        "device": torch.cuda.get_device_name(1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model_shape": "smoke" if args.smoke else "qwen3-1.7b",
        "dtype": "bfloat16",
        "tensors": len(metas),
        "bytes": sum(sizes),
        "iters": args.iters,
        "warmup": args.warmup,
    }
    report["bare"] = bare_broadcast(sizes, args.iters, args.warmup)
    write(args.out, report)
    print(f"bare one-buffer broadcast of {sum(sizes) / 1e9:.2f} GB: {report['bare']['one_buffer']['median_s'] * 1e3:.2f} "
          f"ms; per tensor ({len(sizes)}): {report['bare']['per_tensor']['median_s'] * 1e3:.2f} ms")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model.save_pretrained(model_dir)
        server_args = ["--device", "cuda:0", "--dtype", "bfloat16", "--max-model-len", "256",
                       "--gpu-memory-utilization", "0.3", "--weight-transfer-config", '{"backend": "nccl"}']  # fmt: skip
        bare = report["bare"]["one_buffer"]["median_s"]
        for mode in args.modes:
            r = sync_rounds(model_dir, model, args.iters, args.warmup, mode, server_args)
            r["ratio"] = r["median"]["total_s"] / bare
            report[f"sync_{mode.replace(':', '_')}"] = r
            med = {k: round(v * 1e3, 2) for k, v in r["median"].items()}
            print(f"sync {mode}: {med} ms -> {r['ratio']:.2f} x bare")
            write(args.out, report)  # what is measured survives a later failure
    report["wall_s"] = time.perf_counter() - start
    write(args.out, report)
    print(f"wrote {args.out}")
    return 0


def write(path: Path | None, report: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.exit(main())
