"""The tile shape of the row-wise prefill kernel, apart from the kernel: the engine sizes its buffers with it on
every device, and ``prefill_kernel.py`` imports Triton (CUDA only)."""

from __future__ import annotations

QUERY_ROWS = 64  # BLOCK_M x padded group: query rows of one program's tile, the M of its matmuls


def tile_rows(group: int) -> int:
    """Sequence rows per tile (BLOCK_M) for a GQA group: ``QUERY_ROWS`` query rows in all, at least 1."""
    return max(1, QUERY_ROWS // (1 << max(0, group - 1).bit_length()))  # group rounded up to a power of two
