"""A weight sender whose init fails leaves no HTTP session open (issue 44 item 3).

Before the fix, a failed ``WeightSender.init`` (NCCL missing on a CPU torch, a server rejecting its init) left the
cloned clients' aiohttp sessions and the sender's loop thread open: five "Unclosed client session" / "Unclosed
connector" lines followed the traceback. The server here is a real aiohttp server that rejects the init.
"""

from __future__ import annotations

import gc
import sys
import threading

import aiohttp
import pytest
from aiohttp import web

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.errors import WeightTransferError
from asyncgrpo.weights.nccl_lib import NcclError
from asyncgrpo.weights.sender import WeightSender
from tests.helpers.fake_http import ThreadedServer


def _rejecting_server() -> ThreadedServer:
    async def server_info(request):
        return web.json_response({"weight_transfer_backends": ["nccl", "gloo"]})

    async def init(request):
        body = {"error": {"message": "no weight transfer here", "type": "BadRequestError", "code": 400}}
        return web.json_response(body, status=400)

    return ThreadedServer([web.get("/server_info", server_info), web.post("/init_weight_transfer_engine", init)])


def _open_sessions() -> set[int]:
    gc.collect()
    return {id(o) for o in gc.get_objects() if type(o) is aiohttp.ClientSession and not o.closed}


# nccl on a CPU device fails before any init is posted (the case: NCCL missing or no CUDA); gloo posts the
# init, which the server rejects.
@pytest.mark.filterwarnings("error::ResourceWarning")
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_a_failed_init_closes_every_session(backend, monkeypatch):
    unraisable = []  # what a session's __del__ raises (ResourceWarning as an error) lands here
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    before = _open_sessions()
    threads = set(threading.enumerate())
    with _rejecting_server() as server:
        sender = WeightSender(timeout_s=3.0)
        with pytest.raises((WeightTransferError, NcclError, ValueError)):
            sender.init(AsyncServerClient(server.url), 1, backend=backend, device="cpu")
        assert _open_sessions() - before == set()
        assert sender.links == {} and sender._loop is None
        left = [t.name for t in set(threading.enumerate()) - threads if t.name == "asyncgrpo-weight-sync-http"]
        assert left == []
    gc.collect()
    assert unraisable == []
