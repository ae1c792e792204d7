"""Rollout-loop subclasses for tests; module-level, so the spawned worker imports them by name."""

from __future__ import annotations

from typing import Any

from asyncgrpo.rollout.loop import AsyncRolloutLoop
from tests.helpers.rewards import append_record


class RequestRecordingLoop(AsyncRolloutLoop):
    """The default loop; each generation request's ``n`` is appended to ``$ASYNCGRPO_TEST_RECORD`` as it goes out."""

    async def _sample(self, prompt_ids: list[int], params: dict[str, Any]) -> list[Any]:
        append_record({"n": params.get("n", 1)})
        return await super()._sample(prompt_ids, params)
