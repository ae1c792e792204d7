"""Child process for the streaming weight-sync test: sync a PEFT model and report the peak extra memory.

Run as ``python -m tests.helpers.sync_probe URL MODEL_DIR --seed S [--packed] [--buffer BYTES]`` from the
repo root with ``MALLOC_MMAP_THRESHOLD_`` set low, so every tensor lives in its own mapping and is returned
to the OS when freed: resident memory then follows the live tensors. The probe builds the policy
(the checkpoint plus a random LoRA adapter on every linear layer, so each merged weight is a new
tensor made while syncing), does one warm-up round, then resets the kernel's RSS high-water mark
(``/proc/self/clear_refs``), does the measured round exactly as the trainer does
(``WeightSender.update_model``) and prints one JSON line: ``peak_extra_bytes`` (VmHWM after the round
minus VmRSS before it), ``largest_bytes`` and ``merged_bytes`` (sizes of the merged weights).
"""

from __future__ import annotations

import argparse
import json
import logging

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.weights.policy import policy_weight_metadata
from asyncgrpo.weights.sender import WeightSender
from tests.helpers.reference import ALL_LINEAR, hf_model, lora_model


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key} line")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("model_dir")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--packed", action="store_true")
    ap.add_argument("--buffer", type=int, default=1 << 20)
    ns = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    model = lora_model(hf_model(ns.model_dir), seed=ns.seed, rank=8, targets=ALL_LINEAR)
    merged = [m for m in policy_weight_metadata(model) if m.name.rsplit(".", 2)[-2] in ALL_LINEAR]
    sender = WeightSender(timeout_s=120, packed_buffer_size_bytes=ns.buffer)
    sender.init(AsyncServerClient(ns.url), backend="gloo", device="cpu", packed=ns.packed)
    try:
        sender.update_model(model, version="warm-up")
        before = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        sender.update_model(model, version="measured")
        peak = _status_kib("VmHWM")
    finally:
        sender.close()
    report = {
        "peak_extra_bytes": (peak - before) * 1024,
        "largest_bytes": max(m.nbytes for m in merged),
        "merged_bytes": sum(m.nbytes for m in merged),
        "merged_count": len(merged),
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
