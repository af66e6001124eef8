"""What a UNet layer exchanges with the other patch devices under DistriFusion.

DistriFusion (Li et al., 2024) splits the image into n horizontal patches, one
per device of a mesh axis, and runs every layer on its own patch only. Three
kinds of layer need something from the other patches:

    kind   layer                      needs                          exchanged (per device)
    halo   k x k convolution (k > 1)  k//2 rows above and below      collective-permute of its edge rows
    norm   GroupNorm                  the whole image's statistics   all-gather of its (mean, M2) per group
    kv     self-attention             keys/values of every position  all-gather of its patch's K and V

On a synchronous step a layer waits for the exchange and uses what arrives,
which is the single-device computation. On a stale step it uses what arrived
during the previous denoising step (`stale`), with its own patch fresh, and
sends its fresh values for the next step: nothing this step reads the
collectives' results, so they overlap compute.

The UNet layers (meshwork.models.unet) ask `active()` for the exchange of the
forward pass being traced; None means an ordinary, whole-image forward. The
sampler (meshwork.diffusion.distrifusion) sets it around the denoiser call:

    ex = PatchExchange("sequence", n=4, stale=None)    # inside shard_map over "sequence"
    with exchanging(ex):
        out_patch = unet(x_patch, t, labels)
    ex.fresh        # {"000_halo": (top, bottom), "001_norm": ..., ...}: next step's `stale`

Layers are keyed by the order in which the forward pass visits them
("007_kv"), the same on every step since the forward is the same program.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp

F32 = jnp.float32

_ACTIVE: list[PatchExchange] = []  # a stack, so a nested trace restores the outer one


def active() -> PatchExchange | None:
    """The exchange of the patch-parallel forward being traced, or None (whole image)."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def exchanging(exchange: PatchExchange) -> Iterator[PatchExchange]:
    """Makes `exchange` what the UNet layers consult while the block runs (trace time)."""
    _ACTIVE.append(exchange)
    try:
        yield exchange
    finally:
        _ACTIVE.pop()


class PatchExchange:
    """One denoising step's exchanges on this device, which holds patch `axis_index(axis)` of n.

    stale: None for a synchronous step (every layer waits for fresh values), else the
    `fresh` dict of the previous step, from which the other patches' values are taken.
    After the forward, `fresh` holds what this step sent (the next step's `stale`).
    """

    def __init__(self, axis: str, n: int, stale: dict | None = None):
        self.axis, self.n, self.stale = axis, n, stale
        self.index = jax.lax.axis_index(axis)
        self.fresh: dict = {}

    @property
    def synchronous(self) -> bool:
        return self.stale is None

    def _key(self, kind: str) -> str:
        key = f"{len(self.fresh):03d}_{kind}"
        if self.stale is not None and key not in self.stale:
            raise ValueError(
                f"DistriFusion: layer {key} has no activations from the previous step; the "
                "denoiser must visit the same layers on every step"
            )
        return key

    def halo(self, x_BhWC: jax.Array, p: int, stride: int = 1) -> jax.Array:
        """x with p rows of the patch above prepended and p rows of the patch below appended
        (zeros at the image's top and bottom edges, as 'same' padding), for a VALID conv
        over the rows. stride: the conv's; the patch must hold a whole number of strides
        so that the patches' outputs tile the output image without gaps or overlap."""
        h = x_BhWC.shape[1]
        if h % stride or h < p:
            raise ValueError(
                f"DistriFusion: a {h}-row patch cannot feed a stride-{stride}, {2 * p + 1}-row conv "
                f"with aligned patch boundaries; make the image height a multiple of "
                f"{self.n} patches x 2^(resolution levels - 1), or use fewer patches"
            )
        key = self._key("halo")
        n = self.n
        # ppermute leaves zeros on devices with no sender: the image's own border.
        top = jax.lax.ppermute(x_BhWC[:, h - p :], self.axis, [(j, j + 1) for j in range(n - 1)])
        bottom = jax.lax.ppermute(x_BhWC[:, :p], self.axis, [(j + 1, j) for j in range(n - 1)])
        self.fresh[key] = (top, bottom)
        if not self.synchronous:
            top, bottom = self.stale[key]
        return jnp.concatenate([top.astype(x_BhWC.dtype), x_BhWC, bottom.astype(x_BhWC.dtype)], axis=1)

    def group_moments(self, x_BhWUc: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(mean, biased variance) per (batch, group) of the whole image, shaped (B, 1, 1, U, 1)
        (U: the GroupNorm's groups, c: one group's channels).

        Each patch contributes its own mean m_j and sum of squared deviations M2_j (two-pass,
        as the whole-image norm computes them); they combine exactly (Chan et al.):
        mean = avg_j m_j, M2 = sum_j M2_j + c sum_j (m_j - mean)^2 with c values per patch.
        On stale steps the other patches' (m_j, M2_j) are the previous step's, this patch's fresh.
        """
        x = x_BhWUc.astype(F32)
        c = x.shape[1] * x.shape[2] * x.shape[4]
        m = x.mean(axis=(1, 2, 4))
        m2 = jnp.square(x - m[:, None, None, :, None]).sum(axis=(1, 2, 4))
        own_BU2 = jnp.stack([m, m2], axis=-1)
        key = self._key("norm")
        gathered_NBU2 = jax.lax.all_gather(own_BU2, self.axis)
        self.fresh[key] = gathered_NBU2
        if self.synchronous:
            parts = gathered_NBU2
        else:
            parts = self.stale[key].at[self.index].set(own_BU2)
        mean_BU = parts[..., 0].mean(axis=0)
        m2_BU = parts[..., 1].sum(axis=0) + c * jnp.square(parts[..., 0] - mean_BU).sum(axis=0)
        var_BU = m2_BU / (c * self.n)
        return mean_BU[:, None, None, :, None], var_BU[:, None, None, :, None]

    def keys_values(self, k_BlHK: jax.Array, v_BlHK: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(K, V) of every position of the image, (B, L, H, K) each: this patch's fresh, the
        others' fresh on synchronous steps and the previous step's on stale ones."""
        kv_Bl2HK = jnp.stack([k_BlHK, v_BlHK], axis=2)
        key = self._key("kv")
        full_BL2HK = jax.lax.all_gather(kv_Bl2HK, self.axis, axis=1, tiled=True)
        self.fresh[key] = full_BL2HK
        if not self.synchronous:
            l = kv_Bl2HK.shape[1]
            full_BL2HK = jax.lax.dynamic_update_slice_in_dim(
                self.stale[key], kv_Bl2HK.astype(full_BL2HK.dtype), self.index * l, axis=1
            )
        return full_BL2HK[:, :, 0], full_BL2HK[:, :, 1]


def sent_bytes(kind: str, shape: tuple[int, ...], itemsize: int, n: int) -> int:
    """Bytes one device sends for one exchanged value of `kind`, `shape` as stored in `fresh`:
    a halo part (B, p, W, C) goes to one neighbour whole; the gathered (all-gather) values
    hold all n patches, of which this device sends its own share to each of the n - 1 others
    (ring: (n - 1)/n of the gathered size).

    >>> sent_bytes("halo", (2, 1, 16, 32), 4, 4), sent_bytes("kv", (2, 64, 2, 8, 8), 4, 4)
    (4096, 49152)
    """
    size = 1
    for s in shape:
        size *= s
    return size * itemsize if kind == "halo" else (n - 1) * size * itemsize // n
