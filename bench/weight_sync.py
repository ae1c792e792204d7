"""B4: weight sync pause -> resume for a Qwen3-1.7B-shaped bf16 model, against a bare NCCL broadcast.

Run on a machine with 2 GPUs (a few minutes on H200s, mostly writing and loading the 3.4 GB model):
    python bench/weight_sync.py --out bench/results/weight_sync_h200x2.json [--fsdp2]

In one run:
1. bare: a helper process on GPU 0 and this process on GPU 1 form a raw NCCL communicator
   (``weights/nccl_lib``, as the sender does) and broadcast the model's bytes GPU 1 -> GPU 0,
   (a) as one buffer and (b) one broadcast per parameter tensor; median of ``--iters``.
2. sync: one ``asyncgrpo serve`` on GPU 0 serves the model (random init, bf16); for each of ``--modes`` a
   ``WeightSender`` on GPU 1 forms a group with it (packing is fixed when the group forms: ``packed:<MiB>`` =
   ``packed_buffer_size_bytes``, 1024 is vLLM's default; or ``unpacked``) and pushes the trainer's copy with
   ``update_model`` (pause, start, broadcast, finish + reset prefix cache, resume); median of ``--iters`` rounds
   after ``--warmup``. Then ``--profile-iters`` more rounds with both ends profiled (``weights/wire_profile.py``:
   CUDA events around every pack, broadcast and unpack), kept apart so the timed rounds carry no profiling.
3. ``--in-thread-modes``: the same against a server whose engine runs as a thread of its HTTP process
   (``--engine-process off``; on CUDA the default server runs its engine in a process of its own).
4. ``--fsdp2``: the same rounds from two FSDP2 trainer ranks (rank 0 on GPU 1 sends, rank 1 on GPU 0 beside the
   server joins the full-tensor gathers; NCCL refuses two members of one communicator on one GPU, so the sender
   cannot share the server's GPU), modes ``--fsdp2-modes``.

The JSON holds every timing, the bytes moved, ``ratio`` = sync total / bare one-buffer broadcast, and per mode:
``host_steps_ms`` (median ms from the round's start at which each step ended: pause, start, enqueued (every
broadcast queued on the host), synchronized (done on the sender's GPU), update_reply (the server loaded it all),
finish_and_reset, resume) and ``breakdown`` (the profiled rounds: ``sender_wire`` and ``receiver.wire`` timelines
in ms with ``span``, ``fill`` (before the first broadcast), ``drain`` (after the last), ``wire_busy``, ``wire_gaps``,
``pack``/``unpack``/``broadcast`` sums; ``receiver.host``: engine_start, enqueued, synchronized, done, in ms since
``/update_weights`` arrived). A machine without 2 GPUs exits 2 (no numbers made up).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.result_file
from bench.result_file import write_result

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


def _median_steps(steps: list[dict]) -> dict[str, float]:
    keys = [k for k, v in steps[0].items() if isinstance(v, float)]
    return {k: statistics.median(s[k] for s in steps if k in s) for k in keys}


def _bucket(mode: str) -> tuple[bool, int]:
    """``mode`` -> (packed, packed_buffer_size_bytes)."""
    if mode == "unpacked":
        return False, 1 << 30
    if not mode.startswith("packed:"):
        raise SystemExit(f"mode {mode!r} is not 'unpacked' or 'packed:<MiB>'")
    return True, int(float(mode.split(":")[1]) * (1 << 20))


def sync_rounds(url: str, model, args, mode: str, device: str, barrier=None) -> dict:
    """Timed rounds, then profiled ones, of one group (``mode`` fixes its packing)."""
    from asyncgrpo.client.http_client import AsyncServerClient
    from asyncgrpo.weights.sender import WeightSender

    packed, size = _bucket(mode)
    sender = WeightSender(timeout_s=300, packed_buffer_size_bytes=size, packed_num_buffers=args.num_buffers,
                          profile=False)  # fmt: skip
    rounds, steps, breakdown = [], [], []
    try:
        sender.init(AsyncServerClient(url), backend="nccl", device=device, packed=packed)
        for i in range(args.warmup + args.iters + args.profile_iters):
            sender.profile = i >= args.warmup + args.iters
            t = sender.update_model(model, version=f"bench-{mode}-{i}", barrier=barrier)
            if sender.profile:
                breakdown.append(sender.last_breakdown)
            elif i >= args.warmup:
                rounds.append(t)
                steps.append(sender.last_breakdown)
        if args.profile_iters:
            sender._http(sender._client.request("POST", "/weight_sync_profile", json_body={"enabled": False}),
                         "POST /weight_sync_profile")  # fmt: skip
    finally:
        sender.close()
    keys = rounds[0].keys()
    return {"rounds": rounds, "median": {k: statistics.median(r[k] for r in rounds) for k in keys},
            "host_steps_ms": _median_steps(steps), "breakdown": breakdown,
            "packed_buffer_size_bytes": size if packed else None, "num_buffers": args.num_buffers}  # fmt: skip


def _summary_line(mode: str, r: dict) -> str:
    med = {k: round(v * 1e3, 2) for k, v in r["median"].items()}
    line = f"sync {mode}: {med} ms -> {r['ratio']:.2f} x bare; steps {_rounded(r['host_steps_ms'])}"
    if r["breakdown"]:
        last = r["breakdown"][-1]
        keys = ("span_ms", "fill_ms", "drain_ms", "wire_busy_ms", "wire_gaps_ms", "pack_ms", "unpack_ms")
        for end, wire in (("sender", last.get("sender_wire")), ("receiver", (last.get("receiver") or {}).get("wire"))):
            if wire:
                line += f"\n  {end}: " + str({k.removesuffix("_ms"): round(wire[k], 2) for k in keys if k in wire})
    return line


def _rounded(d: dict) -> dict:
    return {k: round(v, 2) for k, v in d.items()}


def _fsdp_rank(rank: int, port: int, url: str, shape: dict, args, out) -> None:
    """One of two FSDP2 trainer ranks: rank 0 on GPU 1 sends, rank 1 on GPU 0 (beside the server) joins the
    gathers of every round, as the trainer's ``sync_weights`` does."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, Qwen3Config

    from asyncgrpo.weights.policy import join_policy_gathers

    os.environ.update(NO_MULTICAST)
    dev = torch.device("cuda", 1 - rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=dev)
    try:
        torch.manual_seed(0)
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=torch.bfloat16)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        results = {}
        for mode in args.fsdp2_modes:
            if rank == 0:
                results[mode] = sync_rounds(url, model, args, mode, str(dev), barrier=dist.barrier)
            else:
                for _ in range(args.warmup + args.iters + args.profile_iters):
                    dist.barrier()
                    join_policy_gathers(model)
            dist.barrier()
        if rank == 0:
            out.put(results)
    finally:
        dist.destroy_process_group()


def fsdp2_rounds(url: str, shape: dict, args) -> dict:
    """``sync_rounds`` per ``--fsdp2-modes`` from two FSDP2 ranks (spawned processes)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_fsdp_rank, args=(r, port, url, shape, args, out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=900)
    finally:
        for p in procs:
            p.join(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny model (still needs 2 GPUs)")
    ap.add_argument("--modes", nargs="*", default=["packed:1024", "packed:256", "packed:128", "packed:64", "unpacked"],
                    help="unpacked, or packed:<bucket MiB> (packed_buffer_size_bytes)")  # fmt: skip
    ap.add_argument("--num-buffers", type=int, default=2, help="packed_num_buffers (>= 2 pipelines the buckets)")
    ap.add_argument("--profile-iters", type=int, default=2, help="profiled rounds per mode, after the timed ones")
    ap.add_argument("--fsdp2", action="store_true", help="also sync from two FSDP2 trainer ranks")
    ap.add_argument("--fsdp2-modes", nargs="*", default=["packed:1024", "packed:256"])
    ap.add_argument("--in-thread-modes", nargs="*", default=[],
                    help="also run these modes against a second server with --engine-process off (the engine thread "
                    "in the HTTP process; the default server on CUDA runs its engine in a process of its own)")  # fmt: skip
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
    from asyncgrpo.server.launcher import launch_server

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model.save_pretrained(model_dir)
        server_args = ["--device", "cuda:0", "--dtype", "bfloat16", "--max-model-len", "256",
                       "--gpu-memory-utilization", "0.3", "--weight-transfer-config", '{"backend": "nccl"}']  # fmt: skip
        bare = report["bare"]["one_buffer"]["median_s"]
        if args.in_thread_modes:  # first, so the default server's figures come last in the log
            server = launch_server(model_dir, extra_args=[*server_args, "--engine-process", "off"],
                                   env={"CUDA_VISIBLE_DEVICES": "0", **NO_MULTICAST}, timeout=600)  # fmt: skip
            try:
                for mode in args.in_thread_modes:
                    r = sync_rounds(server.base_url, model, args, mode, "cuda:1")
                    _keep(
                        report, "in_thread_engine_sync", "engine thread in the HTTP process: ", mode, r, bare, args.out
                    )
            finally:
                server.stop()
        server = launch_server(
            model_dir, extra_args=server_args, env={"CUDA_VISIBLE_DEVICES": "0", **NO_MULTICAST}, timeout=600
        )
        try:
            for mode in args.modes:  # one group per mode, formed again on the same server
                r = sync_rounds(server.base_url, model, args, mode, "cuda:1")
                _keep(report, "sync", "", mode, r, bare, args.out)
            if args.fsdp2:
                del model
                torch.cuda.empty_cache()
                for mode, r in fsdp2_rounds(server.base_url, shape, args).items():
                    _keep(report, "fsdp2_sync", "FSDP2 (2 ranks) ", mode, r, bare, args.out)
        finally:
            server.stop()
    report["wall_s"] = time.perf_counter() - start
    write(args.out, report)
    print(f"wrote {args.out}")
    return 0


def _keep(report: dict, prefix: str, label: str, mode: str, rounds: dict, bare_s: float, out: Path | None) -> None:
    """One mode's sync rounds into the report with their ratio to the bare broadcast, printed and written at once
    (what is measured survives a later failure)."""
    rounds["ratio"] = rounds["median"]["total_s"] / bare_s
    report[f"{prefix}_{mode.replace(':', '_')}"] = rounds
    print(label + _summary_line(mode, rounds), flush=True)
    write(out, report)


def write(path: Path | None, report: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_result(path, report)


if __name__ == "__main__":
    sys.exit(main())
