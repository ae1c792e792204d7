"""A real training run in its own process, driven by the fault-matrix tests (they kill it, restart it, time it).

    python run_trainer.py SETTINGS.json

SETTINGS: ``server_url``, ``model_dir``, ``output_dir``, ``dataset_size``, ``resume`` (bool or ``"auto"``) and ``config``
(extra ``AsyncGRPOConfig`` keywords). The scenarios that kill nothing build the same run in the test process with
``build(settings, where)`` (the fault-matrix module puts this folder on ``sys.path``, so the spawned rollout
worker imports the reward functions from ``run_trainer`` by name). It writes, next to the output dir:

* ``worker.pid``: the rollout worker's pid once step 1 ended;
* ``steps.jsonl``: ``{"begin": step}`` when a run starts (the step it resumed at), then one line per optimizer
  step with the samples it trained per flat prompt index (the independent record the random-kill test checks
  the lineage against) and, with prompt pools, the draws it settled as ``[flat index, dataset row, pass
  fraction]`` in the order the trainer's pools learnt them.

``resume``: true, false, or ``"auto"`` (the library's: resume from the newest complete checkpoint, if any).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.tasks.reasoning import reasoning_gym_dataset


def parity_reward(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) + 0.01 * i for i, ids in enumerate(completion_ids)]


def exploding_reward(completion_ids, **kwargs):
    raise ValueError("the judge is offline")


def tied_reward(completion_ids, **kwargs):
    return [1.0 for _ in completion_ids]  # a saturated reward: every group ties


def row_reward(completion_ids, answer, **kwargs):
    """Depends on the prompt alone: the first k = (its answer's character codes summed) mod 5 samples pass, so a
    row's pass fraction (k / 4 with 4 generations) repeats in every run, whatever was generated."""
    k = sum(map(ord, answer[0])) % 5
    return [1.0 if i < k else 0.0 for i in range(len(completion_ids))]


class Record(TrainerCallback):
    def __init__(self, trainer: AsyncGRPOTrainer, where: Path) -> None:
        self.trainer, self.where = trainer, where

    def _write(self, record: dict) -> None:
        with open(self.where / "steps.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def on_train_begin(self, args, state, control, **kwargs):
        self._write({"begin": state.global_step})
        self.settled: list[list] = []
        data = getattr(self.trainer.source, "data", None)
        if data is not None and data.pools is not None:  # prompt pools: record each settled draw the copy learns
            learn = data.pools.learn

            def recording(draw: int, row: int, fraction: float | None) -> None:
                self.settled.append([draw, row, fraction])
                learn(draw, row, fraction)

            data.pools.learn = recording

    def on_step_end(self, args, state, control, **kwargs):
        counts: dict[int, int] = {}
        for mb in self.trainer.step_stats.micro_batches:
            for trie in mb.rows:
                for sample in trie.samples:
                    counts[sample.meta.row_index] = counts.get(sample.meta.row_index, 0) + 1
        self._write({"step": state.global_step, "samples": {str(k): v for k, v in sorted(counts.items())},
                     "settled": self.settled})  # fmt: skip
        self.settled = []
        if state.global_step >= 1 and self.trainer.worker is not None and self.trainer.worker.process is not None:
            (self.where / "worker.pid").write_text(str(self.trainer.worker.process.pid))


def build(s: dict, where: Path) -> AsyncGRPOTrainer:
    """The trainer of settings ``s``, recording into ``where`` (``steps.jsonl``, ``worker.pid``)."""
    dataset = reasoning_gym_dataset("chain_sum", size=s.get("dataset_size", 24), seed=0, system_prompt=None)
    cfg = dict(  # noqa: C408 - AsyncGRPOConfig keyword arguments
        output_dir=s["output_dir"],
        num_generations=4,
        max_completion_length=8,
        token_budget=384,
        vllm_server_base_url=s["server_url"],
        report_to=[],
        save_strategy="no",
        learning_rate=1e-3,
        gradient_checkpointing=False,
        vllm_server_timeout=120,
        rollout_worker_timeout=60,
        seed=0,
    )
    cfg.update(s.get("config", {}))
    if s.get("iterable"):
        dataset = dataset.to_iterable_dataset()
    rewards = {"tied": tied_reward, "exploding": exploding_reward, "row": row_reward}
    reward = rewards.get(s.get("reward", ""), parity_reward)
    trainer = AsyncGRPOTrainer(
        s["model_dir"], reward_funcs=[reward], args=AsyncGRPOConfig(**cfg), train_dataset=dataset
    )
    trainer.add_callback(Record(trainer, where))
    return trainer


def main(settings_path: str) -> None:
    s = json.loads(Path(settings_path).read_text())
    trainer = build(s, Path(settings_path).parent)
    resume = s.get("resume", False)
    trainer.train(resume_from_checkpoint=resume if resume == "auto" else (True if resume else None))


if __name__ == "__main__":
    main(sys.argv[1])
