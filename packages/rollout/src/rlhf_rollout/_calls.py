"""Awaiting user code (reward functions, environments) with a time limit and errors that name it."""

from __future__ import annotations

import asyncio
import sysconfig
import traceback
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

__all__ = ["UserCodeError", "named_call", "reworded", "user_frames"]

_NOT_THEIRS = (str(Path(__file__).resolve().parent), sysconfig.get_paths()["stdlib"])
"""Frames under these folders are ours or Python's, not the user's."""


class UserCodeError(RuntimeError):
    """User code (a reward function, an environment, an agent) raised: the message names it, and
    ``user_traceback`` holds the traceback's frames in the user's own files, then the exception."""

    def __init__(self, message: str, *, user_traceback: str) -> None:
        super().__init__(message)
        self.user_traceback = user_traceback


def reworded(err: BaseException, message: str, otherwise: type[Exception] = ValueError) -> Exception:
    """``err`` told as ``message``: a :class:`UserCodeError` stays one (with its user's frames), any other
    error becomes ``otherwise(message)``."""
    if isinstance(err, UserCodeError):
        return UserCodeError(message, user_traceback=err.user_traceback)
    return otherwise(message)


def user_frames(err: BaseException) -> str:
    """``err``'s traceback as Python prints it, with the frames of this package and the standard library
    left out: what is left is the user's code (their file and line)."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(_NOT_THEIRS)]
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames)]
    return "".join(lines + traceback.format_exception_only(err))


async def named_call(call: Awaitable[T], *, timeout_s: float | None, timed_out: str, failed: str) -> T:
    """``await call`` within ``timeout_s`` (None: no limit). Running out of time raises
    ``TimeoutError(timed_out)``; any error of the call's own (its own ``TimeoutError`` included) becomes
    ``UserCodeError(f"{failed} {err!r}")``, chained to it, with the user's frames (``user_frames``)."""
    timer = asyncio.timeout(timeout_s)
    try:
        async with timer:
            return await call
    except Exception as err:
        if isinstance(err, TimeoutError) and timer.expired():
            raise TimeoutError(timed_out) from None
        raise UserCodeError(f"{failed} {err!r}", user_traceback=user_frames(err)) from err
