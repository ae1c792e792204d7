"""Weight sync to two generation servers (X5): one group per server vs one shared group, against one server.

    python bench/multi_server_sync.py --out bench/results/multi_server_sync_h200x2.json      # 2 GPUs
    python bench/multi_server_sync.py --server-gpus 0,1 --trainer-gpu 2 \
        --out bench/results/multi_server_sync_h200x4.json                                     # 3+ GPUs

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"). So on two GPUs both
servers share GPU 0 (``--gpu-memory-utilization``) and the trainer has GPU 1: only ``per_server`` can
run there (each group is {trainer GPU, one server GPU}); ``shared`` puts both servers in one group and
needs them on distinct GPUs, so it is measured only when no GPU repeats (three GPUs or more).

Two embedded servers (``asyncgrpo serve``, bf16, NCCL weight transfer) load a random-init model of the
chosen shape (default Qwen3-1.7B: 2.03 B parameters, 4.06 GB in bf16; tied embeddings are sent once,
so a round moves 3.44 GB); the trainer side holds the same-shaped model on ``--trainer-gpu``. Measured
in one run, each after one warm-up round, median of ``--rounds``:

* ``single``: ``WeightSender`` to server 0 alone (the one-server baseline of today);
* ``per_server``: ``WeightSender`` over both servers with one NCCL group per server (every tensor broadcast twice);
* ``shared``: ``WeightSender`` over both servers with one NCCL group of 1 + 2 ranks (every tensor broadcast once).

Each row gives the round's pause / transfer / total seconds, the transfer rate of the bytes every server
receives, and the ratio of the round to the one-server round. After the rounds both servers must report
the last version on ``/weight_info`` (checked; the JSON says so). Needs CUDA; leave NVLink multicast off
(the script sets NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.result_file
from bench.result_file import write_result

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SHAPES = {  # Qwen3 shapes (hidden, intermediate, layers, heads, kv heads)
    "1.7b": (2048, 6144, 28, 16, 8),
    "0.6b": (1024, 3072, 28, 16, 8),
    "tiny": (256, 512, 2, 4, 2),
}


def write_model(path: Path, shape: str, device: str):
    """Save a random-init model of ``shape`` for the servers; return it (bf16, on the trainer's GPU)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    hidden, inter, layers, heads, kv = SHAPES[shape]
    cfg = Qwen3Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                      max_position_embeddings=4096)  # fmt: skip
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return model


def weight_version(url: str) -> str:
    with urllib.request.urlopen(url + "/weight_info", timeout=30) as r:
        return json.loads(r.read())["weight_version"]


def measure(sender, model, rounds: int, label: str) -> dict:
    sender.update_model(model, version=f"{label}-warmup")
    rows = [sender.update_model(model, version=f"{label}-{i}") for i in range(rounds)]
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="1.7b")
    p.add_argument("--server-gpus", default="0,0", help="the GPU of each of the two servers (0,0: they share GPU 0)")
    p.add_argument("--trainer-gpu", default="1", help="must differ from every server GPU (NCCL: one rank per GPU)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--mem-frac", type=float, default=0.3, help="--gpu-memory-utilization of each server")
    p.add_argument("--out", default="bench/results/multi_server_sync_h200x2.json")
    p.add_argument("--cpu", action="store_true", help="a smoke run of the script on CPU over gloo (use --shape tiny)")
    a = p.parse_args()
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    os.environ["CUDA_VISIBLE_DEVICES"] = a.trainer_gpu  # the trainer sees only its GPU; each server gets its own
    import torch

    if not a.cpu and not torch.cuda.is_available():
        print("needs CUDA: nothing measured", file=sys.stderr)
        return 2
    from asyncgrpo.client.http_client import AsyncServerClient
    from asyncgrpo.server.launcher import launch_server
    from asyncgrpo.weights.collectives import DEFAULT_PACKED_BUFFER_SIZE_BYTES
    from asyncgrpo.weights.policy import policy_weight_metadata
    from asyncgrpo.weights.sender import WeightSender

    tmp = Path(tempfile.mkdtemp(prefix="multi-server-sync-"))
    t0 = time.time()
    gpus = a.server_gpus.split(",")
    backend, dev = ("gloo", "cpu") if a.cpu else ("nccl", "cuda:0")
    if a.trainer_gpu in gpus and not a.cpu:
        print(f"the trainer GPU {a.trainer_gpu} is also a server GPU: NCCL refuses that; pick another", file=sys.stderr)
        return 2
    model = write_model(tmp / "model", a.shape, dev)
    nbytes = sum(m.nbytes for m in policy_weight_metadata(model))
    flags = ["--device", dev, "--dtype", "bfloat16", "--max-model-len", "512", "--gpu-memory-utilization",
             str(a.mem_frac), "--weight-transfer-config", json.dumps({"backend": backend})]  # fmt: skip
    servers = []
    try:
        for gpu in gpus:
            env = {"CUDA_VISIBLE_DEVICES": "" if a.cpu else gpu, **NO_MULTICAST}
            servers.append(launch_server(tmp / "model", extra_args=flags, env=env, timeout=600))
        urls = [s.base_url for s in servers]
        print(f"model {a.shape}: {nbytes / 1e9:.2f} GB per round; servers {urls} ready after {time.time() - t0:.0f}s")
        results = {}
        single = WeightSender(timeout_s=300)
        single.init(AsyncServerClient(urls[0]), 1, backend=backend, device=dev)
        results["single"] = measure(single, model, a.rounds, "single")
        single.close()
        for topology in ("per_server", "shared"):
            if topology == "shared" and len(set(gpus)) < len(gpus) and not a.cpu:
                results[topology] = {"skipped": f"servers share a GPU ({a.server_gpus}): NCCL needs one per rank"}
                print(f"shared: skipped, {results[topology]['skipped']}")
                continue
            fan = WeightSender(
                timeout_s=300, topology=topology, packed_buffer_size_bytes=DEFAULT_PACKED_BUFFER_SIZE_BYTES
            )
            fan.init([AsyncServerClient(u) for u in urls], [1] * len(urls), backend=backend, device=dev)
            results[topology] = measure(fan, model, a.rounds, topology)
            versions = [weight_version(u) for u in urls]
            results[topology]["all_servers_report_last_version"] = versions == [f"{topology}-{a.rounds - 1}"] * 2
            fan.close()
        base = results["single"]["total_s"]
        for name, r in results.items():
            if "skipped" in r:
                continue
            r["gb_per_s"] = nbytes / 1e9 / r["transfer_s"]
            r["ratio_to_single"] = r["total_s"] / base
            print(f"{name:>10}: pause {r['pause_s'] * 1e3:7.1f} ms  transfer {r['transfer_s'] * 1e3:7.1f} ms  "
                  f"total {r['total_s'] * 1e3:7.1f} ms  {r['gb_per_s']:6.1f} GB/s  x{r['ratio_to_single']:.2f} "
                  "of one server")  # fmt: skip
        record = {"shape": a.shape, "bytes_per_round": nbytes, "server_gpus": a.server_gpus,
                  "trainer_gpu": a.trainer_gpu, "rounds": a.rounds, "device": "cpu" if a.cpu else torch.cuda.get_device_name(),
                  "results": results}  # fmt: skip
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        write_result(Path(a.out), record, indent=1)
        print(f"wrote {a.out}")
        return 0
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    sys.exit(main())
