"""Rollout-loop subclasses for tests; module-level, so the spawned worker imports them by name."""

from __future__ import annotations

import json
import os
from typing import Any

from asyncgrpo.rollout.loop import AsyncRolloutLoop


def _record(entry: dict[str, Any]) -> None:
    with open(os.environ["ASYNCGRPO_TEST_RECORD"], "a") as fh:
        fh.write(json.dumps(entry) + "\n")


class RequestRecordingLoop(AsyncRolloutLoop):
    """The default loop; each generation request's ``n`` is appended to ``$ASYNCGRPO_TEST_RECORD`` as it goes out."""

    async def _sample(self, prompt_ids: list[int], params: dict[str, Any]) -> list[Any]:
        _record({"n": params.get("n", 1)})
        return await super()._sample(prompt_ids, params)
