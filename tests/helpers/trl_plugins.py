"""A user-written TRL 1.16 rollout worker and weight transfer, as a TRL user would write them for the protocols.

``LocalGenerator`` holds its own copy of the policy (loaded from the model directory, never shared with the
trainer's); ``CopyWeightTransfer`` is the only way trained weights reach it (``send_weights`` copies each
``(name, tensor)`` in), and ``ThreadRolloutWorker`` samples groups from it on a thread, scores them by token parity
and pushes TRL-shaped samples onto its ``rollout_buffer``. Nothing here imports asyncgrpo: it is the user's code.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM


@dataclass
class Sample:
    """The fields of TRL 1.16's ``RolloutSample`` that its trainer reads."""

    prompt: list
    completion: list
    input_ids: np.ndarray
    completion_mask: np.ndarray
    old_log_probs: np.ndarray
    advantage: float
    model_version: int
    group_id: int
    metrics: dict = field(default_factory=dict)
    enqueued_at: float | None = None


class LocalGenerator:
    """The inference side: a private copy of the policy and the lock a weight swap holds (pause .. resume)."""

    def __init__(self, model_dir: Path | str) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.lock = threading.Lock()

    @torch.no_grad()
    def sample(self, prompt: list[int], n: int, length: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` completions of ``length`` tokens at temperature 1, and each sampled token's log-probability."""
        ids = torch.tensor([prompt] * n)
        logprobs = []
        for _ in range(length):
            logp = torch.log_softmax(self.model(ids).logits[:, -1].float(), dim=-1)
            tok = torch.multinomial(logp.exp(), 1, generator=gen)
            logprobs.append(logp.gather(1, tok))
            ids = torch.cat([ids, tok], dim=1)
        return ids, torch.cat(logprobs, dim=1)


class CopyWeightTransfer:
    """``WeightTransferProtocol``: pause takes the generator's lock, send_weights copies every tensor in, resume
    releases it. ``stall_from`` makes the n-th send (0-based) and later ones never return (a hung transfer)."""

    def __init__(self, generator: LocalGenerator, stall_from: int | None = None) -> None:
        self.generator = generator
        self.calls: list[str] = []
        self.sends = 0
        self.stall_from = stall_from
        self.stalled_at: float | None = None
        self.paused_at = 0.0  # when the last round began (its pause)
        self.last_received: dict[str, torch.Tensor] = {}
        self._never = threading.Event()

    def init_weight_transfer(self) -> None:
        self.calls.append("init_weight_transfer")

    def pause(self) -> None:
        self.calls.append("pause")
        self.paused_at = time.monotonic()
        self.generator.lock.acquire()

    def send_weights(self, iterator) -> None:
        self.calls.append("send_weights")
        if self.stall_from is not None and self.sends >= self.stall_from:
            self.stalled_at = time.monotonic()
            self._never.wait()
        params = dict(self.generator.model.named_parameters())
        received = {}
        with torch.no_grad():
            for name, tensor in iterator:
                params[name].copy_(tensor)
                received[name] = tensor.detach().clone()
        self.last_received = received
        self.sends += 1

    def resume(self) -> None:
        self.calls.append("resume")
        self.generator.lock.release()

    def destroy(self) -> None:
        self.calls.append("destroy")


class ThreadRolloutWorker:
    """``RolloutWorkerProtocol``: a thread sampling groups of ``num_generations`` from the local generator."""

    def __init__(self, generator: LocalGenerator, num_generations: int = 4, length: int = 8, seed: int = 0) -> None:
        self.generator, self.num_generations, self.length = generator, num_generations, length
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=16)
        self.metrics_queue: queue.Queue = queue.Queue()
        self.versions: list[int] = []
        self.version = 0
        self.started = self.stopped = 0
        self.heartbeat = time.time()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gen = torch.Generator().manual_seed(seed)

    def start(self) -> None:
        self.started += 1
        self._thread = threading.Thread(target=self._run, name="user-rollout-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.stopped += 1
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def update_model_version(self, model_version: int) -> None:
        self.versions.append(model_version)
        self.version = model_version

    def check_health(self, stale_after_s: float) -> None:
        if self.error is not None:
            raise RuntimeError(f"the user rollout worker failed: {self.error!r}") from self.error
        if time.time() - self.heartbeat > stale_after_s:
            raise RuntimeError(f"the user rollout worker is hung (no heartbeat for {stale_after_s:.0f}s)")

    def _run(self) -> None:
        try:
            group = 0
            while not self._stop.is_set():
                self.heartbeat = time.time()
                self._one_group(group)
                group += 1
        except BaseException as exc:  # noqa: BLE001 - check_health reports it to the trainer
            self.error = exc

    def _one_group(self, group: int) -> None:
        prompt = torch.randint(5, 1000, (6,), generator=self._gen).tolist()
        t0 = time.perf_counter()
        while not self.generator.lock.acquire(timeout=0.1):  # held while weights are swapped in
            if self._stop.is_set():
                return
        try:
            version = self.version
            ids, logprobs = self.generator.sample(prompt, self.num_generations, self.length, self._gen)
        finally:
            self.generator.lock.release()
        completions = ids[:, len(prompt) :]
        rewards = (completions % 2 == 0).float().mean(dim=1)
        advantages = rewards - rewards.mean()
        self.metrics_queue.put({"rollout/user_generate_s": time.perf_counter() - t0,
                                "rollout/user_even_frac": (float(rewards.sum()), float(len(rewards)))})  # fmt: skip
        n_prompt = len(prompt)
        for row, lp, adv in zip(ids, logprobs, advantages):
            sample = Sample(
                prompt=[{"role": "user", "content": "numbers"}],
                completion=[{"role": "assistant", "content": ""}],
                input_ids=row.numpy(),
                completion_mask=np.r_[np.zeros(n_prompt), np.ones(self.length)].astype(np.int64),
                old_log_probs=np.r_[np.zeros(n_prompt), lp.numpy()],
                advantage=float(adv),
                model_version=version,
                group_id=group,
                enqueued_at=time.time(),
            )
            while not self._stop.is_set():
                try:
                    self.rollout_buffer.put(sample, timeout=0.1)
                    break
                except queue.Full:
                    continue
