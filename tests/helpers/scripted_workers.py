"""The rollout worker as ``RolloutSource`` sees it, for tests that script its groups (``get_sample``).

The calls a test does not watch do nothing here; a test overrides those it checks.
"""

from __future__ import annotations


class QuietChannels:
    def count_queued(self, n: int) -> None:
        """The sample-queue count: not watched."""


class QuietWorker:
    """Subclasses define ``get_sample(timeout)``; the rest of the worker's interface is a no-op."""

    def __init__(self) -> None:
        self.channels = QuietChannels()

    def report_consumed(self, tokens: int) -> None:
        pass

    def report_step(self, tokens: int) -> None:
        pass

    def queue_size(self) -> int:
        return 0

    def set_trainer_waiting(self, waiting: bool) -> None:
        pass
