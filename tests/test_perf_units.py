"""Units of the performance model: the hardware table, rooflines and reliability math.

Pure Python, no devices: every expected value is a hand computation or a
published figure named beside it.
"""

import math

import pytest

from meshwork.config import ConfigError
from meshwork.config_sections import ModelConfig
from meshwork.perf import hardware, reliability, roofline
from meshwork.perf.hardware import HARDWARE, get_hardware
from meshwork.perf.roofline import Op, attention, batched_matmul, bound, elementwise, layout, matmul, reduction

MINUTE, DAY = 60.0, 86400.0
NAMES = ["h100", "h200", "a100", "b200", "tpu_v4", "tpu_v5e", "tpu_v5p", "tpu_v6e"]


# --------------------------------------------------------------------------
# Hardware table
# --------------------------------------------------------------------------


def test_table_has_every_device_with_sane_relations():
    assert set(NAMES) <= set(HARDWARE)
    for name, acc in HARDWARE.items():
        assert acc.name == name
        assert {"bf16", "fp32"} <= set(acc.peak_flops)
        assert acc.peak_flops["fp32"] < acc.peak_flops["bf16"]
        if "fp8" in acc.peak_flops:
            assert acc.peak_flops["fp8"] >= acc.peak_flops["bf16"]
        # memory > fast interconnect > slow interconnect, per device
        assert acc.hbm_bandwidth > acc.intra_node_bandwidth > acc.inter_node_bandwidth
        assert acc.intra_node_latency < acc.inter_node_latency
        assert 1e-7 < acc.intra_node_latency < 1e-4
        assert acc.devices_per_node >= 4
        assert 8e9 < acc.hbm_bytes < 300e9
        assert 50 < acc.ridge_point() < 1000
    # fp8 doubles bf16 on NVIDIA's tensor cores (989.4 -> 1978.9, rounded); A100 has none
    for name in ["h100", "h200", "b200"]:
        assert HARDWARE[name].peak_flops["fp8"] == pytest.approx(2 * HARDWARE[name].peak_flops["bf16"], rel=1e-3)
    assert "fp8" not in HARDWARE["a100"].peak_flops


def test_data_sheet_figures():
    h100, h200 = get_hardware("h100"), get_hardware("h200")
    assert h100.peak_flops["bf16"] == 989e12 and h100.hbm_bandwidth == 3.35e12
    assert h200.peak_flops == h100.peak_flops  # same GH100 compute
    assert (h200.hbm_bytes, h200.hbm_bandwidth) == (141e9, 4.8e12)
    assert h100.intra_node_bandwidth == 900e9 / 2  # NVLink 4, one direction
    assert h100.inter_node_bandwidth == 400e9 / 8  # 400 Gb/s NDR per GPU
    assert get_hardware("tpu_v5e").inter_node_bandwidth == 3.125e9  # 6.4 Tbps per 256-chip pod
    assert get_hardware("tpu_v5p").intra_node_bandwidth == 600e9
    assert get_hardware("tpu_v4").hbm_bytes == 32 * 2**30


def test_ridge_point_h100():
    assert get_hardware("h100").ridge_point("bf16") == pytest.approx(989e12 / 3.35e12)
    assert round(get_hardware("H100").ridge_point()) == 295


def test_unknown_names_are_config_errors():
    with pytest.raises(ConfigError, match="h900") as e:
        get_hardware("h900")
    for name in NAMES:
        assert name in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="fp8"):
        get_hardware("a100").flops("fp8")


def test_legacy_peak_table_still_serves_the_benchmarks():
    assert (
        hardware.accelerator_for_device_kind("NVIDIA H100 80GB HBM3").flops(hardware.table_dtype("bfloat16")) == 989e12
    )
    assert (
        hardware.accelerator_for_device_kind("NVIDIA A100-SXM4-80GB").flops(hardware.table_dtype("float32")) == 156e12
    )
    assert hardware.accelerator_for_device_kind("NVIDIA H100 80GB HBM3").name == "h100"
    assert hardware.accelerator_for_device_kind("TPU v5 lite").name == "tpu_v5e"
    assert hardware.accelerator_for_device_kind("TPU v5").name == "tpu_v5p"
    assert hardware.accelerator_for_device_kind("TPU v6 lite").name == "tpu_v6e"
    assert hardware.accelerator_for_device_kind("cpu") is None


# --------------------------------------------------------------------------
# Roofline
# --------------------------------------------------------------------------


def test_matmul_counts():
    op = matmul(64, 128, 256, dtype="bf16")
    assert op.flops == 2 * 64 * 128 * 256
    assert op.bytes == 2 * (64 * 128 + 128 * 256 + 64 * 256)
    assert matmul(4096, 4096, 4096).intensity == pytest.approx(4096 / 3)
    assert matmul(4096, 4096, 4096, dtype="fp32").intensity == pytest.approx(4096 / 6)
    bmm = batched_matmul(8, 64, 128, 256)
    assert (bmm.flops, bmm.bytes) == (8 * op.flops, 8 * op.bytes)


def test_square_matmul_compute_bound_matvec_and_elementwise_memory_bound():
    h100 = get_hardware("h100")
    big = matmul(8192, 8192, 8192)
    assert big.intensity == pytest.approx(8192 / 3)
    assert bound(big, h100) == "compute"
    assert roofline.attainable_flops(big, h100) == 989e12
    assert roofline.op_time(big, h100) == pytest.approx(big.flops / 989e12)
    decode = matmul(1, 8192, 8192)
    assert decode.intensity == pytest.approx(2 * 8192**2 / (2 * (8192**2 + 2 * 8192)))
    assert bound(decode, h100) == "memory"
    assert roofline.op_time(decode, h100) == pytest.approx(decode.bytes / 3.35e12)
    assert roofline.attainable_flops(decode, h100) == pytest.approx(decode.intensity * 3.35e12)
    add = elementwise(1 << 20, 2)
    assert (add.flops, add.bytes) == (1 << 20, 3 * 2 * (1 << 20))
    assert bound(add, h100) == "memory"
    # the batch at which a weight-stationary bf16 matmul turns compute-bound is
    # about the ridge point (scaling book: B > peak / bandwidth)
    assert bound(matmul(256, 8192, 8192), h100) == "memory"
    assert bound(matmul(512, 8192, 8192), h100) == "compute"


def test_reduction_and_layout():
    r = reduction(1000, 10, dtype="fp32")
    assert (r.flops, r.bytes) == (990, 4 * 1010)
    t = layout(1000)
    assert (t.flops, t.bytes, t.intensity) == (0, 4000, 0)
    assert bound(t, get_hardware("tpu_v5e")) == "memory"
    assert Op("noop", 1.0, 0.0).intensity == math.inf


def test_attention_flash_vs_naive():
    b, h, g, length, k = 2, 8, 2, 1024, 64
    flash = attention(b, h, length, length, k, kv_heads=g)
    assert flash.flops == 4 * b * h * length * length * k
    assert flash.bytes == 2 * (2 * b * length * h * k + 2 * b * length * g * k)
    naive = attention(b, h, length, length, k, kv_heads=g, flash=False)
    assert naive.flops == flash.flops
    assert naive.bytes - flash.bytes == 2 * 4 * b * h * length * length
    causal = attention(b, h, length, length, k, kv_heads=g, causal=True)
    assert (causal.flops, causal.bytes) == (flash.flops / 2, flash.bytes)
    # long sequences: flash grows with L, naive saturates near K / 2
    h100 = get_hardware("h100")
    assert bound(attention(1, 32, 8192, 8192, 128), h100) == "compute"
    naive_long = attention(1, 32, 8192, 8192, 128, flash=False)
    assert naive_long.intensity == pytest.approx(128 / 2, rel=0.02)
    assert bound(naive_long, h100) == "memory"
    # decode: one query against a long cache is memory-bound either way
    assert bound(attention(8, 32, 1, 8192, 128, kv_heads=8), h100) == "memory"


def test_transformer_layer_ops_match_hand_counts():
    cfg = ModelConfig(d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, vocab_size=128256)
    b, s = 4, 2048
    ops = {op.name: op for op in roofline.transformer_layer_ops(cfg, b, s)}
    t, d, f, k = b * s, 4096, 14336, 128
    matmul_flops = 2 * t * d * (32 * k + 2 * 8 * k) + 2 * t * 32 * k * d + 3 * 2 * t * d * f
    assert sum(o.flops for n, o in ops.items() if n.endswith(("proj", "gate", "up", "down"))) == matmul_flops
    assert ops["attention"].flops == 4 * b * 32 * s * s * k / 2
    assert ops["mlp_up"].bytes == 2 * (t * d + d * f + t * f)
    h100 = get_hardware("h100")
    rows = roofline.summarize(list(ops.values()), h100)
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    by = {r["name"]: r["bound"] for r in rows}
    assert by["mlp_up"] == "compute" and by["attn_residual"] == "memory" and by["attn_norm"] == "memory"
    # decode: every projection is a matrix-vector product, memory-bound
    decode = roofline.transformer_layer_ops(cfg, 8, 1)
    assert all(bound(o, h100) == "memory" for o in decode if o.name.endswith(("proj", "up", "down", "gate")))
    assert roofline.lm_head_op(cfg, b, s).flops == 2 * t * d * 128256


def test_dtype_names_and_errors():
    h100 = get_hardware("h100")
    op = matmul(8192, 8192, 8192, dtype="fp8")
    assert roofline.op_time(op, h100, "fp8") == pytest.approx(op.flops / 1979e12)
    assert roofline.peak(h100, "bfloat16") == 989e12
    with pytest.raises(ConfigError, match="int4"):
        matmul(1, 1, 1, dtype="int4")
    with pytest.raises(ConfigError, match="fp8"):
        roofline.op_time(op, get_hardware("tpu_v4"), "fp8")


def test_roofline_plot_writes_png(tmp_path):
    ops = roofline.transformer_layer_ops(ModelConfig(), 8, 128)
    path = roofline.roofline_plot(ops, get_hardware("h100"), str(tmp_path / "roof.png"))
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------
# Reliability
# --------------------------------------------------------------------------


def test_cluster_mttf_10k_gpus():
    # an example: 10,000 GPUs that each fail once in 100 days
    assert reliability.cluster_mttf(100 * DAY, 10_000) == pytest.approx(14.4 * MINUTE)
    assert reliability.expected_failures(30 * DAY, 100 * DAY, 10_000) == pytest.approx(3000)
    with pytest.raises(ConfigError, match="n_devices"):
        reliability.cluster_mttf(100 * DAY, 0)


def test_young_and_daly_intervals():
    c, m = 1 * MINUTE, 14.4 * MINUTE
    assert reliability.young_interval(c, m) == pytest.approx(math.sqrt(2 * 1 * 14.4) * MINUTE)
    assert reliability.young_interval(c, m) / MINUTE == pytest.approx(5.367, abs=1e-3)
    # Daly by hand: x = C / 2M = 1 / 28.8
    x = 1 / 28.8
    expected = math.sqrt(28.8) * (1 + math.sqrt(x) / 3 + x / 9) - 1
    assert reliability.daly_interval(c, m) / MINUTE == pytest.approx(expected)
    assert reliability.daly_interval(c, m) / MINUTE == pytest.approx(4.721, abs=1e-3)
    # Daly 2006, figures 3-5 (C = 5 min): 117 min at M = 24 h, 57 at 6 h, 9.1 at 15 min
    assert reliability.daly_interval(5, 24 * 60) == pytest.approx(117, abs=0.5)
    assert reliability.daly_interval(5, 6 * 60) == pytest.approx(57, abs=0.5)
    assert reliability.daly_interval(5, 15) == pytest.approx(9.1, abs=0.05)
    assert reliability.daly_interval(30, 10) == 10  # C >= 2M: checkpoint once per MTTF
    # Young and Daly agree when C << M
    assert reliability.daly_interval(1, 1e6) == pytest.approx(reliability.young_interval(1, 1e6), rel=1e-3)


@pytest.mark.parametrize("c, m, r", [(1, 14.4, 0), (1, 14.4, 2), (5, 15, 10), (5, 360, 10), (0.5, 600, 5)])
def test_goodput_peaks_at_the_optimal_interval(c, m, r):
    taus = [m * i / 20000 for i in range(1, 60000)]
    daly = max(taus, key=lambda t: reliability.goodput(t, c, m, r))
    assert daly == pytest.approx(reliability.daly_interval(c, m), rel=0.01)
    first = max(taus, key=lambda t: reliability.goodput(t, c, m, r, model="first_order"))
    assert first == pytest.approx(math.sqrt(2 * c * (m - r)) - c, rel=0.01, abs=m / 20000)
    # Young's interval is near-optimal: within 3% of the best goodput when C << M
    if c / m < 0.01:
        best = reliability.goodput(daly, c, m, r)
        assert reliability.goodput(reliability.young_interval(c, m), c, m, r) > 0.97 * best


def test_goodput_values():
    # no failures in sight: only the checkpoint overhead tau / (tau + C) is lost
    assert reliability.goodput(100, 1, 1e12) == pytest.approx(100 / 101, rel=1e-6)
    assert reliability.goodput(100, 1, 1e12, model="first_order") == pytest.approx(100 / 101, rel=1e-6)
    # first order by hand: tau=4, C=1, M=14.4, R=2
    assert reliability.goodput(4, 1, 14.4, 2, model="first_order") == pytest.approx(4 / 5 * (1 - (2 + 2.5) / 14.4))
    # the two models agree when everything is small against M
    assert reliability.goodput(60, 1, 1e5, 5) == pytest.approx(
        reliability.goodput(60, 1, 1e5, 5, model="first_order"), rel=1e-3
    )
    assert reliability.goodput(283, 60, 864, 120) == pytest.approx(0.585, abs=0.001)
    with pytest.raises(ConfigError, match="model"):
        reliability.goodput(1, 1, 1, model="weibull")
