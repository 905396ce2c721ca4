"""Token-budget batching, shared by the three stages (cache build, training, decoding)."""

from __future__ import annotations

import numpy as np

from prlmfuse.errors import UserError


def token_budget_batches(order: np.ndarray, sizes: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Cut `order` (item indices, already in the order wanted) into consecutive batches.

    A batch's padded size is its item count times the largest `sizes[i]` in it, and stays within
    `max_tokens`; an item larger than the budget gets a batch of its own.
    """
    if max_tokens < 1:
        raise UserError(f"max_tokens must be >= 1, got {max_tokens}")
    order = np.asarray(order, dtype=np.int64)
    batches: list[np.ndarray] = []
    start, longest = 0, 0
    for pos, i in enumerate(order.tolist()):
        size = int(sizes[i])
        if pos > start and (pos - start + 1) * max(longest, size) > max_tokens:
            batches.append(order[start:pos])
            start, longest = pos, 0
        longest = max(longest, size)
    if start < len(order):
        batches.append(order[start:])
    return batches
