"""What the hand-written collectives send: the textbook formulas, and what a
compiled program really contains.

Bytes sent per device, for an N-byte buffer on P devices (`bytes_sent_formula`):

    naive    device 0: (P-1) N; the others: N.     max (P-1) N, mean 2(P-1)N/P
    ring     2 (P-1) / P * N on every device        (N split into P chunks)
    tree     log2(P) * N on every device
    a2a      direct: (P-1)/P N; hierarchical (M nodes of L): ((L-1)/L + (M-1)/M) N

`compiled_traffic` reads the same figures back from the optimized HLO's
`collective-permute` ops, after XLA's own optimizations.
"""

from __future__ import annotations

import math
import re

import numpy as np

from meshwork.sharding.all_reduce_algorithms import require_power_of_two

__all__ = ["TRAFFIC_ALGORITHMS", "bytes_sent_formula", "compiled_traffic"]

TRAFFIC_ALGORITHMS = ("naive", "ring", "tree", "direct_all_to_all", "hierarchical_all_to_all")


def bytes_sent_formula(
    algorithm: str, n_bytes: int, n_devices: int, *, n_local: int | None = None, itemsize: int = 1
) -> np.ndarray:
    """Bytes each device sends, per the textbook formula, as an int array of length P.

    `n_bytes` (N) is the size of each device's buffer; entry i is device i
    along the collective's axis (for all-to-all: j = node * L + local).

    - naive: device 0 sends the sum to the P-1 others, (P-1) N; every other
      device sends its buffer once, N. Max (P-1) N; mean 2(P-1)N/P.
    - ring: 2 (P-1) chunks of ceil(N / P) bytes, i.e. 2(P-1)/P * N when P
      divides N. Padding is per element: pass `itemsize` so a chunk is a
      whole number of elements.
    - tree: log2(P) * N (P a power of two).
    - direct_all_to_all: (P-1)/P * N.
    - hierarchical_all_to_all: with L = `n_local` devices per node and
      M = P / L nodes, (L-1)/L * N inside the node + (M-1)/M * N across.

    >>> bytes_sent_formula("ring", 1024, 8).tolist() == [1792] * 8     # 2 * 7/8 * 1024
    True
    >>> bytes_sent_formula("naive", 100, 4).tolist()
    [300, 100, 100, 100]
    >>> int(bytes_sent_formula("hierarchical_all_to_all", 64, 8, n_local=4)[0])  # 3/4*64 + 1/2*64
    80
    """
    n, p = int(n_bytes), int(n_devices)
    if algorithm == "naive":
        return np.array([(p - 1) * n] + [n] * (p - 1), dtype=np.int64)
    if algorithm == "ring":
        if p == 1:
            return np.zeros(1, np.int64)
        if n % itemsize:
            raise ValueError(f"bytes_sent_formula: {n} bytes is not a whole number of {itemsize}-byte elements")
        chunk = -(-(n // itemsize) // p) * itemsize
        return np.full(p, 2 * (p - 1) * chunk, dtype=np.int64)
    if algorithm == "tree":
        require_power_of_two(p, "bytes_sent_formula('tree')")
        return np.full(p, (p.bit_length() - 1) * n, dtype=np.int64)
    if algorithm in ("direct_all_to_all", "hierarchical_all_to_all"):
        if n % p:
            raise ValueError(
                f"bytes_sent_formula: an all-to-all cuts {n} bytes into {p} equal blocks; make N a multiple of {p}"
            )
        if algorithm == "direct_all_to_all":
            return np.full(p, (p - 1) * (n // p), dtype=np.int64)
        if n_local is None or n_local < 1 or p % n_local:
            raise ValueError(
                f"bytes_sent_formula: hierarchical_all_to_all needs n_local, the devices per node, "
                f"dividing {p}; got {n_local}"
            )
        l, m = n_local, p // n_local
        return np.full(p, (l - 1) * (n // l) + (m - 1) * (n // m), dtype=np.int64)
    raise ValueError(f"bytes_sent_formula: unknown algorithm {algorithm!r}; choose one of {TRAFFIC_ALGORITHMS}")


_PERMUTE_RE = re.compile(
    r"=\s*\(?(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\][^=]*?\s"
    r"collective-permute(?:-start)?\((?P<rest>.*)$"
)


def _hlo_itemsize(dtype: str) -> int:
    if dtype == "pred":
        return 1
    bits = re.search(r"\d+", dtype)
    if bits is None:
        raise ValueError(f"compiled_traffic: unknown HLO element type {dtype!r}")
    return max(1, int(bits.group()) // 8)


def compiled_traffic(hlo_text: str, n_devices: int) -> tuple[int, np.ndarray]:
    """(number of collective-permutes, bytes each device sends) read from optimized HLO text.

    Parses every `collective-permute` (or `-start`) op: its payload shape
    and its `source_target_pairs`, whose ids are positions in the program's
    device assignment (`mesh.devices.flat` order for a shard_map over the
    whole mesh). This is what XLA will run, after its own optimizations.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec
    >>> from meshwork.sharding.all_reduce_algorithms import ring_all_reduce
    >>> from meshwork.sharding.mesh import make_mesh
    >>> mesh = make_mesh({"data": -1}); p = mesh.size
    >>> f = jax.jit(jax.shard_map(lambda x: ring_all_reduce(x, "data"), mesh=mesh,
    ...             in_specs=PartitionSpec("data"), out_specs=PartitionSpec("data")))
    >>> count, sent = compiled_traffic(f.lower(jnp.zeros((p, p), jnp.float32)).compile().as_text(), p)
    >>> count == 2 * (p - 1), sent.tolist() == [2 * (p - 1) * 4] * p
    (True, True)
    """
    count, sent = 0, np.zeros(n_devices, dtype=np.int64)
    for line in hlo_text.splitlines():
        if "collective-permute-done" in line:
            continue
        match = _PERMUTE_RE.search(line)
        if match is None:
            continue
        count += 1
        dims = [int(d) for d in match["dims"].split(",") if d]
        nbytes = math.prod(dims) * _hlo_itemsize(match["dtype"])
        pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", match["rest"])
        if pairs is None:
            raise ValueError(f"compiled_traffic: no source_target_pairs in {line.strip()[:120]!r}")
        for s, d in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1)):
            if s != d:
                sent[int(s)] += nbytes
    return count, sent
