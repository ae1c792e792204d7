"""Supervised warm-up on tool-call transcripts: teach a model the ``<tool_call>`` format before RL.

A model that never emits a tool call gets no learning signal from an agent environment. A few steps of
supervised training on synthetic transcripts (user -> assistant call -> tool result -> assistant answer) fixes
that. Each transcript is turned into training samples exactly as a rollout would be: every assistant message is
one sampling turn whose prompt is the chat template's render of the conversation so far, and
``rollout_to_sequences`` joins the turns (tool results and template glue are context, never trained).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncgrpo.rollout.agents.tool_loop import schemas_of
from asyncgrpo.rollout.reconcile import rollout_to_sequences
from asyncgrpo.types import Rollout, TrainingSequence, TurnRecord

logger = logging.getLogger(__name__)

__all__ = ["Transcript", "supervised_tool_warmup", "transcript_sequences"]


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
) -> list[float]:
    """Train ``model`` in place to continue each transcript's assistant turns; returns the loss per step.

    Args:
        batch_size: transcripts' samples per step, packed into one row (shared prompts forwarded once).
        negatives: compute the softmax over the batch's target tokens plus this many random vocabulary tokens
            instead of the whole vocabulary (a large speed-up for tiny models on CPU); None: the whole vocabulary.
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
    model.set_attn_implementation(previous_attn)
    model.eval()
    return losses
