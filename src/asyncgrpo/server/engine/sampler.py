"""Batched sampling with vLLM's ``--logprobs-mode processed_logprobs`` semantics.

Per row, in order: (a) repetition penalty over prompt + output ids (positive
logits divided by the penalty, negative ones multiplied); (b) ids banned by
``min_tokens`` set to -inf; (c) temperature (greedy rows use 1.0 and skip d-f);
(d) min-p: drop tokens with prob < min_p * max prob; (e) top-k: keep logits >=
the k-th largest; (f) top-p on what is left: sort ascending, drop tokens whose
ascending cumulative probability is <= 1 - top_p, always keeping the most
probable; (g) log-softmax over the survivors = the processed log-probs, which is
exactly the distribution sampled from and reported.

Randomness: the choice is a Gumbel-max / exponential race,
``argmax(logprob - log E)`` with ``E ~ Exp(1)`` per (row, token). Seeded rows
draw ``E`` from a counter-based hash of (seed, output position, token id) -
integer mixing in int64 torch ops - so a seeded request gets the same tokens
whatever else shares its batch, on any device, without per-request generator
state. Unseeded rows use the engine's ``torch.Generator`` (seeded from the
engine's ``seed``).

Fast path (CUDA): when every row only asks for a temperature (no truncation,
penalty, ban or mask), ``layers/sample_kernel.py`` does (c), (g), the race and the
top-N in one read of the logits, with the same seeded noise.

Memory: the batch is one [B, V] fp32 tensor edited in place; row subsets
(top-k/top-p sorts, noise, top-N, masks) are processed in chunks of
:data:`ROW_CHUNK` rows (unseeded noise in chunks of :data:`NOISE_ELEMENTS`), and top-N /
masks only for rows that asked.
"""

from __future__ import annotations

import functools
import logging
import math
from array import array
from dataclasses import dataclass, field

import torch

from asyncgrpo.server.engine.request import SamplingParams
from asyncgrpo.server.layers import sample_kernel

logger = logging.getLogger(__name__)
ROW_CHUNK = 32  # rows per chunk for the [rows, V] temporaries of sorts, hashes, top-N and masks
NOISE_ELEMENTS = 1 << 26  # unseeded noise is drawn for up to this many (row, token) pairs per kernel (256 MB fp32)
_M32 = 0xFFFFFFFF
_NEG_INF = float("-inf")


@dataclass
class SamplerRow:
    """What the sampler needs to know about one sequence at this step."""

    params: SamplingParams
    num_output: int  # tokens generated so far = output position of the token being sampled
    token_ids: list[int] = field(default_factory=list)  # prompt + output; read only for the repetition penalty
    banned: list[int] = field(default_factory=list)  # ids masked now (min_tokens not reached yet)
    kernel_args: tuple[float, int, int, int] | None = None  # cached by the fused path (the params never change)
    plain: bool | None = None  # cached: the params ask for nothing beyond a temperature (see _plain)


@dataclass
class SampleResult:
    """Per row: the sampled id, its processed log-prob, top-N and the sampling mask (None unless asked).

    Top-N stay flat: row i's entries are ``top_ids[a:a + k]`` / ``top_values[a:a + k]`` for ``top_spans[i] == (a, k)``
    (None: the row did not ask). Ints and floats are not tracked by the garbage collector; an (id, log-prob) tuple
    per entry was, about 2,000 new ones per step at batch 256, and the collections they set off cost the engine
    thread ~0.8 ms per step (CPU probe; 0.2 ms for the flat lists).
    """

    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[int]
    top_values: list[float]
    top_spans: list[tuple[int, int] | None]
    masks: list[list[int] | None]

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]] | None]:
        """Per row ``[(id, log-prob), ...]`` best first, None when not asked (the pairs view, off the step loop)."""
        ids, values = self.top_ids, self.top_values
        return [None if s is None else list(zip(ids[s[0] : s[0] + s[1]], values[s[0] : s[0] + s[1]]))
                for s in self.top_spans]  # fmt: skip


class PendingSample:
    """One step's sampling in flight: ``tokens`` [B] on the device now, the host lists after :meth:`result`."""

    def __init__(self, tokens: torch.Tensor, done: SampleResult | None = None, host: torch.Tensor | None = None,
                 event=None, params=None, asked=None, n: int = 0, all_rows: bool = False) -> None:  # fmt: skip
        """``host`` holds [B ids, B log-probs, R x n top-N ids, R x n top-N log-probs]: R rows are the ``asked``
        ones in order, or every row when ``all_rows`` (the kernel selects top-N for the whole batch)."""
        self.tokens = tokens
        self._done, self._host, self._event = done, host, event
        self._params, self._asked, self._n, self._all_rows = params, asked, n, all_rows

    @property
    def deferred(self) -> bool:
        """True when the host has not waited for the device yet (the kernel path)."""
        return self._done is None

    def result(self) -> SampleResult:
        if self._done is not None:
            return self._done
        if self._event is not None:
            self._event.synchronize()
        host = self._host
        assert host is not None
        params, asked, n = self._params, self._asked, self._n
        B = len(params)
        m = (B if self._all_rows else len(asked)) * n
        spans: list[tuple[int, int] | None] = [(0, 0) if p.logprobs is not None else None for p in params]
        top_ids: list[int] = []
        top_values: list[float] = []
        if asked:
            # two C passes to Python ints and floats; each row reads its slice of them (see SampleResult)
            top_ids = host[2 * B : 2 * B + m].to(torch.int64).tolist()
            top_values = host[2 * B + m :].tolist()
            for j, i in enumerate(asked):
                slot = i if self._all_rows else j
                spans[i] = (slot * n, params[i].logprobs)
        self._done = SampleResult(
            token_ids=host[:B].to(torch.int64).tolist(), logprobs=host[B : 2 * B].tolist(), top_ids=top_ids,
            top_values=top_values, top_spans=spans, masks=[None] * B,
        )  # fmt: skip
        return self._done


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply rounds) on int64 tensors holding values < 2**32.

    Products overflow int64 and wrap; only their low 32 bits are kept, which are exact.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=4)
def _token_hash(vocab: int, device: torch.device) -> torch.Tensor:
    return _mix32(torch.arange(vocab, dtype=torch.int64, device=device) + 0x27D4EB2F)


def hashed_exponential(seeds: list[int], positions: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise [R, vocab] (fp32) that depends only on (seed, position, token id)."""
    lo = torch.tensor([s & _M32 for s in seeds], dtype=torch.int64, device=device)
    hi = torch.tensor([(s >> 32) & _M32 for s in seeds], dtype=torch.int64, device=device)
    pos = torch.tensor([p & _M32 for p in positions], dtype=torch.int64, device=device)
    key = _mix32(lo ^ _mix32(hi ^ 0x9E3779B9))
    key = _mix32(key ^ _mix32((pos + 0x85EBCA6B) & _M32))  # [R]
    tok = _token_hash(vocab, device)  # [V]
    bits = _mix32(key[:, None] ^ tok[None, :])  # [R, V] in [0, 2**32)
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1), 24 exact bits
    return u.log_().neg_()


def _kernel_args(row: SamplerRow) -> tuple[float, int, int, int]:
    """(temperature, seed low 32 bits, seed high 32 bits, mode) of a row, computed once and kept on the row."""
    p = row.params
    greedy, seed = p.temperature == 0.0, p.seed
    mode = sample_kernel.MODE_GREEDY if greedy else sample_kernel.MODE_RANDOM_KEY
    if not greedy and seed is not None:
        mode = sample_kernel.MODE_SEEDED
    lo, hi = (seed & _M32, (seed >> 32) & _M32) if seed is not None else (0, 0)
    row.kernel_args = (1.0 if greedy else p.temperature, lo, hi, mode)
    return row.kernel_args


def _plain(rows: list[SamplerRow], vocab: int) -> bool:
    """True when every row only asks for a temperature (or greedy): the fused kernel's case."""
    for r in rows:
        if r.banned:
            return False
        if r.plain is None:  # the params never change and a row belongs to one engine (one vocabulary)
            p = r.params
            r.plain = not (p.repetition_penalty != 1.0 or p.return_sampling_mask) and (
                p.temperature == 0.0 or not (p.min_p > 0.0 or 0 < p.top_k < vocab or p.top_p < 1.0)
            )
        if not r.plain:
            return False
    return True


def _chunks(items: list[int], size: int = ROW_CHUNK):
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _race(logits: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(logit - log E) per row, where E ~ Exp(1). A draw of exactly E = 0 (U rounding to 1 in fp32, about
    once per 2**24 draws) would give -inf - (-inf) = NaN on a masked token, and argmax picks NaN: masked tokens
    are therefore pinned to -inf and the noise kept above zero."""
    scores = logits - noise.clamp_(min=torch.finfo(noise.dtype).tiny).log_()
    return scores.masked_fill_(logits == _NEG_INF, _NEG_INF).argmax(dim=1)


class Sampler:
    """Turns logits [B, V] into one token per row (see the module docstring for the rules).

    Args:
        device: where the logits live.
        seed: seed of the generator that unseeded rows draw from.
    """

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # CUDA: rows that only ask for a temperature go through the split-vocabulary kernels (see sample_kernel),
        # once they passed their self-check, run by prepare() on the model's vocabulary (it shares the compiles)
        self.use_kernel = device.type == "cuda" and sample_kernel.have_kernels()
        self._pinned: list[torch.Tensor | None] = [None, None]
        self._warm: set[tuple[int, torch.dtype]] = set()  # (vocab, logits dtype) the kernels are compiled for
        self._flip = 0

    def _fused(self, logits: torch.Tensor, rows: list[SamplerRow]) -> PendingSample:
        """The split-vocabulary kernels (token, log-prob, top-N up to :data:`sample_kernel.MAX_TOP_N`) write one
        packed tensor whose device->host copy is started here; :meth:`PendingSample.result` waits for it."""
        B, V = logits.shape
        params = [r.params for r in rows]
        static = [r.kernel_args or _kernel_args(r) for r in rows]
        modes = [a[3] for a in static]
        # [4, B] int64 through array.array: about 3x cheaper than torch.tensor on nested lists at batch 256
        meta = array("q", [a[1] for a in static] + [a[2] for a in static] + [r.num_output & _M32 for r in rows] + modes)
        dev = self.device
        temps_t = torch.frombuffer(array("f", [a[0] for a in static]), dtype=torch.float32).to(dev, non_blocking=True)
        meta_t = torch.frombuffer(meta, dtype=torch.int64).view(4, B).to(dev, non_blocking=True)
        if sample_kernel.MODE_RANDOM_KEY in modes:
            rand = torch.randint(0, 1 << 32, (B,), generator=self.generator, device=dev, dtype=torch.int64)
        else:
            rand = meta_t[0]
        x = logits if logits.stride(1) == 1 else logits.contiguous()
        asked = [i for i, p in enumerate(params) if p.logprobs]
        n = min(max((params[i].logprobs for i in asked), default=0), V)
        all_rows = n <= sample_kernel.MAX_TOP_N
        if all_rows:  # top-N of every row selected in the kernel, packed by it
            tokens, packed, _ = sample_kernel.fused_sample(x, temps_t, meta_t, rand, top_n=n)
        else:  # rare (a server started with a larger --max-logprobs): one torch.topk over the rows that asked
            tokens, packed, lse = sample_kernel.fused_sample(x, temps_t, meta_t, rand)
            idx = None if len(asked) == B else torch.tensor(asked, device=dev)
            sub = x if idx is None else x.index_select(0, idx)
            vals, ids = sub.topk(n, dim=1)
            t, z = (temps_t, lse) if idx is None else (temps_t[idx], lse[idx])
            vals = vals.float() / t[:, None] - z[:, None]
            packed = torch.cat([packed, ids.double().flatten(), vals.double().flatten()])
        self._flip ^= 1  # two pinned buffers: one step's copy may still be read while the next one's starts
        buf = self._pinned[self._flip]
        if buf is None or buf.numel() < packed.numel():
            buf = torch.empty(max(packed.numel(), 4096), dtype=torch.float64, pin_memory=dev.type == "cuda")
            self._pinned[self._flip] = buf
        host = buf[: packed.numel()]
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event() if dev.type == "cuda" else None
        if event is not None:
            event.record()
        return PendingSample(tokens=tokens, host=host, event=event, params=params, asked=asked, n=n, all_rows=all_rows)

    def prepare(self, vocab: int, dtype: torch.dtype) -> bool:
        """Check the kernels on [2, vocab] logits of ``dtype``, then compile every slice size they can use there
        (the engine calls this at start; otherwise the first fused step does). A failed check or compile turns the
        kernels off. Returns whether the kernels are on."""
        key = (vocab, dtype)
        if self.use_kernel and key not in self._warm:
            self._warm.add(key)
            if self.device.type == "cuda" and not sample_kernel.check_kernel(self.device, vocab, dtype):
                self.use_kernel = False  # (on CPU only tests switch the kernels on, under TRITON_INTERPRET)
                return False
            try:
                sample_kernel.warm_up(self.device, vocab, dtype)
            except Exception:
                logger.exception("the Triton sampling kernels do not compile for %s; using the torch sampler", key)
                self.use_kernel = False
        return self.use_kernel

    @torch.no_grad()
    def launch(self, logits: torch.Tensor, rows: list[SamplerRow]) -> PendingSample:
        """Queue the sampling of one step; ``.tokens`` (on the device) can feed the next step before
        ``.result()`` brings everything to the host. Rows the kernel does not cover are sampled now."""
        if self.use_kernel and _plain(rows, logits.shape[1]) and self.prepare(logits.shape[1], logits.dtype):
            return self._fused(logits, rows)
        res = self(logits, rows)
        return PendingSample(tokens=torch.tensor(res.token_ids, dtype=torch.int64, device=self.device), done=res)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: list[SamplerRow]) -> SampleResult:
        B, V = logits.shape
        assert B == len(rows)
        if self.use_kernel and _plain(rows, V) and self.prepare(logits.shape[1], logits.dtype):
            return self._fused(logits, rows).result()
        x = logits.float()
        if x.data_ptr() == logits.data_ptr():
            x = x.clone()  # never edit the caller's (or a CUDA graph's) buffer
        params = [r.params for r in rows]
        greedy = [p.temperature == 0.0 for p in params]
        self._penalise(x, rows)
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        if any(t != 1.0 for t in temps):
            x.div_(self._col(temps))
        min_ps = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        if any(m > 0.0 for m in min_ps):
            # prob_i < min_p * prob_max  <=>  logit_i < logit_max + log(min_p); log(0) = -inf keeps all
            thresh = x.amax(dim=1, keepdim=True) + self._col([math.log(m) if m > 0 else _NEG_INF for m in min_ps])
            x.masked_fill_(x < thresh, _NEG_INF)
        trunc = [i for i, (p, g) in enumerate(zip(params, greedy)) if not g and (0 < p.top_k < V or p.top_p < 1.0)]
        for chunk in _chunks(trunc):
            self._top_k_top_p(x, chunk, [params[i].top_k for i in chunk], [params[i].top_p for i in chunk])
        # processed log-probs = x - lse; argmax and the -inf pattern do not need the shift, so the
        # full [B, V] subtraction is skipped and only rows asking for top-N pay it
        lse = torch.logsumexp(x, dim=1, keepdim=True)  # [B, 1]
        choice = self._choose(x, rows, greedy)
        chosen_lp = x.gather(1, choice[:, None]).squeeze(1) - lse.squeeze(1)
        packed = torch.stack([choice.double(), chosen_lp.double()]).cpu()  # one device->host sync
        token_ids = [int(t) for t in packed[0].tolist()]
        top_ids, top_values, top_spans = self._top_n(x, lse, params)
        return SampleResult(
            token_ids=token_ids,
            logprobs=packed[1].tolist(),
            top_ids=top_ids,
            top_values=top_values,
            top_spans=top_spans,
            masks=self._masks(x, params),
        )

    # ---------------------------------------------------------------- steps
    def _col(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)[:, None]

    def _penalise(self, x: torch.Tensor, rows: list[SamplerRow]) -> None:
        """(a) repetition penalty and (b) min_tokens bans, in place."""
        V = x.shape[1]
        rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
        for chunk in _chunks(rep):
            longest = max(len(rows[i].token_ids) for i in chunk)
            ids = torch.full((len(chunk), longest), V, dtype=torch.int64)  # V = padding column, cut below
            for j, i in enumerate(chunk):
                ids[j, : len(rows[i].token_ids)] = torch.tensor(rows[i].token_ids, dtype=torch.int64)
            seen = torch.zeros(len(chunk), V + 1, dtype=torch.bool, device=self.device)
            seen.scatter_(1, ids.to(self.device), True)
            idx = torch.tensor(chunk, device=self.device)
            sub = x.index_select(0, idx)
            pen = self._col([rows[i].params.repetition_penalty for i in chunk])
            sub = torch.where(seen[:, :V], torch.where(sub > 0, sub / pen, sub * pen), sub)
            x.index_copy_(0, idx, sub)
        pairs = [(i, t) for i, r in enumerate(rows) for t in r.banned if 0 <= t < V]
        if pairs:
            r_idx, t_idx = torch.tensor(pairs, dtype=torch.int64, device=self.device).unbind(1)
            x[r_idx, t_idx] = _NEG_INF

    def _top_k_top_p(self, x: torch.Tensor, chunk: list[int], ks: list[int], ps: list[float]) -> None:
        """(e) top-k then (f) top-p on the rows ``chunk``, in place, through one ascending sort."""
        V = x.shape[1]
        idx = torch.tensor(chunk, device=self.device)
        sub = x.index_select(0, idx)
        srt, order = sub.sort(dim=1)  # ascending
        k = torch.tensor([k if 0 < k < V else V for k in ks], dtype=torch.int64, device=self.device)
        kth = srt.gather(1, (V - k)[:, None])  # k-th largest
        srt.masked_fill_(srt < kth, _NEG_INF)
        if any(p < 1.0 for p in ps):
            cum = srt.softmax(dim=1).cumsum_(dim=1)
            drop = cum <= (1.0 - self._col(ps))
            drop[:, -1] = False  # the most probable token always survives
            srt.masked_fill_(drop, _NEG_INF)
        sub.scatter_(1, order, srt)
        x.index_copy_(0, idx, sub)

    def _choose(self, x: torch.Tensor, rows: list[SamplerRow], greedy: list[bool]) -> torch.Tensor:
        """argmax for greedy rows; exponential race for the others. Returns [B] int64.

        ``x`` holds unnormalised processed logits: argmax(x - log E) = argmax(logprob - log E).
        """
        choice = x.argmax(dim=1)
        seeded = [i for i, r in enumerate(rows) if not greedy[i] and r.params.seed is not None]
        unseeded = [i for i, r in enumerate(rows) if not greedy[i] and r.params.seed is None]
        if len(unseeded) == len(rows):  # common case: no row subsetting
            step = max(1, NOISE_ELEMENTS // x.shape[1])  # few launches: the whole batch at once when it fits
            for start in range(0, len(rows), step):
                part = x[start : start + step]
                noise = torch.empty_like(part).exponential_(generator=self.generator)
                choice[start : start + step] = _race(part, noise)
            return choice
        for chunk in _chunks(unseeded):
            idx = torch.tensor(chunk, device=self.device)
            part = x.index_select(0, idx)
            noise = torch.empty_like(part).exponential_(generator=self.generator)
            choice.index_copy_(0, idx, _race(part, noise))
        for chunk in _chunks(seeded):
            idx = torch.tensor(chunk, device=self.device)
            noise = hashed_exponential(
                [rows[i].params.seed for i in chunk], [rows[i].num_output for i in chunk], x.shape[1], self.device
            )
            choice.index_copy_(0, idx, _race(x.index_select(0, idx), noise))
        return choice

    def _top_n(
        self, x: torch.Tensor, lse: torch.Tensor, params: list[SamplingParams]
    ) -> tuple[list[int], list[float], list[tuple[int, int] | None]]:
        """Flat top-N ids and log-probs and each row's span of them (see :class:`SampleResult`)."""
        spans: list[tuple[int, int] | None] = [(0, 0) if p.logprobs is not None else None for p in params]
        top_ids: list[int] = []
        top_values: list[float] = []
        asked = [i for i, p in enumerate(params) if p.logprobs is not None and p.logprobs > 0]
        for chunk in _chunks(asked):
            n = min(max(params[i].logprobs for i in chunk), x.shape[1])
            idx = torch.tensor(chunk, device=self.device)
            vals, ids = x.index_select(0, idx).topk(n, dim=1)
            vals = vals - lse.index_select(0, idx)
            vals, ids = vals.cpu().tolist(), ids.cpu().tolist()
            for j, i in enumerate(chunk):
                k = min(params[i].logprobs, n)
                spans[i] = (len(top_ids), k)
                top_ids.extend(ids[j][:k])
                top_values.extend(vals[j][:k])
        return top_ids, top_values, spans

    def _masks(self, x: torch.Tensor, params: list[SamplingParams]) -> list[list[int] | None]:
        out: list[list[int] | None] = [None] * len(params)
        asked = [i for i, p in enumerate(params) if p.return_sampling_mask]
        for chunk in _chunks(asked):
            alive = torch.isfinite(x.index_select(0, torch.tensor(chunk, device=self.device)))
            counts = alive.sum(dim=1).cpu().tolist()
            ids = alive.nonzero()[:, 1].cpu()  # row-major: each row's ids come out sorted
            for j, part in enumerate(ids.split(counts)):
                out[chunk[j]] = part.tolist()
        return out
