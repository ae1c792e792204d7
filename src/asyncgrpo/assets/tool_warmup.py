"""Supervised warm-up on tool-call transcripts: teach a model the ``<tool_call>`` format before RL.

A model that never emits a tool call gets no learning signal from an agent environment. A few steps of
supervised training on synthetic transcripts (user -> assistant call -> tool result -> assistant answer) fixes
that. Each transcript is turned into training samples exactly as a rollout would be: every assistant message is
one sampling turn whose prompt is the chat template's render of the conversation so far, and
``rollout_to_sequences`` joins the turns (tool results and template glue are context, never trained).
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from asyncgrpo.files import local_only, make_readable
from asyncgrpo.rollout.agents.tool_loop import schemas_of
from asyncgrpo.rollout.reconcile import rollout_to_sequences
from asyncgrpo.types import Rollout, TrainingSequence, TurnRecord

logger = logging.getLogger(__name__)

WARMUP_REPORT = "tool_warmup.json"  # written beside the warmed-up model

__all__ = ["Transcript", "calls_reproduced", "supervised_tool_warmup", "transcript_sequences", "warm_up_tool_calls"]


@dataclass
class Transcript:
    """One conversation to imitate: ``messages`` (user/assistant/tool, system optional) and the tools shown."""

    messages: list[dict[str, Any]]
    tools: Sequence[Callable[..., Any]] = field(default_factory=list)
    chat_template: str | None = None  # render with this template instead of the tokenizer's


def _ids(encoded: Any) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def transcript_sequences(
    tokenizer: Any, transcript: Transcript, template_kwargs: dict[str, Any] | None = None
) -> list[TrainingSequence]:
    """The training samples of one transcript (assistant tokens + end-of-turn token trained, the rest context)."""
    kwargs = dict(template_kwargs or {})
    schemas = schemas_of(list(transcript.tools)) or None
    if transcript.chat_template is not None:
        kwargs["chat_template"] = transcript.chat_template
    eos = tokenizer.eos_token_id
    turns = []
    for i, message in enumerate(transcript.messages):
        if message["role"] != "assistant":
            continue
        prompt = _ids(
            tokenizer.apply_chat_template(
                transcript.messages[:i], tools=schemas, add_generation_prompt=True, tokenize=True, **kwargs
            )
        )
        out = tokenizer.encode(message["content"], add_special_tokens=False) + [eos]
        turns.append(TurnRecord(prompt_ids=prompt, output_ids=out, output_log_probs=[0.0] * len(out)))
    rollout = Rollout(completion=[], completion_ids=[], turns=turns)
    return rollout_to_sequences(rollout, group_id=0, row_index=0, model_version=0, num_sampler_logprobs=None)


def supervised_tool_warmup(
    model: Any,
    tokenizer: Any,
    transcripts: Sequence[Transcript],
    *,
    steps: int,
    lr: float = 1e-3,
    batch_size: int = 16,
    template_kwargs: dict[str, Any] | None = None,
    negatives: int | None = None,
    seed: int = 0,
    on_step: Callable[[int, int, float], None] | None = None,
) -> list[float]:
    """Train ``model`` in place to continue each transcript's assistant turns; returns the loss per step.

    Args:
        batch_size: transcripts' samples per step, packed into one row (shared prompts forwarded once).
        negatives: compute the softmax over the batch's target tokens plus this many random vocabulary tokens
            instead of the whole vocabulary (a large speed-up for tiny models on CPU); None: the whole vocabulary.
        on_step: called after each step with (step, steps, loss): ``warm_up_tool_calls`` prints progress with it.
    """
    import torch

    seqs = [s for t in transcripts for s in transcript_sequences(tokenizer, t, template_kwargs)]
    if not seqs:
        raise ValueError("no assistant message in the transcripts: nothing to train")
    from asyncgrpo.packing import build_plan, packed_hidden_states, use_tree_attention
    from asyncgrpo.packing.row import pack_samples
    from asyncgrpo.packing.sample import PackSample

    rng = random.Random(seed)
    device = next(model.parameters()).device
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    previous_attn = model.config._attn_implementation
    use_tree_attention(model)  # one packed row per step: transcripts sharing a prompt forward it once
    losses = []
    model.train()
    for step in range(steps):
        batch = seqs if batch_size >= len(seqs) else rng.sample(seqs, batch_size)
        row = pack_samples([PackSample.from_sequence(s) for s in batch]).to(device)
        h = packed_hidden_states(model, row, build_plan(row, device=device))[row.pred_index]
        targets = row.target_ids
        if negatives is None:
            logits, labels = head(h), targets
        else:
            cand = torch.unique(torch.cat([targets, torch.randint(0, vocab, (negatives,), device=device)]))
            logits = h @ head.weight[cand].T
            if head.bias is not None:
                logits = logits + head.bias[cand]
            labels = torch.searchsorted(cand, targets)
        loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == steps - 1:
            logger.info("tool warm-up step %d/%d: loss %.4f", step + 1, steps, losses[-1])
        if on_step is not None:
            on_step(step + 1, steps, losses[-1])
    model.set_attn_implementation(previous_attn)
    model.eval()
    return losses


def calls_reproduced(model: Any, tokenizer: Any, transcripts: Sequence[Transcript], max_new_tokens: int = 64) -> int:
    """How many transcripts' first assistant turn the model now writes as the same tool calls (greedy, in process).

    The check a warm-up needs before RL: a model that still writes no call gives the RL run no signal.
    """
    import torch

    from asyncgrpo.rollout.agents import parse_tool_calls

    device = next(model.parameters()).device
    hits = 0
    for t in transcripts:
        first = next(i for i, m in enumerate(t.messages) if m["role"] == "assistant")
        want = [(c.name, c.arguments) for c in parse_tool_calls(t.messages[first]["content"])]
        ids = _ids(tokenizer.apply_chat_template(t.messages[:first], tools=schemas_of(list(t.tools)) or None,
                                                 add_generation_prompt=True, tokenize=True))  # fmt: skip
        with torch.no_grad():
            out = model.generate(torch.tensor([ids], device=device), max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)  # fmt: skip
        text = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
        hits += [(c.name, c.arguments) for c in parse_tool_calls(text)] == want
    return hits


class WarmupProgress:
    """The warm-up's lines on stdout (a script's user sees them without configuring logging, as with the
    trainer's ``compact_log``): one per phase, a step line at most every ``STEP_LINE_S``, and a "still ..." line
    when ``HEARTBEAT_S`` pass without one (a slow step on 2 CPU cores takes several seconds)."""

    STEP_LINE_S = 10.0
    HEARTBEAT_S = 30.0

    def __init__(self, write: Callable[[str], None] | None = None) -> None:
        self.write = write or (lambda text: print(text, flush=True))
        self.t0 = self.last = time.monotonic()
        self.phase = "starting"
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="asyncgrpo-warmup-progress", daemon=True)

    def say(self, text: str, phase: str | None = None) -> None:
        with self._lock:
            self.phase = phase or self.phase
            self.last = time.monotonic()
            self.write(f"tool warm-up: {text} ({self.last - self.t0:.0f} s)")

    def step(self, step: int, steps: int, loss: float) -> None:
        if step in (1, steps) or time.monotonic() - self.last >= self.STEP_LINE_S:
            self.say(f"step {step}/{steps}, loss {loss:.3f}")

    def _beat(self) -> None:
        while not self._done.wait(min(1.0, self.HEARTBEAT_S / 4)):
            if time.monotonic() - self.last >= self.HEARTBEAT_S:
                self.say(f"still {self.phase}")

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5)


def warm_up_tool_calls(
    model_dir: str,
    transcripts: Sequence[Transcript],
    out_dir: str,
    *,
    steps: int = 20,
    lr: float = 5e-5,
    progress: Callable[[str], None] | None = None,
) -> str:
    """Load ``model_dir``, imitate the transcripts' calls for ``steps`` steps, check, save to ``out_dir``.

    The tokenizer gets the training template the trainer uses with tools (``prepare_tool_template``), so the
    warm-up and the RL run render conversations alike. Logs how many transcripts the model now reproduces and
    warns when none: RL would then find no signal; ``out_dir/tool_warmup.json`` keeps that count and the losses.
    It prints what it does (``progress``: where the lines go instead of stdout), at least every 30 s: on 2 CPU
    cores the demo model's 20 steps take about a minute. Returns ``out_dir`` (pass it to ``AsyncGRPOTrainer``).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncgrpo.rollout.agents import prepare_tool_template

    with WarmupProgress(progress) as shown:
        shown.say(f"loading {model_dir}", "loading the model")
        tokenizer = AutoTokenizer.from_pretrained(model_dir, **local_only(model_dir))
        prepare_tool_template(tokenizer)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        shown.say(f"{steps} supervised steps on {len(transcripts)} transcripts, lr {lr:g}", "training")
        losses = supervised_tool_warmup(model, tokenizer, transcripts, steps=steps, lr=lr,
                                        batch_size=len(transcripts), on_step=shown.step)  # fmt: skip
        shown.say(f"checking that the model writes the {len(transcripts)} transcripts' calls (greedy)", "checking")
        hits = calls_reproduced(model, tokenizer, transcripts)
        log = logger.info if hits else logger.warning
        log("tool warm-up: the model reproduces the calls of %d of %d transcripts (greedy)%s", hits,
            len(transcripts), "" if hits else "; RL will find no signal: raise steps or lr")  # fmt: skip
        shown.say(f"the model writes the calls of {hits} of {len(transcripts)} transcripts; saving to {out_dir}",
                  "saving")  # fmt: skip
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        report = {"reproduced": hits, "transcripts": len(transcripts), "steps": steps, "lr": lr, "loss": losses}
        Path(out_dir, WARMUP_REPORT).write_text(json.dumps(report, indent=1))
        make_readable(out_dir)
        shown.say("done")
    return out_dir
