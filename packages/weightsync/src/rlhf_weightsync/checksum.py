"""Per-piece checksums: the wrapping sum of a byte range read as 64-bit words.

``word_sum(b) = sum_i int64(b[8i : 8i + 8]) mod 2**64``. It runs at memory speed on CPU and GPU
(one vectorised reduction, no Python loop over bytes), is independent of reduction order (integer
addition mod 2**64 is associative), and detects every error confined to one 64-bit word, e.g. any
single flipped or overwritten byte. It is not cryptographic and does not detect two words swapped.
"""

from __future__ import annotations

import torch

__all__ = ["WORD", "align", "word_sum"]

WORD = 8


def align(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


def word_sum(buf: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """0-d int64 tensor: wrapping sum of ``buf[offset : offset + align(nbytes, 8)]`` as int64 words.

    ``buf`` is a flat uint8 tensor; ``offset`` must be a multiple of 8 and the bytes between
    ``offset + nbytes`` and the next multiple of 8 must be deterministic (the packer zeroes them).
    """
    return buf[offset : offset + align(nbytes, WORD)].view(torch.int64).sum()
