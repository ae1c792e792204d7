"""How much a training step loses to a decoding server on the same GPU: time-slicing against MPS (issue 38, B6-1GPU).

    python bench/probes/gpu_share_probe.py --out gpu_share_probe.json [--seconds 12]

Two processes, as in a one-GPU run: ``train`` runs forward+backward of a random-init SmolLM2-360M-shaped Llama (bf16,
``--rows`` x ``--row-len`` tokens a step); ``decode`` replays one CUDA graph per step that does the work of a decode
step of the same shape (32 layers of projections, attention over a KV cache, MLP, the LM head, an argmax) for
``--batch`` sequences, then reads the tokens back as an engine does. Each runs alone, then both together: once
time-sliced (the default between two processes), once under a private MPS daemon (kernels of both share the SMs).
The JSON has each side's seconds per step alone and together, so the cost of sharing is read off directly.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncgrpo.server.mps import MpsUnavailable, mps_daemon

SHAPE = {"hidden": 960, "inter": 2560, "layers": 32, "heads": 15, "kv_heads": 5, "head_dim": 64, "vocab": 49152}


def train_role(a: argparse.Namespace) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=SHAPE["hidden"], intermediate_size=SHAPE["inter"], num_hidden_layers=SHAPE["layers"],
                      num_attention_heads=SHAPE["heads"], num_key_value_heads=SHAPE["kv_heads"], head_dim=64,
                      vocab_size=SHAPE["vocab"], tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    ids = torch.randint(0, SHAPE["vocab"], (a.rows, a.row_len), device="cuda")

    def step() -> None:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    return _timed(step, a)


def decode_role(a: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    b, h, kvh, d, L = a.batch, SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"], a.kv_len
    dt = {"device": "cuda", "dtype": torch.bfloat16}
    layers = [
        {
            "qkv": torch.randn(SHAPE["hidden"], (h + 2 * kvh) * d, **dt) * 0.02,
            "o": torch.randn(h * d, SHAPE["hidden"], **dt) * 0.02,
            "up": torch.randn(SHAPE["hidden"], 2 * SHAPE["inter"], **dt) * 0.02,
            "down": torch.randn(SHAPE["inter"], SHAPE["hidden"], **dt) * 0.02,
            "k": torch.randn(b, kvh, L, d, **dt),
            "v": torch.randn(b, kvh, L, d, **dt),
        }
        for _ in range(SHAPE["layers"])
    ]
    head = torch.randn(SHAPE["hidden"], SHAPE["vocab"], **dt) * 0.02
    x0 = torch.randn(b, SHAPE["hidden"], **dt)
    tokens = torch.zeros(b, dtype=torch.long, device="cuda")

    def forward() -> None:
        x = x0
        for w in layers:
            qkv = x @ w["qkv"]
            q = qkv[:, : h * d].view(b, h, 1, d)
            att = F.scaled_dot_product_attention(q, w["k"], w["v"], enable_gqa=True).reshape(b, h * d)
            x = x + att @ w["o"]
            gate, up = (x @ w["up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w["down"]
        tokens.copy_((x @ head).argmax(-1))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()

    def step() -> None:
        graph.replay()
        tokens.cpu()  # the engine reads the sampled tokens back every step

    return _timed(step, a)


def _timed(step, a: argparse.Namespace) -> dict:
    """Warm up, wait for the shared start time, then time steps for ``seconds``."""
    import torch

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    while time.time() < a.start_at:
        time.sleep(0.005)
    times: list[float] = []
    end = time.time() + a.seconds
    while time.time() < end:
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    times.sort()
    return {
        "steps": len(times),
        "s_per_step_median": times[len(times) // 2],
        "s_per_step_mean": sum(times) / len(times),
    }


def run_phase(roles: list[str], a: argparse.Namespace, env: dict[str, str], work: Path, tag: str) -> dict:
    """Start ``roles`` as processes at one shared start time; returns each role's timings."""
    start_at = time.time() + a.setup_s
    procs = {}
    for role in roles:
        out = work / f"{tag}_{role}.json"
        cmd = [sys.executable, __file__, "--role", role, "--role-out", str(out), "--start-at", str(start_at),
               *sys.argv[1:]]  # fmt: skip
        procs[role] = (subprocess.Popen(cmd, env={**os.environ, **env}), out)
    result = {}
    for role, (p, out) in procs.items():
        rc = p.wait(timeout=a.setup_s + a.seconds + 120)
        result[role] = json.loads(out.read_text()) if rc == 0 and out.exists() else {"error": f"exit {rc}"}
    print(tag, json.dumps(result), flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_share_probe.json")
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--setup-s", type=float, default=25.0, help="time given to both processes to build and warm up")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--row-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--kv-len", type=int, default=192)
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--role-out", help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role:
        res = train_role(a) if a.role == "train" else decode_role(a)
        Path(a.role_out).write_text(json.dumps(res))
        return 0
    work = Path(tempfile.mkdtemp(prefix="share-probe-"))
    res: dict = {"shape": SHAPE, "train_tokens": a.rows * a.row_len, "decode_batch": a.batch, "kv_len": a.kv_len}
    res["compute_mode"] = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"],
                                         check=False, capture_output=True, text=True).stdout.strip()  # fmt: skip
    res["time_sliced"] = {
        "train_alone": run_phase(["train"], a, {}, work, "ts_train")["train"],
        "decode_alone": run_phase(["decode"], a, {}, work, "ts_decode")["decode"],
        "together": run_phase(["train", "decode"], a, {}, work, "ts_both"),
    }
    try:  # the library's daemon (server/mps.py): this process never initializes CUDA, its children are the clients
        with mps_daemon(check=False) as env:
            res["mps_start"] = "started"
            res["mps"] = {
                "train_alone": run_phase(["train"], a, env, work, "mps_train")["train"],
                "together": run_phase(["train", "decode"], a, env, work, "mps_both"),
            }
    except MpsUnavailable as e:
        res["mps_start"] = str(e)
    for mode in ("time_sliced", "mps"):
        m = res.get(mode)
        if not m or "error" in m["together"].get("train", {}) or "error" in m["together"].get("decode", {}):
            continue
        t_alone = res["time_sliced"]["train_alone"]["s_per_step_median"]
        d_alone = res["time_sliced"]["decode_alone"]["s_per_step_median"]
        m["train_slowdown"] = m["together"]["train"]["s_per_step_median"] / t_alone
        m["decode_slowdown"] = m["together"]["decode"]["s_per_step_median"] / d_alone
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps({k: res.get(k, {}).get("train_slowdown") for k in ("time_sliced", "mps")}), res["mps_start"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
