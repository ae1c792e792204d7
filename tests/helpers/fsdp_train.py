"""A user's training script run by ``torchrun`` (``tests/helpers/fsdp_launch.py``), with probes for the tests.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/helpers/fsdp_train.py SPEC.json

SPEC keys: ``model_dir``, ``base_url``, ``dump_dir``, ``config`` (AsyncGRPOConfig keyword arguments, the FSDP2
settings among them), ``resume``. The probes (every rank takes part in the gathers; rank 0 writes):

- ``step1.pt``: the first step's packed rows (one list per micro-batch, one row per process), the full
  gradients just before the optimizer step, and the full parameters before training;
- ``begin.pt`` / ``end.pt``: full parameters and Adam first moments when training begins (after a resume
  has loaded the checkpoint) and ends;
- ``result.json``: global step, world size, the server's weight version, whether the model was FSDP2-sharded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: _full(p) for n, p in model.named_parameters()}


def _first_moments(trainer: Any) -> dict[str, torch.Tensor]:
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    out = {}
    for name, p in trainer.model.named_parameters():
        state = opt.state.get(p, {})
        if "exp_avg" in state:
            out[name] = _full(state["exp_avg"])
    return out


class Probe(TrainerCallback):
    def __init__(self, trainer: Any, dump: Path) -> None:
        self.trainer, self.dump = trainer, dump
        self.initial: dict[str, torch.Tensor] | None = None

    def _save(self, name: str, obj: Any) -> None:
        if self.trainer.is_world_process_zero():
            torch.save(obj, self.dump / name)

    def on_train_begin(self, args, state, control, **kw):
        snapshot = {"params": _params(self.trainer.model), "exp_avg": _first_moments(self.trainer)}
        self.initial = snapshot["params"]
        self._save("begin.pt", snapshot)

    def on_pre_optimizer_step(self, args, state, control, **kw):
        if state.global_step != 0:
            return
        grads = {n: _full(p.grad) for n, p in self.trainer.model.named_parameters() if p.grad is not None}
        rows = None
        if self.trainer.is_world_process_zero():
            rows = [mb.pack() for mb in self.trainer.step_stats.micro_batches]
        self._save("step1.pt", {"rows": rows, "grads": grads, "params": self.initial})

    def on_train_end(self, args, state, control, **kw):
        self._save("end.pt", {"params": _params(self.trainer.model), "exp_avg": _first_moments(self.trainer)})


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if not torch.cuda.is_available():
        from tests.helpers.fsdp_launch import allow_fsdp_on_cpu

        allow_fsdp_on_cpu()
    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.tasks.reasoning import reasoning_gym_dataset
    from tests.helpers.rewards import even_token_reward

    dump = Path(spec["dump_dir"])
    dump.mkdir(parents=True, exist_ok=True)
    args = AsyncGRPOConfig(vllm_server_base_url=spec["base_url"], **spec["config"])
    dataset = reasoning_gym_dataset("chain_sum", size=24, seed=0, system_prompt=None)
    trainer = AsyncGRPOTrainer(spec["model_dir"], reward_funcs=[even_token_reward], args=args, train_dataset=dataset)
    trainer.add_callback(Probe(trainer, dump))
    out = trainer.train(resume_from_checkpoint=spec.get("resume"))
    if trainer.is_world_process_zero():
        import asyncio

        from asyncgrpo.client.http_client import AsyncServerClient

        async def version() -> str:
            async with AsyncServerClient(spec["base_url"]) as client:
                return (await client.weight_info())["weight_version"]

        result = {
            "global_step": out.global_step,
            "world_size": args.world_size,
            "sharded": type(trainer.model.lm_head.weight).__name__ == "DTensor",
            "weight_version": asyncio.run(version()),
        }
        (dump / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
