"""CUDA graphs over the decoder for small packed rows: a ~1,000-token step without thousands of kernel launches.

Why: at a 135 M model and ~900 forwarded tokens an H200 spends ~19 ms of kernels on the step's forward and
backward, while the step took 116-162 ms with compiled layers: ~2,700 launches, ~850 matmul dispatches and 60
dynamo guard checks a step, all on the CPU (bench/LOG.md, issue 41). Replaying the decoder's forward as one CUDA
graph, and its backward as another, leaves the CPU a few copies and two launches.

How:

- Rows are padded up to a bucket (a quarter, half, three quarters or all of ``token_budget``, in whole
  FlexAttention blocks). A pad token attends only to itself and no real token attends to it, so the real tokens'
  hidden states are those of the unpadded row and the pads get no gradient.
- The tree's block mask is built inside the graph from the row's ``subtree_end``: a step copies three [bucket]
  integer buffers in and replays.
- Per bucket: one eager pass on a side stream (compiles, lazy initialisations), then a capture of the forward and
  one of the backward (gradients w.r.t. the decoder's parameters) in one memory pool for all buckets; rows run one
  after another, so two buckets' graphs never hold live data at once. The first capture's eager pass runs the
  check's row (below), so that pass is also the check's reference: no second eager pass on the step's path.
- Captured without activation checkpointing: the graph keeps the bucket's activations, which the size rule
  (:func:`wants_graphed_step`) keeps to a few GB.
- Captured only where no autograd graph over the parameters is alive (the start of a step, before its forward):
  one that is alive keeps AccumulateGrad nodes of the default stream, and the capture fails on their sync.
- Checked at the first capture: the graphed hidden states and parameter gradients against the eager decoder's on
  a real row. A mismatch or a capture error turns the graphs off with one warning and the step runs eager.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from asyncgrpo.packing.attention import FLEX_BLOCK, TreeAttentionPlan, dense_tree_mask, flex_block_mask
from asyncgrpo.packing.deltanet import needs_linear_plan
from asyncgrpo.packing.row import PackedRow
from asyncgrpo.trainer.packed_forward import PackedForward, autocast_dtype
from asyncgrpo.triton_support import have_triton
from asyncgrpo.weights.policy import is_peft_model

logger = logging.getLogger(__name__)

# token_budget x parameters up to which the graphs are on by default (135 M x 4k tokens, 1.7 B x 2k): the steps
# whose launches cost more than their kernels, and whose activations (held by the graph) stay a few GB
AUTO_TOKEN_PARAMS = 4e12
VERIFY_RTOL = 3e-2  # bf16 hidden states and gradients, graphed vs eager: the same kernels, so far below this


def wants_graphed_step(args: Any, model: torch.nn.Module, peft: bool, router_replay: Any, router_aux: bool,
                       token_budget: int) -> bool:  # fmt: skip
    """``cuda_graph_step`` as set, or when None: one CUDA process with Triton, no adapter, no MoE routing replay or
    router loss, no linear-attention layers, and ``token_budget`` x parameters <= ``AUTO_TOKEN_PARAMS``."""
    setting = args.cuda_graph_step
    if setting is False:
        return False
    blockers = []
    if torch.device(args.device).type != "cuda" or not have_triton():
        blockers.append("a CUDA device with Triton")
    if args.world_size != 1:
        blockers.append("one training process")
    if peft or router_replay is not None or router_aux:
        blockers.append("no PEFT adapter, routing replay or router loss")
    if needs_linear_plan(model):
        blockers.append("no linear-attention (DeltaNet) layers")
    if setting is None:
        params = sum(p.numel() for p in model.parameters())
        return not blockers and token_budget * params <= AUTO_TOKEN_PARAMS
    if blockers:
        raise ValueError(f"cuda_graph_step=True needs {', '.join(blockers)}; set cuda_graph_step=None or False")
    return True


def step_graphs(trainer: Any, token_budget: int) -> GraphedDecoder | None:
    """The trainer's graphed decoder, made on the first call where :func:`wants_graphed_step` says so (and grown to
    a larger ``token_budget`` on later calls); None where the step runs eager."""
    graphs = trainer.graphed
    if graphs is None and not trainer.graphs_decided:
        trainer.graphs_decided = True
        if _trainer_wants(trainer, token_budget):
            graphs = trainer.graphed = GraphedDecoder(trainer._causal_lm(), token_budget, autocast_dtype(trainer))
    elif graphs is not None:
        graphs.extend(token_budget)
    return graphs


def check_graph_setting(trainer: Any) -> None:
    """``cuda_graph_step=True`` on a set-up it cannot run on raises here, at the trainer's construction (the size
    rule does not apply to True, so the budget does not matter)."""
    if trainer.args.cuda_graph_step is True:
        _trainer_wants(trainer, token_budget=1)


def _trainer_wants(trainer: Any, token_budget: int) -> bool:
    """:func:`wants_graphed_step` for an ``AsyncGRPOTrainer``'s model and settings."""
    return wants_graphed_step(trainer.args, trainer._causal_lm(), is_peft_model(trainer.model),
                              trainer.router_replay, trainer.router_aux_coef > 0, token_budget)  # fmt: skip


def graph_buckets(token_budget: int) -> list[int]:
    """Row sizes the graphs are captured for: quarters of ``token_budget`` in whole 128-token blocks."""
    sizes = {-(-max(1, token_budget * k // 4) // FLEX_BLOCK) * FLEX_BLOCK for k in (1, 2, 3, 4)}
    return sorted(sizes)


@dataclass
class _Bucket:
    """One row size's graphs and the static tensors they read and write."""

    size: int
    ids: torch.Tensor  # [size] token ids (pads: 0)
    pos: torch.Tensor  # [size] positions (pads: 0)
    end: torch.Tensor  # [size] subtree ends (pad k: k + 1, itself only)
    pad_end: torch.Tensor
    out: torch.Tensor | None = None  # [size, hidden] the decoder's output
    grad_out: torch.Tensor | None = None
    grads: tuple[torch.Tensor | None, ...] = ()
    fwd: Any = None
    bwd: Any = None

    @classmethod
    def empty(cls, size: int, device: torch.device) -> _Bucket:
        """Static inputs of ``size`` pads (each its own one-token tree)."""
        end = torch.arange(1, size + 1, device=device)
        return cls(size, torch.zeros_like(end), torch.zeros_like(end), end.clone(), end)

    def load(self, row: PackedRow) -> None:
        """Copy ``row`` into the static inputs, pads after it."""
        n = row.num_tokens
        self.ids[:n].copy_(row.input_ids, non_blocking=True)
        self.pos[:n].copy_(row.position_ids, non_blocking=True)
        self.end[:n].copy_(row.subtree_end, non_blocking=True)
        if n < self.size:
            self.ids[n:].zero_()
            self.pos[n:].zero_()
            self.end[n:].copy_(self.pad_end[n:])


@dataclass
class _Reference:
    """The eager side of the check (:meth:`GraphedDecoder._compare`) on one row."""

    hidden: torch.Tensor  # [T, hidden] fp32
    grads: tuple[torch.Tensor | None, ...]  # of (hidden * weights).sum() w.r.t. the decoder's trained parameters
    weights: torch.Tensor  # [T, hidden] the fixed random projection


class GraphedDecoder:
    """The decoder of ``lm`` as CUDA graphs, one per bucket; :meth:`forward` stands in for ``packed_forward``."""

    def __init__(self, lm: torch.nn.Module, token_budget: int, autocast_dtype: torch.dtype | None) -> None:
        self.lm, self.decoder = lm, lm.get_decoder()
        self.params: tuple[torch.Tensor, ...] = ()  # the decoder's trained parameters, taken at the first capture
        self._addresses: tuple[int, ...] = ()  # where all its parameters were then
        self.autocast_dtype = autocast_dtype
        self.backend = "flex"  # the tree-attention kernel inside the graphs
        self.sizes = graph_buckets(token_budget)
        self.buckets: dict[int, _Bucket] = {}
        self.pool: Any = None
        self.failed: str | None = None
        self.verified = False
        self._reference: tuple[PackedRow, _Reference] | None = None  # the check's eager side, from a capture's pass

    # ------------------------------------------------------------------ public
    def extend(self, token_budget: int) -> None:
        """Add the buckets of a larger ``token_budget`` (the server's max_model_len, known after the warm-up)."""
        self.sizes = sorted(set(self.sizes) | set(graph_buckets(token_budget)))

    def covers(self, row: PackedRow) -> bool:
        """Whether ``row`` runs graphed: graphs on, a bucket fits it, gradients on."""
        return self.failed is None and row.num_tokens <= self.sizes[-1] and torch.is_grad_enabled()

    def capture_all(self, verify_row: PackedRow | None = None, until: Callable[[], bool] | None = None,
                    at_least_one: bool = True) -> float:  # fmt: skip
        """Capture every bucket not yet captured, largest first, and check the first capture against
        ``verify_row``; seconds spent. Largest first: rows are packed up to ``token_budget``, so most steps replay
        the largest bucket, and a step whose bucket is missing captures it at its first use.

        ``until``: asked before each capture (from the second on when ``at_least_one``); True leaves the other
        buckets for a later call."""
        t0 = time.perf_counter()
        todo = sorted((s for s in self.sizes if s not in self.buckets), reverse=True)
        done: list[int] = []
        for size in todo:
            if self.failed is not None or (until is not None and (done or not at_least_one) and until()):
                break
            self._capture_or_fail(size, reference=verify_row if not self.verified else None)
            done.append(size)
            self._verify_once(verify_row)  # at once: a graph that disagrees is not captured five times
        self._verify_once(verify_row)  # nothing captured by this call, but earlier captures left unchecked
        seconds = time.perf_counter() - t0
        if done and self.failed is None:
            left = len(self.missing())
            logger.info("captured CUDA graphs of the decoder for rows of %s tokens in %.1f s (cuda_graph_step)%s",
                        "/".join(map(str, done)), seconds, f"; {left} bucket(s) left for later" if left else "")  # fmt: skip
        return seconds

    def capture_largest(self, verify_row: PackedRow | None = None) -> float:
        """The largest bucket only (the one full rows replay), checked against ``verify_row``; seconds spent."""
        if self.sizes[-1] in self.buckets:
            self._verify_once(verify_row)
            return 0.0
        return self.capture_all(verify_row=verify_row, until=lambda: True)

    def missing(self) -> list[int]:
        """Buckets not captured yet (none once the graphs are off)."""
        return [] if self.failed is not None else [s for s in self.sizes if s not in self.buckets]

    def complete(self) -> bool:
        """Every bucket captured and checked, or the graphs off: nothing left for :meth:`capture_all`."""
        return self.failed is not None or (self.verified and not self.missing())

    def forward(self, row: PackedRow) -> PackedForward | None:
        """The row's final hidden states from the bucket's graph (captured now if it is the first such row);
        None when that capture fails (the graphs are off then: the caller runs the eager step)."""
        size = self._size_for(row)
        if self.buckets and self._param_addresses() != self._addresses:
            raise RuntimeError(
                "a decoder parameter was replaced after its CUDA graph was captured (graphs read parameters in "
                "place; a .to(), a new state dict assigned instead of copied...): set cuda_graph_step=False"
            )
        bucket = self.buckets.get(size)
        if bucket is None:  # a bucket the warm-up did not capture (no warm-up, or a larger token_budget)
            t0 = time.perf_counter()
            self._capture_or_fail(size)
            bucket = self.buckets.get(size)
            if bucket is None:
                return None
            logger.info("captured the %d-token CUDA graph of the decoder at first use (%.2f s)", size,
                        time.perf_counter() - t0)  # fmt: skip
        full = _Replay.apply(bucket, row, *self.params)
        hidden = full[: row.num_tokens]
        weight = self.lm.get_output_embeddings().weight
        return PackedForward(hidden, weight, 0.0 * hidden.sum())

    # ------------------------------------------------------------------ capture
    def _capture_or_fail(self, size: int, reference: PackedRow | None = None) -> None:
        try:
            self._capture(size, reference)
        except Exception as exc:  # noqa: BLE001 - any capture failure: the step runs eager, the run goes on
            self._fail(f"capturing the {size}-token graph failed: {type(exc).__name__}: {str(exc)[:300]}")

    def _capture(self, size: int, reference: PackedRow | None = None) -> _Bucket:
        """Capture ``size``'s graphs. ``reference``: the check's row; where it falls in this bucket, the eager pass
        before the capture runs it and keeps its result for :meth:`_compare` (the pass a capture needs anyway)."""
        # train mode, as the steps that replay it run (dropout, and the compiled layers guard on it: a capture before
        # train() in eval mode compiled them once for it and again for the first step, 10 s on a cold cache)
        self.lm.train()
        if not self.buckets:  # the first graph: the parameters as they are now (a .to() before it is fine)
            self.params = tuple(p for p in self.decoder.parameters() if p.requires_grad)
            self._addresses = self._param_addresses()
        dev = self.params[0].device
        b = _Bucket.empty(size, dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # an eager pass first: compiles and lazy CUDA work stay out of the capture
            if reference is not None and self._size_for(reference) == size:
                self._reference = (reference, self._eager_reference(reference, size))
            else:
                with self._capturable():
                    out = self._decoder_out(b.ids, b.pos, b.end)
                torch.autograd.grad(out, self.params, torch.ones_like(out), allow_unused=True)
                del out
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        b.fwd, b.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (a weight sync, a metrics copy) does not void the capture
        with self._capturable(), torch.cuda.graph(b.fwd, pool=self.pool, capture_error_mode="thread_local"):
            b.out = self._decoder_out(b.ids, b.pos, b.end)
        b.grad_out = torch.zeros_like(b.out)
        with torch.cuda.graph(b.bwd, pool=self.pool, capture_error_mode="thread_local"):
            b.grads = torch.autograd.grad(b.out, self.params, b.grad_out, allow_unused=True)
        # drop the captured autograd graph: it would keep the parameters' gradient-accumulation nodes of the
        # capture stream alive, and every later backward would then sync with that stream
        b.out = b.out.detach()
        self.buckets[size] = b
        return b

    def _decoder_out(self, ids: torch.Tensor, pos: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """The decoder on a padded row; the tree's block mask is built here, so inside the graph. The mask goes
        in as ``attention_mask`` too: transformers returns a 4-D mask as it is instead of probing the positions
        for packed sequences (a host sync, which a capture refuses)."""
        if self.backend == "flex":
            plan = TreeAttentionPlan("flex", ids.numel(), block_mask=flex_block_mask(end))
            mask = plan.block_mask
        else:  # "sdpa": the same row through the dense mask (CPU tests of the padding)
            plan = TreeAttentionPlan("sdpa", ids.numel(), dense_mask=dense_tree_mask(end))
            mask = plan.dense_mask[None, None]
        out = self.decoder(input_ids=ids[None], position_ids=pos[None], attention_mask=mask, use_cache=False,
                           tree_plan=plan)  # fmt: skip
        return out.last_hidden_state[0]

    @contextlib.contextmanager
    def _capturable(self) -> Iterator[None]:
        """Autocast as the trainer's forward runs it, without its weight cache (a capture cannot hold it), and
        activation checkpointing off (the graph keeps the activations; a recompute would double the kernels)."""
        checkpointed = [m for m in self.decoder.modules() if getattr(m, "gradient_checkpointing", False) is True]
        for m in checkpointed:
            m.gradient_checkpointing = False
        amp = self.autocast_dtype is not None
        try:
            with torch.autocast("cuda", dtype=self.autocast_dtype or torch.bfloat16, enabled=amp, cache_enabled=False):
                yield
        finally:
            for m in checkpointed:
                m.gradient_checkpointing = True

    # ------------------------------------------------------------------ checks
    def _verify_once(self, row: PackedRow | None) -> None:
        """The check on ``row``, where there is a row, a captured graph, and no verdict yet."""
        if row is not None and not self.verified and self.failed is None and self.buckets:
            self._verify_or_fail(row)

    def _verify_or_fail(self, row: PackedRow) -> None:
        try:
            problem = self._compare(row)
        except Exception as exc:  # noqa: BLE001 - as for a capture
            problem = f"{type(exc).__name__}: {str(exc)[:300]}"
        if problem:
            self._fail(f"the graphed decoder disagrees with the eager one ({problem})")
        self.verified = True

    def _compare(self, row: PackedRow) -> str | None:
        """Hidden states and parameter gradients of a fixed projection loss, eager vs graphed; a problem or None.

        The eager side runs the same padded row outside the graph (the capture's own eager pass where it ran this
        row; the capture itself saw pads only): this checks the capture (a kernel that reads memory the graph does
        not own, a host value frozen into it). That padding leaves the real tokens alone is a property of the mask,
        tested on its own; an unpadded eager row here would also recompile the layers for a length that no graphed
        step meets."""
        size = self._size_for(row)
        if size not in self.buckets:  # captured first, its eager pass on this row: a capture while an eager autograd
            self._capture_or_fail(size, reference=row)  # graph is alive fails (AccumulateGrad syncs the default stream)
            if size not in self.buckets:
                return "its capture failed"
        kept, self._reference = self._reference, None
        ref = kept[1] if kept is not None and kept[0] is row else self._eager_reference(row, size)
        got = self.forward(row)
        if got is None:
            return "its capture failed"
        graphed = got.hidden
        checks = [("hidden states", ref.hidden, graphed.float())]
        grads_g = torch.autograd.grad((graphed.float() * ref.weights).sum(), self.params, allow_unused=True)
        pairs = [(e, g) for e, g in zip(ref.grads, grads_g, strict=True) if e is not None and g is not None]
        flat = [torch.cat([t.float().flatten() for t in side]) for side in zip(*pairs, strict=True)]
        checks.append(("parameter gradients", flat[0], flat[1]))
        for name, want, have in checks:
            err = float((have - want).detach().norm() / want.detach().norm().clamp(min=1e-12))
            if not err <= VERIFY_RTOL:
                return f"{name}: relative error {err:.2e} > {VERIFY_RTOL:.0e}"
        return None

    def _eager_reference(self, row: PackedRow, size: int) -> _Reference:
        """The eager decoder on ``row`` padded to ``size``: its hidden states and the parameter gradients of a fixed
        random projection of them (no autograd graph is left alive: a capture may follow)."""
        dev = row.input_ids.device
        gen = torch.Generator(device=dev).manual_seed(0)
        weights = torch.randn(row.num_tokens, self.lm.config.get_text_config().hidden_size, generator=gen, device=dev)
        padded = _Bucket.empty(size, dev)
        padded.load(row)
        with self._capturable():
            eager = self._decoder_out(padded.ids, padded.pos, padded.end)[: row.num_tokens].float()
        grads = torch.autograd.grad((eager * weights).sum(), self.params, allow_unused=True)
        return _Reference(eager.detach(), grads, weights)

    def _fail(self, why: str) -> None:
        self.failed = why
        self.buckets.clear()
        self._reference = None
        logger.warning("CUDA graphs of the training step are off: %s; the step runs eager. Set cuda_graph_step=False "
                       "to skip the attempt.", why)  # fmt: skip

    def _size_for(self, row: PackedRow) -> int:
        """The smallest bucket that holds ``row``."""
        return next(s for s in self.sizes if s >= max(row.num_tokens, 1))

    def _param_addresses(self) -> tuple[int, ...]:
        """Where the decoder's parameters live now (the module's, not our list: a replaced one shows here)."""
        return tuple(p.data_ptr() for p in self.decoder.parameters())


class _Replay(torch.autograd.Function):
    """Forward: load the row, replay the forward graph. Backward: replay the backward graph."""

    @staticmethod
    def forward(ctx, bucket: _Bucket, row: PackedRow, *params: torch.Tensor) -> torch.Tensor:
        bucket.load(row)
        bucket.fwd.replay()
        ctx.bucket = bucket
        return bucket.out.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        b = ctx.bucket
        b.grad_out.copy_(grad)
        b.bwd.replay()
        # new tensors (one multi-tensor launch): AccumulateGrad may keep what it gets as .grad, and the graph
        # overwrites its own outputs at the next replay
        live = [g for g in b.grads if g is not None]
        fresh = iter(torch._foreach_mul(live, 1.0)) if live else iter(())
        return (None, None, *(next(fresh) if g is not None else None for g in b.grads))
