"""Check that a warmed-up tool model really reproduces its transcripts, instead of hoping it does.

A fixed number of supervised steps gives a different model on another CPU (other thread counts and
instruction sets round the reductions differently), so a fixture model that wrote every call on one machine
may write a malformed one on the next. ``transcript_mistakes`` finds that before any test runs:

- **greedy, through the tests' own path**: each assistant turn's prompt is rendered with the chat template and
  the transcript's tools, the model decodes greedily, the text is decoded without special tokens and parsed by
  the tool loop's parser. The text must equal one of the transcript turns written for that prompt (a prompt
  with two endings in the data may take either), and its parsed calls must equal that turn's calls.
- **with a margin**: teacher-forced on each written turn, every token the data determines must win by at
  least ``min_margin`` nats over the runner-up, and at a token where the data branches the winner must be one
  of the branches. Greedy decoding on another implementation of the same model (the server's engine, another
  CPU) differs from this one by far less than the margin, so it takes the same tokens; sampling at the tests'
  temperature stays on the written turns too.

Each mistake names the transcript's first user message and the turn, so a failing fixture says what to fix.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncgrpo.assets.tool_warmup import Transcript, supervised_tool_warmup
from asyncgrpo.rollout.agents import parse_tool_calls, schemas_of

MIN_MARGIN_NATS = 2.0  # logit gap between the written token and the runner-up (at temperature 0.5: a 55x odds ratio)


@dataclass
class _Case:
    """One rendered prompt and every assistant turn the transcripts write after it."""

    prompt_ids: list[int]
    labels: list[str] = field(default_factory=list)  # "'<user message>' turn <k>" per written turn
    texts: list[str] = field(default_factory=list)


def _label(transcript: Transcript, turn: int) -> str:
    user = next((m["content"] for m in transcript.messages if m["role"] == "user"), "?")
    return f"{user!r} turn {turn}"


def _ids(encoded: Any) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _cases(tokenizer: Any, transcripts: Sequence[Transcript]) -> list[_Case]:
    by_prompt: dict[tuple[int, ...], _Case] = {}
    for t in transcripts:
        kwargs = {"chat_template": t.chat_template} if t.chat_template is not None else {}
        schemas = schemas_of(list(t.tools)) or None
        turn = 0
        for i, message in enumerate(t.messages):
            if message["role"] != "assistant":
                continue
            turn += 1
            prompt = _ids(tokenizer.apply_chat_template(t.messages[:i], tools=schemas, add_generation_prompt=True,
                                                        tokenize=True, **kwargs))  # fmt: skip
            case = by_prompt.setdefault(tuple(prompt), _Case(prompt))
            if message["content"] not in case.texts:
                case.labels.append(_label(t, turn))
                case.texts.append(message["content"])
    return list(by_prompt.values())


def _calls(text: str) -> str:
    return json.dumps([(c.name, c.arguments, c.error) for c in parse_tool_calls(text)], sort_keys=True)


@torch.no_grad()
def _greedy(model: Any, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def _margin_mistakes(model: Any, case: _Case, targets: list[list[int]], min_margin: float) -> list[str]:
    mistakes = []
    for label, target in zip(case.labels, targets):
        ids = torch.tensor([case.prompt_ids + target])
        logits = model(input_ids=ids).logits[0, len(case.prompt_ids) - 1 : -1].float()
        top2 = logits.topk(2, dim=-1)
        for k, token in enumerate(target):
            allowed = {t[k] for t in targets if len(t) > k and t[:k] == target[:k]}
            best = int(top2.indices[k, 0])
            if best not in allowed:
                mistakes.append(f"{label}: at token {k} of the written turn the model prefers {best}, not {allowed}")
                break
            gap = float(top2.values[k, 0] - top2.values[k, 1])
            if len(allowed) == 1 and gap < min_margin:
                mistakes.append(f"{label}: token {k} of the written turn wins by only {gap:.2f} nats "
                                f"(need {min_margin})")  # fmt: skip
                break
    return mistakes


def transcript_mistakes(
    model: Any, tokenizer: Any, transcripts: Sequence[Transcript], *, min_margin: float = MIN_MARGIN_NATS
) -> list[str]:
    """Every assistant turn of ``transcripts`` the model does not reproduce (empty: it reproduces them all).

    The margins go first (one forward per written turn); a prompt whose turns pass them is then decoded
    greedily and parsed, which also stops after the written turn's length.
    """
    was_training = model.training
    model.eval()
    eos = tokenizer.eos_token_id
    mistakes = []
    try:
        for case in _cases(tokenizer, transcripts):
            targets = [tokenizer.encode(text, add_special_tokens=False) + [eos] for text in case.texts]
            found = _margin_mistakes(model, case, targets, min_margin)
            if not found:
                out = _greedy(model, case.prompt_ids, max(len(t) for t in targets) + 2, eos)
                text = tokenizer.decode(out, skip_special_tokens=True)
                if text not in case.texts:  # the parsed calls say what went wrong in a tool-call turn
                    written = " or ".join(f"{t!r} (calls {_calls(t)})" for t in case.texts)
                    wrote = f"{text!r} (calls {_calls(text)})"
                    found = [f"{case.labels[0]}: greedy decoding wrote {wrote}, the transcripts write {written}"]
            mistakes += found
    finally:
        model.train(was_training)
    return mistakes


def warm_up_until_reproduced(
    model: Any,
    tokenizer: Any,
    transcripts: Sequence[Transcript],
    plan: Sequence[tuple[int, float]],
    *,
    first_check: int,
    batch_size: int,
    negatives: int,
    label: str,
) -> list[str]:
    """Train ``model`` round by round through ``plan`` ((steps, learning rate) each), checking it with
    ``transcript_mistakes`` after round ``first_check`` and every later one; stop at the first clean check.

    Returns the mistakes of the last check (empty: the model reproduces every transcript).
    """
    log = logging.getLogger(__name__)
    mistakes: list[str] = []
    for i, (steps, lr) in enumerate(plan):
        losses = supervised_tool_warmup(model, tokenizer, transcripts, steps=steps, lr=lr, batch_size=batch_size,
                                        negatives=negatives)  # fmt: skip
        log.info("%s warm-up: %d steps at lr %g, loss %.3f -> %.3f", label, steps, lr, losses[0], losses[-1])
        if i < first_check:
            continue
        mistakes = transcript_mistakes(model, tokenizer, transcripts)
        if not mistakes:
            return []
        log.warning("%s warm-up: %d turns not reproduced yet, first: %s", label, len(mistakes), mistakes[0])
    return mistakes
