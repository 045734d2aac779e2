"""Awaiting user code (reward functions, environments) with a time limit and errors that name it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["named_call"]


async def named_call(call: Awaitable[T], *, timeout_s: float | None, timed_out: str, failed: str) -> T:
    """``await call`` within ``timeout_s`` (None: no limit). Running out of time raises
    ``TimeoutError(timed_out)``; any error of the call's own (its own ``TimeoutError`` included) becomes
    ``RuntimeError(f"{failed} {err!r}")``, chained to it."""
    timer = asyncio.timeout(timeout_s)
    try:
        async with timer:
            return await call
    except Exception as err:
        if isinstance(err, TimeoutError) and timer.expired():
            raise TimeoutError(timed_out) from None
        raise RuntimeError(f"{failed} {err!r}") from err
