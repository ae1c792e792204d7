"""One GPU for the generation server and the trainer: who gets how much, and what to change when it does not fit.

The server takes ``--gpu-memory-utilization`` of the GPU's memory (model, KV cache, graphs); the trainer
the rest (model, gradients, optimizer state, activations). An out-of-memory error in the trainer then
usually means the split is wrong, which torch's message cannot say: :func:`shared_gpu_oom` names the settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

EMBEDDED_GPU_SHARE = 0.3  # the embedded server's default share when `asyncgrpo train` starts it on the trainer's GPU
SHARE_FLAG = "--gpu-memory-utilization"


def shared_gpu_oom(exc: BaseException, device: torch.device | str) -> torch.OutOfMemoryError:
    """``exc`` (an out-of-memory error of a trainer sharing ``device`` with the server) with the settings to change.

    Returns an ``OutOfMemoryError`` (so callers that catch it still do) whose message says how the GPU is split now.
    """
    import torch  # here: `asyncgrpo train` reads this module's constants before anything heavy is imported

    dev = torch.device(device)
    split = ""
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        mine = torch.cuda.memory_reserved(dev)
        others = max(total - free - mine, 0)
        split = (f" The trainer holds {mine / 2**30:.1f} GiB, other processes (the server) {others / 2**30:.1f} GiB "
                 f"of {total / 2**30:.1f} GiB.")  # fmt: skip
    return torch.OutOfMemoryError(
        f"CUDA out of memory in the trainer, which shares its GPU with the generation server (weights over ipc).{split}"
        f" Give the trainer more: lower the server's {SHARE_FLAG} (`server: args:` in the YAML; `asyncgrpo train` "
        f"starts its embedded server with {EMBEDDED_GPU_SHARE} unless told otherwise), or make training need less: "
        "lower token_budget or per_device_train_batch_size, turn on gradient_checkpointing. "
        f"torch said: {exc}"
    )
