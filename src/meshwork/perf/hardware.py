"""Accelerator data sheets for planning, and peak FLOP/s of the local device.

`HARDWARE` maps a short name to an `Accelerator`: per-device dense peak FLOP/s
by dtype, memory size and bandwidth, and the two interconnect tiers (inside a
node and between nodes). The planner (memory, communication, step time) and
the roofline model (`meshwork.perf.roofline`) read it; nothing here needs a device.

    >>> h100 = get_hardware("h100")
    >>> round(h100.ridge_point("bf16"))      # FLOPs per HBM byte
    295

Conventions, the same for every row:
- FLOP/s are dense (no 2:4 sparsity) matrix-unit peaks per device as JAX sees
  it (one GPU, one TPU chip). "fp32" is what an fp32 matmul gets by default:
  TF32 tensor cores on NVIDIA (XLA's default precision for fp32 dots there),
  an assumed half of bf16 on TPU (see the TPU rows).
- Bandwidths are bytes/s in ONE direction per device. Vendors quote NVLink as
  the bidirectional sum (900 GB/s on H100 = 450 GB/s each way) and networks in
  bits/s (400 Gb/s = 50 GB/s).
- A "node" is the fast-interconnect domain: an 8-GPU NVLink server, or for
  TPUs the ICI-connected slice (a pod), with the data-center network (DCN)
  between slices.
- Latencies are assumptions (order of magnitude, per collective hop), not data
  sheet figures: vendors do not publish them.

`peak_flops_per_device()` (used by the training loop for MFU) looks the local
device up by its `device_kind`, or measures a CPU matmul once per process.
"""

from __future__ import annotations

import dataclasses
import functools
import time

from meshwork.config import ConfigError

TB = 1e12
GB = 1e9
GiB = 2**30
US = 1e-6


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One device's data sheet. Example: `get_hardware("h100").peak_flops["bf16"]` is 989e12."""

    name: str
    peak_flops: dict[str, float]
    """Dense FLOP/s per device by dtype: "bf16", "fp32" and, where supported, "fp8"."""
    hbm_bytes: float
    """Device memory, bytes."""
    hbm_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    intra_node_bandwidth: float
    """Bytes/s per device, one direction, inside a node (NVLink / ICI)."""
    intra_node_latency: float
    """Seconds per collective hop inside a node (assumed)."""
    inter_node_bandwidth: float
    """Bytes/s per device, one direction, between nodes (InfiniBand / DCN)."""
    inter_node_latency: float
    """Seconds per collective hop between nodes (assumed)."""
    devices_per_node: int
    """Devices that share the intra-node interconnect."""
    host_link_bandwidth: float = 0.0
    """Bytes/s per device, one direction, between device and host memory (PCIe); 0: not in the
    table. What host offload (train.offload) streams at."""

    def ridge_point(self, dtype: str = "bf16") -> float:
        """Arithmetic intensity (FLOPs per HBM byte) above which a kernel is compute-bound.

        ridge = peak_flops[dtype] / hbm_bandwidth (Williams et al. 2009, "Roofline").
        Example: H100 bf16 989e12 / 3.35e12 = 295 FLOPs/byte.
        """
        return self.flops(dtype) / self.hbm_bandwidth

    def flops(self, dtype: str = "bf16") -> float:
        """Peak dense FLOP/s for `dtype`, or a ConfigError naming the dtypes this device has."""
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise ConfigError(f"{self.name} has no {dtype!r} peak; choose one of {sorted(self.peak_flops)}") from None


# Latencies per collective hop: ASSUMPTIONS, not data-sheet figures (vendors
# publish none). An ICI hop is ~1 us (the scaling book's worked example uses
# 0.5 us per v5e hop); an NVLink hop through NVSwitch is a few us once the
# kernel's synchronization is counted; InfiniBand and DCN hops add NICs and
# switches. Good enough to tell latency-bound small collectives from
# bandwidth-bound large ones; measure before trusting the absolute value.
_NVLINK_LATENCY = 2 * US
_IB_LATENCY = 5 * US
_ICI_LATENCY = 1 * US
_DCN_LATENCY = 10 * US

HARDWARE: dict[str, Accelerator] = {
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): BF16 1,979 TFLOPS
    # and FP8 3,958 TFLOPS "with sparsity", so dense is half: 989 / 1,979;
    # TF32 989 with sparsity -> 494 dense. 80 GB HBM3 at 3.35 TB/s. NVLink 4:
    # 900 GB/s (bidirectional sum) -> 450 GB/s each way. DGX H100 user guide:
    # 8 GPUs per node, one 400 Gb/s ConnectX-7 (InfiniBand NDR) per GPU -> 50 GB/s.
    # The JAX scaling book's GPU chapter uses the same: GPU egress 450e9 B/s,
    # node egress 400e9 B/s (8 x 50e9).
    "h100": Accelerator(
        name="h100",
        peak_flops={"bf16": 989 * TB, "fp8": 1979 * TB, "fp32": 494 * TB},
        hbm_bytes=80 * GB,
        hbm_bandwidth=3.35 * TB,
        intra_node_bandwidth=450 * GB,
        intra_node_latency=_NVLINK_LATENCY,
        inter_node_bandwidth=50 * GB,
        inter_node_latency=_IB_LATENCY,
        devices_per_node=8,
        host_link_bandwidth=64 * GB,  # PCIe 5.0 x16: 64 GB/s each way
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): the H100's compute
    # (BF16 1,979 / FP8 3,958 TFLOPS with sparsity), 141 GB HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s. DGX H200: 8 GPUs, 400 Gb/s ConnectX-7 per GPU.
    "h200": Accelerator(
        name="h200",
        peak_flops={"bf16": 989 * TB, "fp8": 1979 * TB, "fp32": 494 * TB},
        hbm_bytes=141 * GB,
        hbm_bandwidth=4.8 * TB,
        intra_node_bandwidth=450 * GB,
        intra_node_latency=_NVLINK_LATENCY,
        inter_node_bandwidth=50 * GB,
        inter_node_latency=_IB_LATENCY,
        devices_per_node=8,
        host_link_bandwidth=64 * GB,  # PCIe 5.0 x16: 64 GB/s each way
    ),
    # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): BF16 312 TFLOPS
    # dense (624 sparse), TF32 156 dense; no FP8. 80 GB HBM2e at 2,039 GB/s.
    # NVLink 3: 600 GB/s bidirectional -> 300 each way. DGX A100: 8 GPUs, one
    # 200 Gb/s ConnectX-6 (InfiniBand HDR) per GPU -> 25 GB/s.
    "a100": Accelerator(
        name="a100",
        peak_flops={"bf16": 312 * TB, "fp32": 156 * TB},
        hbm_bytes=80 * GB,
        hbm_bandwidth=2.039 * TB,
        intra_node_bandwidth=300 * GB,
        intra_node_latency=_NVLINK_LATENCY,
        inter_node_bandwidth=25 * GB,
        inter_node_latency=_IB_LATENCY,
        devices_per_node=8,
    ),
    # NVIDIA HGX B200 (Blackwell datasheet, HGX B200 column, per GPU): FP8
    # 9 PFLOPS and BF16 4.5 PFLOPS with sparsity -> 4.5 / 2.25 dense; TF32 2.2
    # sparse -> 1.1 dense. 180 GB HBM3e per GPU as systems expose it (DGX B200:
    # 1,440 GB for 8 GPUs; 192 GB is the raw stack capacity) at 8 TB/s. NVLink 5: 1.8 TB/s bidirectional
    # -> 900 GB/s each way. DGX B200: 8x 400 Gb/s ConnectX-7 -> 50 GB/s per GPU
    # (scaling book GPU chapter: GPU egress 900e9, node egress 400e9 B/s).
    "b200": Accelerator(
        name="b200",
        peak_flops={"bf16": 2250 * TB, "fp8": 4500 * TB, "fp32": 1100 * TB},
        hbm_bytes=180 * GB,
        hbm_bandwidth=8 * TB,
        intra_node_bandwidth=900 * GB,
        intra_node_latency=_NVLINK_LATENCY,
        inter_node_bandwidth=50 * GB,
        inter_node_latency=_IB_LATENCY,
        devices_per_node=8,
    ),
    # Google Cloud TPU docs, "TPU v4" page: 275 TFLOPS bf16 per chip (int8 the
    # same: no faster low-precision path, so no fp8 key), 32 GiB HBM2 at
    # 1,200 GB/s, 4,096 chips per pod in a 3D torus (6 ICI links per chip).
    # ICI: the JAX scaling book (part 2, "How to think about TPUs", interconnect
    # table) gives 4.5e10 B/s one way per link for v4p -> 6 x 45 = 270 GB/s.
    # DCN: the scaling book's "around 2.5e10 bytes/s per host" over the 4 chips
    # of a v4 host -> 6.25 GB/s per chip.
    # fp32 (all TPU rows): assumed half of bf16. XLA runs an fp32 dot as several
    # bf16 MXU passes (1 at DEFAULT precision, up to 6 at HIGHEST); no data sheet
    # gives a figure.
    "tpu_v4": Accelerator(
        name="tpu_v4",
        peak_flops={"bf16": 275 * TB, "fp32": 275 * TB / 2},
        hbm_bytes=32 * GiB,
        hbm_bandwidth=1.2 * TB,
        intra_node_bandwidth=6 * 45 * GB,
        intra_node_latency=_ICI_LATENCY,
        inter_node_bandwidth=25 * GB / 4,
        inter_node_latency=_DCN_LATENCY,
        devices_per_node=4096,
    ),
    # Google Cloud TPU docs, "TPU v5e" page: 197 TFLOPS bf16 per chip (393 TOPS
    # int8, no fp8), 16 GB HBM2 at 819 GB/s, 400 GB/s bidirectional ICI per chip
    # (4 ports, 2D torus) -> 200 GB/s each way, 256 chips per pod, 8 chips per
    # host with 2 x 100 Gbps NICs -> 25 GB/s per host = 3.125 GB/s per chip (the
    # page's 6.4 Tbps DCN per 256-chip pod gives the same).
    "tpu_v5e": Accelerator(
        name="tpu_v5e",
        peak_flops={"bf16": 197 * TB, "fp32": 197 * TB / 2},
        hbm_bytes=16 * GB,
        hbm_bandwidth=819 * GB,
        intra_node_bandwidth=400 * GB / 2,
        intra_node_latency=_ICI_LATENCY,
        inter_node_bandwidth=2 * 100e9 / 8 / 8,
        inter_node_latency=_DCN_LATENCY,
        devices_per_node=256,
    ),
    # Google Cloud TPU docs, "TPU v5p" page: 459 TFLOPS bf16 per chip and "FP8
    # 459 TFLOPS" (accepted, but no faster than bf16), 95 GB HBM2e at 2,765 GB/s,
    # 1,200 GB/s bidirectional ICI per chip (6 ports, 3D torus) -> 600 GB/s each
    # way, 8,960 chips per pod, DCN 50 Gbps per chip -> 6.25 GB/s.
    "tpu_v5p": Accelerator(
        name="tpu_v5p",
        peak_flops={"bf16": 459 * TB, "fp8": 459 * TB, "fp32": 459 * TB / 2},
        hbm_bytes=95 * GB,
        hbm_bandwidth=2.765 * TB,
        intra_node_bandwidth=1200 * GB / 2,
        intra_node_latency=_ICI_LATENCY,
        inter_node_bandwidth=50e9 / 8,
        inter_node_latency=_DCN_LATENCY,
        devices_per_node=8960,
    ),
    # Google Cloud TPU docs, "TPU v6e" (Trillium) page: 918 TFLOPS bf16 per chip
    # (1,836 TOPS int8; no fp8 figure), 32 GB HBM at 1,638 GB/s, 800 GB/s
    # bidirectional ICI per chip (4 ports, 2D torus) -> 400 GB/s each way, 256
    # chips per pod, 8 chips per host. DCN: not on the page we could read;
    # assumed the scaling book's ~2.5e10 B/s per host -> 3.125 GB/s per chip.
    "tpu_v6e": Accelerator(
        name="tpu_v6e",
        peak_flops={"bf16": 918 * TB, "fp32": 918 * TB / 2},
        hbm_bytes=32 * GB,
        hbm_bandwidth=1.638 * TB,
        intra_node_bandwidth=800 * GB / 2,
        intra_node_latency=_ICI_LATENCY,
        inter_node_bandwidth=25 * GB / 8,
        inter_node_latency=_DCN_LATENCY,
        devices_per_node=256,
    ),
}


def get_hardware(name: str) -> Accelerator:
    """The `Accelerator` called `name` (case-insensitive), e.g. `get_hardware("h100")`.

    Raises ConfigError naming the valid names.
    """
    try:
        return HARDWARE[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown accelerator {name!r}; choose one of: {', '.join(HARDWARE)}") from None


# --------------------------------------------------------------------------
# The local device (used by the training loop and benchmarks)
# --------------------------------------------------------------------------

# jax device_kind substring -> table row, most specific first ("TPU v5" is a v5p,
# "TPU v5 lite" a v5e, "TPU v6 lite" a v6e).
_DEVICE_KINDS = [
    ("H200", "h200"),
    ("H100", "h100"),
    ("A100", "a100"),
    ("B200", "b200"),
    ("TPU v4", "tpu_v4"),
    ("TPU v5 lite", "tpu_v5e"),
    ("TPU v5e", "tpu_v5e"),
    ("TPU v5p", "tpu_v5p"),
    ("TPU v5", "tpu_v5p"),
    ("TPU v6 lite", "tpu_v6e"),
    ("TPU v6e", "tpu_v6e"),
]
_JAX_DTYPES = {"bfloat16": "bf16", "float32": "fp32", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}


def table_dtype(dtype: str) -> str:
    """The table's dtype key ("bf16", "fp32", "fp8") for a jax dtype name ("bfloat16", ...)."""
    return _JAX_DTYPES.get(dtype, dtype)


def accelerator_for_device_kind(device_kind: str) -> Accelerator | None:
    """The table row for a jax `device.device_kind` such as "NVIDIA H100 80GB HBM3", or None."""
    for kind, row in _DEVICE_KINDS:
        if kind.lower() in device_kind.lower():
            return HARDWARE[row]
    return None


def measure_cpu_peak(dtype: str = "float32", n: int = 1024, repeats: int = 5, accumulate: str | None = None) -> float:
    """FLOP/s of one n x n matmul on the first CPU device, best of `repeats`.

    `accumulate`: the product's dtype when it differs from the inputs' (e.g.
    bfloat16 inputs accumulated in float32). XLA's CPU devices share one
    thread pool, so with several (fake) devices in a process the per-device
    peak is this figure divided by their number.
    """
    import jax
    import jax.numpy as jnp

    cpu = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((n, n), dtype), cpu)
    f = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=accumulate))
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


@functools.cache
def _cpu_peak_of_this_process(dtype: str) -> float:
    # Once per process: every run in it (a notebook's several, a test session's hundred) divides
    # by the same read, and none pays the matmul and its compile again.
    return measure_cpu_peak(dtype)


def peak_flops_per_device(dtype: str = "float32", device=None) -> tuple[float, str]:
    """(peak FLOP/s of one local device, where the figure came from); dtype is a jax name.
    KeyError for an accelerator whose device kind the table has no row for."""
    import jax

    dev = device or jax.local_devices()[0]
    if dev.platform == "cpu":
        return _cpu_peak_of_this_process(dtype) / jax.local_device_count(), "cpu (measured matmul / local devices)"
    acc = accelerator_for_device_kind(dev.device_kind)
    if acc is None:
        raise KeyError(f"no peak FLOP/s for device kind {dev.device_kind!r}; add it to meshwork/perf/hardware.py")
    return acc.peak_flops[table_dtype(dtype)], f"{acc.name} table"


def device_memory_bytes(device=None) -> int:
    """Memory one device can use: what the runtime reports (GPU, TPU), else, on the CPU backend,
    the host's physical memory shared by its local devices."""
    import os

    import jax

    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except (AttributeError, jax.errors.JaxRuntimeError):  # backends and devices that keep no statistics
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // max(1, jax.local_device_count(device.platform))
