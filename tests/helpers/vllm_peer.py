"""A test double of vLLM 0.33's weight-sync peer: the HTTP routes and one worker's end of the group.

    python -m tests.helpers.vllm_peer --port 8123 --backend gloo --device cpu --out /tmp/peer

Written from vLLM's behaviour (``distributed/weight_transfer/nccl_engine.py``,
``nccl_common.py``, ``packed_tensor.py``, ``device_communicators/pynccl.py``), not
from our receiver, so our :class:`~asyncgrpo.weights.sender.WeightSender` can be
checked against it:

* ``init_info`` / ``update_info`` are parsed like vLLM's dataclasses: an unknown
  or missing key is a 500 (vLLM's worker raises; the API answers 500); exactly one
  rendezvous mode (unique id *or* master address/port).
* The worker joins as rank ``rank_offset`` and contributes ``torch.zeros(1)`` to
  the one-element warm-up all-reduce (vLLM's PyNccl communicator).
* Unpacked rounds: one broadcast per tensor in ``names`` order, zero-element
  tensors included. Packed rounds: vLLM's consumer loop: a chunk closes right
  after the tensor that takes it over ``packed_buffer_size_bytes``; every chunk is
  one uint8 broadcast, a zero-byte one included (NCCL treats count 0 as a no-op;
  on gloo, our CPU backend, zero-byte broadcasts are skipped on every rank).

``--version 0.32.0`` gives 0.32's update semantics: empty ``update_info`` lists
mean zero tensors (0.33 reads them as "the last round's metadata again").

Each finished round is saved to ``OUT/round-<k>.pt``: the tensors received, the
byte size of every broadcast, the warm-up sum, the version and the query of every
``/pause`` since the previous round (the sender must ask for ``clear_cache``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import logging
import math
import threading
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

logger = logging.getLogger("vllm_peer")

INIT_FIELDS = {"master_address", "master_port", "nccl_unique_id_b64", "rank_offset", "world_size", "packed",
               "packed_buffer_size_bytes", "packed_num_buffers"}  # fmt: skip
INIT_REQUIRED = {"rank_offset", "world_size"}
UPDATE_FIELDS = {"names", "dtype_names", "shapes"}
GLOO_STORE_PREFIX = "asyncgrpo_weight_transfer"  # our gloo backend's store prefix (vLLM has no gloo backend)


class BadRequest(Exception):
    pass


class Peer:
    """One vLLM worker (TP=PP=DP=1) holding nothing but what it receives."""

    def __init__(self, backend: str, device: str, out: Path, timeout_s: float, version: str = "0.33.0") -> None:
        self.backend, self.device, self.out, self.timeout_s = backend, torch.device(device), out, timeout_s
        self.version = version
        self.reuses_metadata = tuple(int(x) for x in version.split(".")[:2]) >= (0, 33)
        self.comm: Any = None
        self.packed, self.buffer_size = False, 1 << 30
        self.last_update: dict[str, list] | None = None
        self.warmup_sum: float | None = None
        self.active = False
        self.rounds = 0
        self.received: dict[str, torch.Tensor] = {}
        self.broadcast_sizes: list[int] = []
        self.pauses: list[dict[str, str]] = []  # query parameters of each /pause since the last round

    # ------------------------------------------------------------------ the group

    def init(self, info: Any) -> None:
        if not isinstance(info, dict):
            raise BadRequest("init_info must be an object")
        unknown, missing = set(info) - INIT_FIELDS, INIT_REQUIRED - set(info)
        if unknown or missing:
            raise BadRequest(f"Invalid init_info: unexpected {sorted(unknown)}, missing {sorted(missing)}")
        uid_b64 = info.get("nccl_unique_id_b64")
        has_addr = info.get("master_address") is not None or info.get("master_port") is not None
        if uid_b64 and has_addr:
            raise BadRequest("pass nccl_unique_id_b64 OR master_address/master_port, not both")
        if not uid_b64 and (info.get("master_address") is None or info.get("master_port") is None):
            raise BadRequest("need nccl_unique_id_b64, or both master_address and master_port")
        rank, world = int(info["rank_offset"]), int(info["world_size"])
        self.packed = bool(info.get("packed", False))
        self.buffer_size = int(info.get("packed_buffer_size_bytes", 1 << 30))
        self.last_update = None
        if self.backend == "nccl":
            from asyncgrpo.weights import nccl_lib  # the ctypes binding of libnccl only

            if not uid_b64:
                raise BadRequest("this double joins NCCL through nccl_unique_id_b64 only")
            uid = base64.b64decode(uid_b64, validate=True)
            self.comm = nccl_lib.Communicator(world, uid, rank, self.device)
        else:
            import torch.distributed as dist

            store = dist.TCPStore(info["master_address"], int(info["master_port"]), world, False,
                                  timeout=datetime.timedelta(seconds=self.timeout_s))  # fmt: skip
            prefixed = dist.PrefixStore(GLOO_STORE_PREFIX, store)
            self.comm = dist.ProcessGroupGloo(prefixed, rank, world, datetime.timedelta(seconds=self.timeout_s))
            self._store = store
        warm = torch.zeros(1, dtype=torch.float32, device=self.device)  # vLLM's worker contributes zeros
        self._all_reduce(warm)
        self.warmup_sum = float(warm.item())
        logger.info("joined as rank %d of %d (%s); warm-up sum %s", rank, world, self.backend, self.warmup_sum)

    def _all_reduce(self, t: torch.Tensor) -> None:
        if self.backend == "nccl":
            with torch.cuda.device(self.device):
                self.comm.all_reduce_sum(t)
                torch.cuda.synchronize(self.device)
        else:
            self.comm.allreduce([t]).wait()

    def _broadcast(self, t: torch.Tensor) -> None:
        self.broadcast_sizes.append(t.numel() * t.element_size())
        if self.backend == "nccl":
            flat = t.reshape(-1)
            if flat.dtype == torch.bool:
                flat = flat.view(torch.uint8)
            with torch.cuda.device(self.device):
                self.comm.broadcast(flat, root=0)  # count 0 included, as vLLM issues it
                torch.cuda.synchronize(self.device)
        elif t.numel():
            import torch.distributed as dist

            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self.comm.broadcast([t.reshape(-1).view(torch.uint8)], opts).wait()

    # ------------------------------------------------------------------ one round

    def update(self, info: Any) -> None:
        if not isinstance(info, dict) or set(info) - UPDATE_FIELDS:
            raise BadRequest(f"Invalid update_info: unexpected keys {sorted(set(info) - UPDATE_FIELDS)}")
        names, dtypes, shapes = (list(info.get(k) or []) for k in ("names", "dtype_names", "shapes"))
        if not (len(names) == len(dtypes) == len(shapes)):
            raise BadRequest("`dtype_names` and `shapes` should be of the same size as `names`")
        if names:
            self.last_update = {"names": names, "dtype_names": dtypes, "shapes": shapes}
        elif self.last_update is not None and self.reuses_metadata:
            names, dtypes, shapes = (self.last_update[k] for k in ("names", "dtype_names", "shapes"))
        metas = [(n, getattr(torch, d), [int(x) for x in s]) for n, d, s in zip(names, dtypes, shapes)]
        if not self.packed:
            for name, dtype, shape in metas:
                t = torch.empty(shape, dtype=dtype, device=self.device)
                self._broadcast(t)
                self.received[name] = t.cpu()
            return
        pending: list[tuple[str, torch.dtype, list[int], int]] = []
        total = 0
        for name, dtype, shape in metas:  # vLLM's packed_nccl_broadcast_consumer
            size = math.prod(shape) * dtype.itemsize
            pending.append((name, dtype, shape, size))
            total += size
            if total > self.buffer_size:
                self._receive_chunk(pending, total)
                pending, total = [], 0
        if pending:
            self._receive_chunk(pending, total)

    def _receive_chunk(self, pending: list[tuple[str, torch.dtype, list[int], int]], total: int) -> None:
        buf = torch.empty(total, dtype=torch.uint8, device=self.device)
        self._broadcast(buf)
        for (name, dtype, shape, _), part in zip(pending, buf.cpu().split([p[3] for p in pending])):
            self.received[name] = part.clone().view(dtype).view(shape)

    def finish(self, version: str | None) -> None:
        self.rounds += 1
        record = {"version": version, "tensors": self.received, "broadcast_sizes": self.broadcast_sizes,
                  "warmup_sum": self.warmup_sum, "packed": self.packed, "pauses": self.pauses}  # fmt: skip
        torch.save(record, self.out / f"round-{self.rounds}.pt")
        self.received, self.broadcast_sizes, self.active, self.pauses = {}, [], False, []

    def shutdown(self) -> None:
        if self.backend == "nccl" and self.comm is not None:
            self.comm.destroy()
        self.comm = None


# ---------------------------------------------------------------------- HTTP (vLLM's dev-mode routes)


def make_app(peer: Peer) -> web.Application:
    lock = threading.Lock()

    async def blocking(fn, *args):
        def locked():
            with lock:
                return fn(*args)

        try:
            return await asyncio.get_running_loop().run_in_executor(None, locked)
        except BadRequest as exc:
            raise web.HTTPInternalServerError(text=str(exc)) from exc

    async def body(request: web.Request) -> dict:
        return (await request.json()) if request.can_read_body else {}

    async def ok(message: str) -> web.Response:
        return web.json_response({"message": message})

    async def init(request):
        await blocking(peer.init, (await body(request)).get("init_info"))
        return await ok("Weight transfer initialized")

    async def start(request):
        peer.active = True
        return await ok("Weight update started")

    async def update(request):
        await blocking(peer.update, (await body(request)).get("update_info"))
        return await ok("Weights updated")

    async def finish(request):
        await blocking(peer.finish, (await body(request)).get("weight_version"))
        return await ok("Weight update finished")

    async def shutdown(request):
        await blocking(peer.shutdown)
        return await ok("Weight transfer shut down")

    async def static(request):
        if request.path == "/pause":
            peer.pauses.append(dict(request.query))
        answers = {
            "/version": {"version": peer.version},
            "/health": None,
            "/get_world_size": {"world_size": 1},
            "/pause": {"status": "paused"},
            "/resume": {"status": "resumed"},
            "/reset_prefix_cache": {"success": True},
            "/server_info": {"vllm_config": {"weight_transfer_config": {"backend": peer.backend}}},
        }
        answer = answers[request.path]
        return web.Response(status=200) if answer is None else web.json_response(answer)

    app = web.Application()
    app.router.add_post("/init_weight_transfer_engine", init)
    app.router.add_post("/start_weight_update", start)
    app.router.add_post("/update_weights", update)
    app.router.add_post("/finish_weight_update", finish)
    app.router.add_post("/shutdown_weight_transfer_engine", shutdown)
    for path in ("/health", "/get_world_size", "/server_info", "/version"):
        app.router.add_get(path, static)
    for path in ("/pause", "/resume", "/reset_prefix_cache"):
        app.router.add_post(path, static)
    return app


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s vllm_peer %(levelname)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backend", choices=["nccl", "gloo"], required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--version", default="0.33.0", help="the vLLM release to answer as (0.32.0: no metadata reuse)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    peer = Peer(args.backend, args.device, args.out, args.timeout_s, args.version)
    web.run_app(make_app(peer), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
