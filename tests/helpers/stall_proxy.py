"""A fault injector in front of a real server: forwards every request, except that once a flag file exists it holds
the requests to the named paths forever (the server behind it never hears of them), as a hung server would.

Run as its own process: ``python stall_proxy.py UPSTREAM FLAG_FILE HOLD_LOG PATH[,PATH...]``; it prints its port on
the first line of stdout. Each held request appends ``<time.time()> <path>`` to HOLD_LOG when it arrives.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, web


def make_app(upstream: str, flag: Path, hold_log: Path, hold: set[str]) -> web.Application:
    session: dict[str, ClientSession] = {}

    async def forward(request: web.Request) -> web.StreamResponse:
        if request.path in hold and flag.exists():
            with hold_log.open("a") as fh:
                fh.write(f"{time.time()} {request.path}\n")
            await asyncio.Event().wait()  # never answered; cancelled when the client gives up
        if "s" not in session:
            session["s"] = ClientSession(timeout=ClientTimeout(total=None))
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")}
        async with session["s"].request(request.method, upstream + request.path_qs, data=body, headers=headers) as r:
            data = await r.read()
            return web.Response(body=data, status=r.status, content_type=r.content_type)

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def start(upstream: str, flag: Path, hold_log: Path, paths: list[str]) -> tuple[subprocess.Popen, str]:
    """Start the proxy process; returns it and its base URL."""
    proc = subprocess.Popen(
        [sys.executable, __file__, upstream, str(flag), str(hold_log), ",".join(paths)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    port = proc.stdout.readline().strip()
    if not port.isdigit():
        proc.kill()
        raise RuntimeError(f"the stall proxy did not start (it printed {port!r})")
    return proc, f"http://127.0.0.1:{port}"


def main() -> None:
    upstream, flag, hold_log, paths = sys.argv[1:5]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    app = make_app(upstream.rstrip("/"), Path(flag), Path(hold_log), set(paths.split(",")))
    web.run_app(app, sock=sock, print=None, handle_signals=True)


if __name__ == "__main__":
    main()
