"""Plain HTTP calls for protocol tests: the status and the decoded body, with no client logic in between."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

PROMPT = [1, 17, 42, 99, 7]  # small ids: valid for any vocabulary
NEG_INF_WIRE = -9999.0  # vLLM's wire value of a -inf log-prob


async def _raw(url: str, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
    kwargs.setdefault("timeout", aiohttp.ClientTimeout(total=120))
    async with aiohttp.ClientSession() as s, s.request(method, url + path, **kwargs) as r:
        body = await r.read()
        try:
            return r.status, json.loads(body) if body else None
        except ValueError:
            return r.status, body.decode(errors="replace")


def raw(url: str, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
    """``(status, JSON body or text or None)`` of one request to ``url + path``."""
    return asyncio.run(_raw(url, method, path, **kwargs))
