"""One weight round of :class:`~asyncgrpo.weights.sender.WeightSender` over NCCL or gloo, on every live server.

The sequence and its failure rules are the sender's module docstring; the ``ipc`` backend's round is
``weights/ipc_round.py``. Each HTTP step runs on all servers at once (``WeightSender._each``) and a failure goes to
the sender's policy (``weights/lost_server.py``): the step's own error with one server, a dropped server or a
failed round with several. A failed round is closed on every live server that is not inside the collective
(``WeightSender._abandon``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from asyncgrpo.errors import ServerError, WeightTransferError
from asyncgrpo.weights.collectives import TensorMeta, dtype_name
from asyncgrpo.weights.fanout_group import broadcast_group
from asyncgrpo.weights.ipc_round import ipc_round
from asyncgrpo.weights.links import Sender, wait_all
from asyncgrpo.weights.name_check import check_round
from asyncgrpo.weights.round_control import finish_and_reset
from asyncgrpo.weights.wire import send_tensors
from asyncgrpo.weights.wire_profile import WireProfile, enable_server_profiles, server_profile

logger = logging.getLogger(__name__)
Meta = TensorMeta | tuple[str, torch.dtype, Sequence[int]]


def _values(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[torch.Tensor]:
    """The tensors of ``(name, tensor)`` pairs, each released here before the next pair is made."""
    for item in named_tensors:
        yield item[1]
        del item


def _as_meta(m: Meta) -> TensorMeta:
    return m if isinstance(m, TensorMeta) else TensorMeta(m[0], m[1], tuple(m[2]))


def collective_round(
    sender: Sender, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str, packed: bool | None,
           metadata: Sequence[Meta] | None, barrier: Callable[[], None] | None) -> dict[str, float]:  # fmt: skip
    """One round of ``WeightSender.update`` over every live server (after the policy's look at them)."""
    assert sender._loop is not None and sender.policy is not None
    sender.policy.before_round(sender)
    if metadata is None:
        items = list(named_tensors)
        metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in items]
        tensors: Iterable[torch.Tensor] = [t for _, t in items]
        del items
    else:
        metas, tensors = [_as_meta(m) for m in metadata], _values(named_tensors)
    if packed is not None and packed != sender.packed:  # vLLM's update_info has no packed field (400)
        raise ValueError(f"packed={packed} differs from init(packed={sender.packed}); packing is fixed when the "
                         "group forms: close() and init() again with the packing you want")  # fmt: skip
    # Before the clock starts: the same metadata as last round travels as empty lists (vLLM >= 0.33 reuses its
    # last), and the very list object lets the wire's cached plan be found without comparing it again.
    for link in sender.links.values():
        if metas == link.last_metas:
            metas = link.last_metas
        else:
            check_round(metas, link.weights, link.url)  # before any pause or broadcast
    if sender._ipc is not None:
        link = next(iter(sender.links.values()))
        link.last_metas = metas  # checked; ipc sends every round's metadata (its handles change)
        return ipc_round(sender, link, tensors, metas, version=version, barrier=barrier)
    one = next(iter(sender.links.values())) if len(sender.links) == 1 else None
    if sender.profile and one is not None and sender._server_profiles is None:
        sender._server_profiles = sender._http(enable_server_profiles(one.client), "POST /weight_sync_profile")
    steps: dict[str, Any] = {}
    t0, t1, t2 = _open(sender, barrier, steps)
    futures: dict[str, concurrent.futures.Future] = {}
    group = sender.group
    profile = WireProfile(group.device) if sender.profile and one is not None and group is not None else None
    _send(sender, tensors, metas, futures, profile, steps, t0)
    for link in sender.links.values():
        link.last_metas = metas
    _finish(sender, version)
    steps["finish_and_reset"] = (time.perf_counter() - t0) * 1e3
    try:
        sender._each(lambda c: c.resume(timeout=sender.timeout_s), "POST /resume")
    except BaseException:
        if sender.policy.closes_failed_pause_and_resume:
            sender._abandon({})
        raise
    t3 = time.perf_counter()
    steps["resume"] = (t3 - t0) * 1e3
    if profile is not None and one is not None:
        steps["sender_wire"] = profile.summary()
        if sender._server_profiles:
            steps["receiver"] = sender._http(server_profile(one.client), "GET /weight_sync_profile")
    sender.last_breakdown = steps
    return {"pause_s": t1 - t0, "barrier_s": t2 - t1, "transfer_s": t3 - t2, "total_s": t3 - t0}


def _open(sender: Sender, barrier: Callable[[], None] | None, steps: dict[str, Any]) -> tuple[float, float, float]:
    """Pause and start the update on every server; returns the times before, after the pause, after start.

    A server lost meanwhile leaves the shared group with a dead member: the survivors close their update,
    the group forms again without it and the round opens again (the barrier is not repeated).
    """
    assert sender.policy is not None
    while True:
        n = len(sender.links)
        t0 = time.perf_counter()
        try:
            sender._each(lambda c: c.pause("keep", timeout=sender.timeout_s, clear_cache=True), "POST /pause?mode=keep")
        except BaseException:
            if sender.policy.closes_failed_pause_and_resume:
                sender._abandon({})
            raise
        t1 = time.perf_counter()
        steps["pause"] = (t1 - t0) * 1e3
        try:
            if barrier is not None:
                barrier()
                barrier = None
                steps["barrier"] = (time.perf_counter() - t0) * 1e3
            sender._each(lambda c: c.start_weight_update(timeout=sender.timeout_s), "POST /start_weight_update")
        except BaseException:
            sender._abandon({})
            raise
        t2 = time.perf_counter()
        steps["start"] = (t2 - t0) * 1e3
        if sender.shared is None or len(sender.links) == n:
            return t0, t1, t2
        sender._each(lambda c: c.finish_weight_update(None, timeout=sender.timeout_s), "POST /finish_weight_update")
        for url, link in sender.links.items():  # leave no live server paused (errors only logged)
            try:
                sender._loop_run(link.client.resume(timeout=30.0), 35.0, f"POST /resume of {url}")
            except (ServerError, WeightTransferError) as exc:
                logger.warning("could not resume %s after a failed weight sync: %s", url, exc)
        sender.reform_shared()


def _send(sender: Sender, tensors: Iterable[torch.Tensor], metas: list[TensorMeta], futures: dict[str, Any],
          profile: WireProfile | None, steps: dict[str, Any], t0: float) -> None:  # fmt: skip
    """The opened round's data: post every /update_weights, broadcast every tensor, wait for the answers."""
    assert sender._loop is not None and sender.policy is not None
    for url, link in sender.links.items():
        reuse = metas is link.last_metas and link.reuse_metadata
        info = {"names": [] if reuse else [m.name for m in metas],
                "dtype_names": [] if reuse else [dtype_name(m.dtype) for m in metas],
                "shapes": [] if reuse else [list(m.shape) for m in metas]}  # fmt: skip
        futures[url] = sender._loop.submit(link.client.update_weights(info, timeout=sender.timeout_s))
    group = broadcast_group(sender, futures)
    try:
        send_tensors(group, tensors, metas, packed=sender.packed, buffer_size_bytes=sender.packed_buffer_size_bytes,
                     num_buffers=sender.packed_num_buffers, lanes=sender._lanes if group is sender.group else None,
                     profile=profile)  # fmt: skip
        steps["enqueued"] = (time.perf_counter() - t0) * 1e3
        group.synchronize("the weight broadcast")
        steps["synchronized"] = (time.perf_counter() - t0) * 1e3
    except Exception as exc:
        # No wait on a server that has not answered its update: it may be stuck inside the collective.
        paused = sender._abandon(futures)
        urls = ", ".join(sender.links) or ", ".join(futures)
        tail = f"; {'; '.join(paused)}" if paused else ""
        if isinstance(exc, WeightTransferError) and not paused and len(futures) == 1:
            raise
        raise WeightTransferError(f"broadcasting weights to {urls} failed: {exc}{tail}") from exc
    finally:
        for g in [sender.shared, *(link.group for link in sender.links.values())]:
            if g is not None:
                g.abort_check = None
    live = {u: f for u, f in futures.items() if u in sender.links}
    try:
        _each_future(sender, live, "POST /update_weights")
    except BaseException as exc:
        paused = sender._abandon(live)
        if paused:
            raise WeightTransferError(f"the broadcast finished but POST /update_weights did not return; "
                                      f"{'; '.join(paused)}") from None  # fmt: skip
        if isinstance(exc, ServerError):
            raise WeightTransferError(f"POST /update_weights failed: {exc}") from exc
        raise
    steps["update_reply"] = (time.perf_counter() - t0) * 1e3
    futures.clear()  # every server answered its update: from here on a failure never finds one inside it


def _each_future(sender: Sender, futures: dict[str, concurrent.futures.Future], what: str) -> None:
    """Wait for futures already submitted, one per live server (a timed-out one is left running)."""
    assert sender.policy is not None
    if len(futures) == 1:
        url, fut = next(iter(futures.items()))
        try:
            fut.result(sender.timeout_s)
        except concurrent.futures.TimeoutError:
            raise WeightTransferError(f"timed out after {sender.timeout_s:.0f}s waiting for {what}") from None
        except (ServerError, OSError) as exc:
            sender.policy.lost(sender, sender.links[url], exc)
        return
    wait_all(futures, what, sender.timeout_s, lambda url, exc: sender.policy.lost(sender, sender.links[url], exc))


def _finish(sender: Sender, version: str) -> None:
    """Finish (labelling ``version``) and reset every server; a failure closes the round on every live one."""
    try:
        sender._each(lambda c: finish_and_reset(c, version, sender.timeout_s),
                   "POST /finish_weight_update and /reset_prefix_cache")  # fmt: skip
    except (ServerError, WeightTransferError) as exc:
        sender._abandon({})
        raise WeightTransferError(
            f"the weights reached {', '.join(sender.links)} but closing the round failed: {exc}"
        ) from exc
    for url in sender.links:
        sender.pushed[url] = str(version)
