"""DeepSpeed warns on every import without a GPU that it falls back to the CPU: expected where no GPU is,
so that line is dropped (every other DeepSpeed message stays)."""

from __future__ import annotations

import logging


def _not_cpu_fallback_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Setting accelerator to CPU")


logging.getLogger("DeepSpeed").addFilter(_not_cpu_fallback_notice)
