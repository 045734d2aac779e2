"""glibc malloc settings for a run's processes: keep freed memory for reuse instead of handing it back to
the kernel. Imports nothing heavy: the CLI sets them in its environment before it starts Ray, whose
processes read them once, when they start.

torch's CPU allocator takes every tensor from malloc. With glibc's defaults a block over the mmap
threshold (at most 32 MiB) is its own mapping, unmapped when freed, and the heap's free top is given back
past the trim threshold; each training step or weight sync then writes its larger activations, gradients
and buffers into fresh pages, and every new page is a page fault. Intel's and torch's CPU tuning guides
use jemalloc or tcmalloc set to keep freed memory; these two variables do the same with glibc (page faults
and step times with and without them: docs/performance.md)."""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["MALLOC_SETTINGS", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "glibc_version", "malloc_env"]

MMAP_THRESHOLD = 1 << 30
"""``MALLOC_MMAP_THRESHOLD_``: blocks below 1 GiB come from the heap and are reused once freed (in the
main thread; glibc's arenas of other threads stop at 64 MiB and map larger blocks as before). glibc
before 2.35 ignores a threshold over 32 MiB, and the settings are then left out."""
TRIM_THRESHOLD = 1 << 30
"""``MALLOC_TRIM_THRESHOLD_``: up to 1 GiB of free memory at the heap's top is kept; beyond it is given
back (a one-off peak, such as loading a checkpoint before it moves to a GPU, does not stay resident)."""

_THRESHOLDS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
MALLOC_SETTINGS = (*_THRESHOLDS, "MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST", "MALLOC_PERTURB_", "GLIBC_TUNABLES")
"""The variables by which a user tunes glibc's malloc (passed on to a run's processes as they are)."""


def glibc_version() -> tuple[int, int] | None:
    """This process's glibc as ``(major, minor)``; None where the C library is not glibc."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (ValueError, OSError, AttributeError):
        return None


def malloc_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``environ`` for a run's processes: none where ``environ`` already sets
    malloc's thresholds (a ``MALLOC_*`` threshold variable or ``glibc.malloc`` tunables) or preloads
    another allocator (the user's settings win), nor where glibc is older than 2.35 or absent."""
    glibc = glibc_version()
    if glibc is None or glibc < (2, 35):
        return {}
    if any(k in environ for k in _THRESHOLDS) or "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return {}
    if "malloc" in environ.get("LD_PRELOAD", ""):  # jemalloc / tcmalloc: tuned by their own variables
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
