"""The weight-transfer HTTP routes (vLLM 0.33's names and answers) in front of a weight receiver.

Only the HTTP side lives here: reading the body, handing each step to the receiver, answering. The steps
themselves (joining the group, receiving into the weights, vLLM's error rules) are the receiver's
(``server/engine/weight_receiver.py``), which runs beside the weights: in this process, or in the engine
process behind ``RemoteReceiver``. Either one is a :class:`~asyncgrpo.server.engine.api.ReceiverAPI`.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from asyncgrpo.server.engine.api import EngineAPI, ReceiverAPI
from asyncgrpo.server.engine.awaiting import awaited
from asyncgrpo.server.errors import ApiError


def _require(ok: bool, message: str, param: str | None = None) -> None:
    if not ok:
        raise ApiError(400, message, param=param)


async def _body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        data = await request.json()
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ApiError(400, "the request body nests JSON too deeply") from exc
    if data is None:
        return {}
    _require(isinstance(data, dict), "the request body must be a JSON object")
    return data


def add_weight_routes(app: web.Application, receiver: ReceiverAPI, engine: EngineAPI) -> None:
    """Register the weight-transfer endpoints; blocking steps run on a dedicated thread pool."""
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="asyncgrpo-weights")

    async def stop_pool(_app: web.Application) -> None:
        pool.shutdown(wait=False)

    app.on_cleanup.append(stop_pool)

    async def in_pool(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def init(request: web.Request) -> web.Response:
        body = await _body(request)
        await in_pool(receiver.init, body.get("init_info"))
        return web.json_response({"message": "Weight transfer initialized"})

    async def start(request: web.Request) -> web.Response:
        await receiver.start_async()
        return web.json_response({"message": "Weight update started"})

    async def update(request: web.Request) -> web.Response:
        body = await _body(request)
        await receiver.update_async(body.get("update_info"))
        return web.json_response({"message": "Weights updated"})

    async def profile_get(request: web.Request) -> web.Response:
        return web.json_response({"profile": await in_pool(receiver.last_profile)})

    async def profile_set(request: web.Request) -> web.Response:
        enabled = (await _body(request)).get("enabled")
        _require(isinstance(enabled, bool), f"weight_sync_profile needs {{'enabled': true|false}}, got {enabled!r}")
        return web.json_response({"enabled": await in_pool(receiver.set_profile, enabled)})

    async def finish(request: web.Request) -> web.Response:
        body = await _body(request)
        version = await receiver.finish_async(body.get("weight_version"))
        return web.json_response({"message": "Weight update finished", "weight_version": version})

    async def round_step(request: web.Request) -> web.Response:
        body = await _body(request)
        begin, end = body.get("begin", False), body.get("end", False)  # checked beside the weights (round_step.py)
        version = await receiver.round_step_async(body.get("update_info"), begin, end, body.get("weight_version"))
        return web.json_response({"message": "Weight round step done", "weight_version": version})

    async def shutdown(request: web.Request) -> web.Response:
        await in_pool(receiver.shutdown)
        return web.json_response({"message": "Weight transfer shut down"})

    async def weight_info(request: web.Request) -> web.Response:
        return web.json_response({"weight_version": engine.weight_version})

    async def reset_prefix_cache(request: web.Request) -> web.Response:
        await awaited(engine.reset_prefix_cache_future(), "the prefix-cache reset")  # always succeeds
        return web.json_response({"success": True})

    app.router.add_post("/init_weight_transfer_engine", init)
    app.router.add_post("/start_weight_update", start)
    app.router.add_post("/update_weights", update)
    app.router.add_post("/finish_weight_update", finish)
    app.router.add_post("/shutdown_weight_transfer_engine", shutdown)
    app.router.add_get("/weight_info", weight_info)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    # Ours, not vLLM's: the timeline of the last weight round on this end (see weights/wire_profile.py).
    app.router.add_get("/weight_sync_profile", profile_get)
    app.router.add_post("/weight_sync_profile", profile_set)
    # Ours: one weight-update call with the steps around it (server/engine/round_step.py; /server_info says so).
    app.router.add_post("/weight_round_step", round_step)
