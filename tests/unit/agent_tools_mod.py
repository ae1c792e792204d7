"""Module-level tools and environments for the agent unit tests (tools must be importable by name)."""

from __future__ import annotations

import asyncio
import threading
import time


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    await asyncio.sleep(0)
    return a + b


def no_docstring(a: int) -> int:
    return a


CALL_LOG: list[tuple[str, int]] = []
_LOCK = threading.Lock()


def record(tag: str, delay: float) -> str:
    """
    Records its tag after sleeping.

    Args:
        tag: A label.
        delay: Seconds to sleep first.

    Returns:
        The tag.
    """
    time.sleep(delay)
    with _LOCK:
        CALL_LOG.append((tag, threading.get_ident()))
    return tag


class CounterEnv:
    """An environment: `increment` and `peek` are tools, `reset`/`get_reward` are reserved."""

    instances = 0

    def __init__(self) -> None:
        CounterEnv.instances += 1
        self.counter = 0
        self.target = 0

    def reset(self, target: int = 3, **kwargs) -> str:
        self.counter = 0
        self.target = target
        return f"Reach {target}."

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the counter.

        Args:
            step: Value to add.

        Returns:
            The new counter value.
        """
        self.counter += step
        return self.counter

    async def peek(self) -> int:
        """
        Read the counter.

        Returns:
            The counter value.
        """
        return self.counter

    def _helper(self) -> None:
        pass


class NoResetEnv:
    def step(self, x: int) -> int:
        """
        Step.

        Args:
            x: A value.
        """
        return x


def increment(step: int) -> int:
    """
    A trainer tool whose name clashes with CounterEnv.increment.

    Args:
        step: A value.
    """
    return step
