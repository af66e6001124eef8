"""The paged-attention kernel on a real accelerator: relative error against the gather
reference and kernel vs gather time, with the K/V bandwidth the kernel reaches.

    python3 benchmarks/paged_attention_gpu.py          # GPU or TPU; on CPU a tiny smoke size

Not under pytest (tests/conftest.py forces the CPU). B=64 sequences of up to 4096 tokens in
pages of 16, 32 query heads over 8 kv heads of 128, fp32 and bf16, decode (L=1) and a
16-token chunk, without and with a 1024-token window. Then MLA's latent pages (DeepSeek-V3's
shape: one 576-wide latent "head" of kv_lora_rank 512 + RoPE 64 read by 16 query heads, the pool
serving as keys and as values, whose first 512 dims are kept): the kernel against XLA's latent path
over gathered pages (kv_cache.latent_attention), error and time.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from meshwork.engine.kv_cache import latent_attention
from meshwork.kernels.paged_attention import gather_pages, paged_attention, paged_attention_reference


def _time_ms(f, args, reps: int = 20) -> float:
    f(*args).block_until_ready()
    start = time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    out.block_until_ready()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    cpu = jax.default_backend() == "cpu"
    B, H, G, K, T, S = (2, 4, 2, 32, 16, 128) if cpu else (64, 32, 8, 128, 16, 4096)
    pages = S // T
    n_pages = 1 + B * pages
    rng = np.random.default_rng(0)
    for dtype in (jnp.float32, jnp.bfloat16):
        k_pool, v_pool = (jnp.asarray(rng.standard_normal((n_pages, T, G, K)), dtype) for _ in "kv")
        table = jnp.asarray(1 + rng.permutation(B * pages).reshape(B, pages), jnp.int32)
        for L in (1, 16):
            q = jnp.asarray(rng.standard_normal((B, L, H, K)), dtype)
            pos = jnp.asarray(rng.integers(L - 1, S, (B, 1)) - np.arange(L)[::-1], jnp.int32)
            for window in (None, 1024):
                kernel = jax.jit(lambda *a, w=window: paged_attention(*a, window=w))
                gather = jax.jit(lambda *a, w=window: paged_attention_reference(*a, window=w))
                args = (q, k_pool, v_pool, table, pos)
                got, want = (f(*args).astype(jnp.float32) for f in (kernel, gather))
                err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
                t_kernel, t_gather = _time_ms(kernel, args), _time_ms(gather, args)
                kv_bytes = 2 * int(jnp.sum(jnp.minimum(pos[:, -1] + 1, S))) * G * K * jnp.dtype(dtype).itemsize
                print(
                    f"{jnp.dtype(dtype).name} L={L} window={window} B={B} S={S}: rel_err {err:.1e}  "
                    f"kernel {t_kernel:.3f} ms  gather {t_gather:.3f} ms  ratio {t_gather / t_kernel:.2f}  "
                    f"kernel K/V {kv_bytes / t_kernel / 1e6:.0f} GB/s",
                    flush=True,
                )

    latent_pages(cpu, rng)


def latent_pages(cpu: bool, rng: np.random.Generator) -> None:
    """MLA decode over latent pages: the Pallas kernel (keys = values = the pool) vs XLA over gathered pages."""
    B, H, R, C, T, S = (2, 4, 16, 24, 16, 128) if cpu else (64, 16, 512, 576, 16, 4096)
    pages, scale = S // T, C**-0.5
    pool = jnp.asarray(rng.standard_normal((1 + B * pages, T, 1, C)), jnp.bfloat16)
    table = jnp.asarray(1 + rng.permutation(B * pages).reshape(B, pages), jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, 1, H, C)), jnp.bfloat16)
    pos = jnp.asarray(rng.integers(0, S, (B, 1)), jnp.int32)
    kernel = jax.jit(lambda q, p, t, s: paged_attention(q, p, p, t, s, scale=scale)[..., :R])
    xla = jax.jit(lambda q, p, t, s: latent_attention(q, gather_pages(p, t, 0)[:, :, 0], s, scale=scale, values=R))
    args = (q, pool[None], table, pos)
    got, want = (f(*args).astype(jnp.float32) for f in (kernel, xla))
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    t_kernel, t_xla = _time_ms(kernel, args), _time_ms(xla, args)
    latent_bytes = int(jnp.sum(pos[:, 0] + 1)) * C * 2
    print(
        f"mla latent bf16 B={B} S={S} H={H} C={C}: rel_err {err:.1e}  kernel {t_kernel:.3f} ms  "
        f"xla gather {t_xla:.3f} ms  ratio {t_xla / t_kernel:.2f}  latent read once {latent_bytes / t_kernel / 1e6:.0f} GB/s",
        flush=True,
    )


if __name__ == "__main__":
    main()
