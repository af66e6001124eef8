"""Which weights Muon treats as matrices, and how each is laid out as one: read from the logical
names that every weight dimension carries (models give them; sharding/rules.py maps them to mesh axes).

A weight is a stack of matrices when, after its leading stack dimensions (a scanned stack's
`layers`, an MoE layer's `expert`: one matrix per layer and per expert), at least two dimensions
remain and none of them is a vocabulary (the embedding and the head stay with AdamW, as in the
anchors' Muon) or a convolution's taps. The matrix's rows are its input side: the first remaining
dimension, or all but the last when the first is a heads dimension (an attention output
projection, heads x head_dim -> embed); its columns are the rest (embed -> heads x head_dim), so a
fused projection is orthogonalized as the one linear map it is.

    >>> matrix_layout(("layers", "embed", "heads", "head_dim"))
    MatrixLayout(n_batch=1, n_rows=1)
    >>> matrix_layout(("layers", "heads", "head_dim", "embed"))
    MatrixLayout(n_batch=1, n_rows=2)
    >>> matrix_layout(("vocab", "embed")) is None, matrix_layout(("layers", "embed")) is None
    (True, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

STACK_NAMES = ("layers", "expert")
HEAD_NAMES = ("heads", "kv_heads", "linear_heads", "linear_k_heads")
NOT_MATRIX_NAMES = ("vocab", "conv_kw")


class MatrixLayout(NamedTuple):
    n_batch: int
    """Leading dimensions that index the matrices (layers, experts)."""
    n_rows: int
    """The dimensions after them that make the rows (inputs); the rest make the columns (outputs)."""

    def shape(self, shape: Sequence[int]) -> tuple[int, int, int]:
        """(matrices, rows, columns) of a weight of `shape` (global or one device's block)."""
        batch, rows = shape[: self.n_batch], shape[self.n_batch : self.n_batch + self.n_rows]
        return math.prod(batch), math.prod(rows), math.prod(shape[self.n_batch + self.n_rows :])


def matrix_layout(names: Sequence[str | None] | None) -> MatrixLayout | None:
    """The matrix layout of a weight whose dimensions have logical `names`; None: not a matrix."""
    if not names:
        return None
    names = tuple(names)
    n_batch = 0
    while n_batch < len(names) and names[n_batch] in STACK_NAMES:
        n_batch += 1
    rest = names[n_batch:]
    if len(rest) < 2 or any(n in NOT_MATRIX_NAMES or n in STACK_NAMES for n in rest):
        return None
    return MatrixLayout(n_batch, len(rest) - 1 if rest[0] in HEAD_NAMES else 1)
