"""Compile the training step's kernels while the first groups are generated, not inside step 1.

On CUDA the packed step runs compiled code: FlexAttention's kernels, the fused LM-head loss kernels and, with
``compile_decoder_layers``, the decoder layers. Each compiles (or loads from the compile cache) at its first
call, and again when a size it specialised on changes. In a run that cost arrived inside steps 1 and 2
(7-12 s on an H200 at a 135 M model), while the trainer had nothing else to do but wait for the worker's
first groups. So the trainer runs the step's forward and backward on two dummy rows of the run's shapes right
after it starts the rollout worker: two lengths, so a size that turns dynamic on its second value does so
here. The gradients are dropped; the optimizer, the scheduler and the weights are not touched.

Only where it pays and is safe: a CUDA device, one process (every rank of a sharded run would have to warm up
in lock step), no MoE routing replay (its rows carry the sampler's routing). ``asyncgrpo train`` warms up even
earlier, while its embedded server starts (``AsyncGRPOTrainer.warm_up_compile``), unless gradient checkpointing
is on (the Trainer turns it on inside ``train()``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from asyncgrpo.packing import PackSample, pack_samples
from asyncgrpo.packing.row import PackedRow
from asyncgrpo.trainer.graphed_step import step_graphs

logger = logging.getLogger(__name__)

PROMPT_TOKENS = 64  # a typical chat prompt; the row's length is what matters, not the split
WARMUP_BUDGET = 2048  # rows before train() when token_budget is None (the server's max_model_len, not known yet)


def warmup_rows(token_budget: int, num_generations: int, max_completion_length: int, vocab_size: int,
                top_n: int) -> list[PackedRow]:  # fmt: skip
    """Two rows shaped like the run's, of about half and all of ``token_budget`` tokens: groups of one prompt and
    G trained completions (sampler top-N where score centering asks for it), packed as the batcher packs them, as
    many groups as fit. Whole rows matter: their lengths pick the CUDA graph buckets and compiled sizes the warm-up
    prepares, and short completions (``max_completion_length`` 40) would otherwise leave both rows in a small
    bucket that no real step uses."""
    rng = np.random.default_rng(0)
    groups = max(num_generations, 1)
    rows = []
    for share in (0.5, 0.95):
        target = max(int(token_budget * share), PROMPT_TOKENS + 2 * groups)
        samples: list[PackSample] = []
        left = target
        while left >= PROMPT_TOKENS + 3 * groups or not samples:  # whole groups, the last one shorter
            # a group's row: the shared prompt, then per completion its tokens and (but for the first) a copy of
            # the prompt's last token that predicts its first one; counted as one per completion here
            per = max(2, min(max_completion_length, (left - PROMPT_TOKENS) // groups - 1))
            samples += _warmup_group(rng, len(samples) // groups, per, groups, vocab_size, top_n)
            left -= PROMPT_TOKENS + groups * (per + 1)
        rows.append(pack_samples(samples))
    return rows


def _warmup_group(rng: np.random.Generator, group_id: int, per: int, size: int, vocab_size: int, top_n: int
                  ) -> list[PackSample]:  # fmt: skip
    """One prompt of ``PROMPT_TOKENS`` and ``size`` random completions of ``per`` trained tokens."""
    prompt = rng.integers(0, vocab_size, PROMPT_TOKENS).tolist()
    mask = [0] * PROMPT_TOKENS + [1] * per
    samples = []
    for _ in range(size):
        completion = rng.integers(0, vocab_size, per).tolist()
        top = lps = None
        if top_n:  # the sampler's top-N ids and their (descending) log-probs, on trained positions
            top = [rng.integers(0, vocab_size, top_n).tolist() if m else [] for m in mask]
            lps = [sorted((-rng.random(top_n) * 4 - 0.1).tolist(), reverse=True) if m else [] for m in mask]
        samples.append(PackSample(prompt + completion, mask, [-1.0 * m for m in mask], float(rng.normal()),
                                  group_id, sampler_topn_ids=top, sampler_topn_logprobs=lps))  # fmt: skip
    return samples


# where a stopped warm-up's rest goes, and why it stopped: before train() / inside it
_STOPPED = {
    True: ("left to train(), beside the first generations", "the generation server serves"),
    False: ("left to step 1", "the first samples wait"),
}


def should_warm_up(trainer: Any) -> bool:
    """CUDA, one process, no routing replay, ``warm_up_compile`` on, and not warmed up yet."""
    args = trainer.args
    return (
        args.warm_up_compile
        and not getattr(trainer, "compile_warmed_up", False)
        and torch.device(args.device).type == "cuda"
        and args.world_size == 1
        and trainer.router_replay is None
    )


def can_warm_up_before_train(trainer: Any) -> bool:
    """Before ``train()`` the model runs as it will inside it, except with gradient checkpointing, which the
    Trainer switches on in ``train()`` (its checkpointed layers could guard differently): then ``train()``
    warms up itself. CUDA graphs of the step (``trainer/graphed_step.py``) are captured without checkpointing
    either way, so with them the warm-up runs before ``train()`` too."""
    if not should_warm_up(trainer):
        return False
    return not trainer.args.gradient_checkpointing or step_graphs(trainer, warmup_budget(trainer)) is not None


def warmup_budget(trainer: Any) -> int:
    """The rows' token budget before ``train()``: the config's, or ``WARMUP_BUDGET`` (the server's max_model_len,
    its default, is not read yet)."""
    return trainer.args.token_budget or WARMUP_BUDGET


def prepare_step(trainer: Any, token_budget: int, until: Callable[[], bool] | None = None) -> None:
    """At ``train()``'s start, while the worker generates the first groups: the compile warm-up if it has not run,
    then the graphs of the real ``token_budget``'s buckets (ones the warm-up before ``train()`` could not know)
    until ``until`` says the first samples wait: step 1 starts then, and :func:`finish_step_graphs` captures the
    rest once it is done (a 135 M model on an H200: ~0.5 s a bucket, which step 1 no longer waits for)."""
    if should_warm_up(trainer):  # stopped once the samples wait: step 1 compiles the rest (the same work, no later)
        warm_up(trainer, token_budget, until=until)
    graphs = step_graphs(trainer, token_budget)
    if graphs is not None:
        graphs.capture_all(until=until, at_least_one=False)
        if left := graphs.missing():
            logger.info("CUDA graphs of %s-token rows left for after step 1 (its samples are ready)",
                        "/".join(map(str, left)))  # fmt: skip


def finish_step_graphs(trainer: Any) -> None:
    """After step 1: capture the buckets :func:`prepare_step` left (so no later step captures one); cheap once done."""
    graphs = getattr(trainer, "graphed", None)
    if graphs is not None and graphs.missing():
        graphs.capture_all()


def warm_up(trainer: Any, token_budget: int, before_train: bool = False, until: Callable[[], bool] | None = None
            ) -> float:  # fmt: skip
    """Run forward+backward of the warm-up rows through ``trainer.step_forward_backward``; returns seconds.

    ``before_train``: the model is not prepared by accelerate yet, so its forward runs under the accelerator's
    autocast, as the prepared model's forward will. ``until``: asked before the warm-up and between its parts (the
    largest bucket's graphs, each row, each other bucket); True stops it there. Before ``train()`` (``asyncgrpo
    train`` passes "the server serves": waiting on the compile then only delays generation) ``train()`` does the
    rest while the worker generates the first groups; inside it (:func:`prepare_step` passes "the first samples
    wait") step 1 does, as it would without warm-up. A failure is logged and ignored: the real step then compiles
    (or fails) as it would have without warm-up.
    """
    args = trainer.args
    stop = until or (lambda: False)
    if stop():
        logger.info("compile warm-up %s (its `until` said stop: %s)", *_STOPPED[before_train])
        return 0.0
    lm = trainer._causal_lm()
    model = trainer.model if before_train else trainer.model_wrapped
    t0 = time.perf_counter()
    top_n = args.num_sampler_logprobs if args.score_centering else 0
    rows = warmup_rows(token_budget, args.num_generations, args.max_completion_length,
                       lm.get_output_embeddings().weight.shape[0], top_n)  # fmt: skip
    # a cold compile runs tens of seconds before anything else is printed: say what the wait is
    logger.info("compiling the training step on two dummy rows of %s tokens (warm_up_compile; a cold compile cache "
                "takes tens of seconds)", "/".join(str(r.num_tokens) for r in rows))  # fmt: skip
    stopped = False
    try:
        graphs = step_graphs(trainer, token_budget)
        if graphs is not None:  # the bucket full rows replay, checked on a real row (the layers compile here)
            graphs.capture_largest(verify_row=rows[-1].to(args.device))
        for row in rows:  # the LM head and loss compile here, and the other row's bucket is captured
            if stop():
                stopped = True
                break
            trainer.step_forward_backward(model, row, float(row.num_trained), keep_metrics=False,
                                          autocast_forward=before_train)  # fmt: skip
        if graphs is not None and not stopped and before_train:  # the other buckets while the server starts
            graphs.capture_all(until=until, at_least_one=False)  # (in train(), prepare_step does that)
    except (RuntimeError, ValueError, TypeError) as exc:  # never lose the run to its warm-up
        logger.warning("the compile warm-up failed (%s: %s); the first steps compile instead", type(exc).__name__, exc)
    finally:
        model.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - t0
    if stopped:  # not warmed up: train() or step 1 finishes it (what is compiled and captured stays)
        logger.info("compile warm-up stopped after %.1f s: %s (its `until` said stop: %s)", seconds,
                    *_STOPPED[before_train])  # fmt: skip
        return seconds
    trainer.compile_warmed_up = True
    logger.info("compiled the training step on two dummy rows (%s tokens) in %.1f s", "/".join(
        str(r.num_tokens) for r in rows), seconds)  # fmt: skip
    return seconds
