"""Failures of a learner rank told in one line that names where in the run they happened."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rlhf_learner import NonFiniteLossError

__all__ = ["naming_nonfinite"]


@contextlib.contextmanager
def naming_nonfinite(where: str) -> Iterator[None]:
    """A non-finite loss raised by a rank (through Ray or not) as ``NonFiniteLossError("{where}: ...")``,
    one line; the rank's own message names the micro-batch."""
    try:
        yield
    except NonFiniteLossError as err:
        cause = getattr(err, "cause", None) or err  # a Ray task error carries the rank's own exception
        raise NonFiniteLossError(f"{where}: {str(cause).splitlines()[0]}") from None
