"""Compute-communication overlap (sharding/overlap.py): the XLA options this
jaxlib knows, what XLA:CPU does with them, and the schedule reader on CPU
programs and on a scheduled GPU excerpt."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from meshwork.sharding.hlo import collective_summary
from meshwork.sharding.overlap import (
    async_collective_schedule,
    compiler_options,
    format_schedule,
    gradients_issued_before_backward_end,
)

L, D = 6, 32  # a 6-layer MLP: 12 gradient arrays
NO_COMBINER = {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}


def comm(overlap=False, combine_threshold_bytes=None, xla_options=None):
    return SimpleNamespace(
        overlap=overlap, combine_threshold_bytes=combine_threshold_bytes, xla_options=xla_options or {}
    )


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


def _mlp_step(mesh):
    """A data-parallel SGD step of a small MLP: parameters replicated, batch split."""
    rep, dat = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = [
        {
            "w": jax.ShapeDtypeStruct((D, D), jnp.float32, sharding=rep),
            "b": jax.ShapeDtypeStruct((D,), jnp.float32, sharding=rep),
        }
        for _ in range(L)
    ]
    x = jax.ShapeDtypeStruct((64, D), jnp.float32, sharding=dat)

    def loss(ps, x_BD):
        h = x_BD
        for p in ps:
            h = jnp.tanh(h @ p["w"] + p["b"])
        return (h**2).mean()

    def step(ps, x_BD):
        grads = jax.grad(loss)(ps, x_BD)
        return jax.tree.map(lambda p, g: p - 0.1 * g, ps, grads)

    return jax.jit(step, out_shardings=rep), (params, x)


@pytest.fixture(scope="module")
def mlp_lowered(mesh):
    step, args = _mlp_step(mesh)
    return step.lower(*args)


# ---------------------------------------------------------------------------
# Option names.


def test_options_are_known_to_this_jaxlib(mlp_lowered):
    """GPU names are DebugOptions fields, so compiling for CPU parses (and ignores)
    them: a renamed or removed flag fails here although no GPU is present."""
    for platform in ("cpu", "gpu"):
        opts = compiler_options(comm(overlap=True, combine_threshold_bytes=1 << 20), platform)
        assert opts
        mlp_lowered.compile(compiler_options=opts)
    gpu = compiler_options(comm(overlap=True, combine_threshold_bytes=1 << 20), "cuda")
    assert gpu["xla_gpu_enable_latency_hiding_scheduler"] is True
    # The collective pipeliner, under the names this jaxlib knows (booleans in 0.10, enums in 0.12).
    assert sum("pipeline" in name for name in gpu) == 3
    assert gpu["xla_gpu_reduce_scatter_combine_threshold_bytes"] == 1 << 20
    # The "overlap off" arm of a GPU comparison.
    mlp_lowered.compile(
        compiler_options={
            "xla_gpu_disable_async_collectives": "ALLCOLLECTIVES",
            "xla_gpu_enable_latency_hiding_scheduler": False,
        }
    )


@pytest.mark.parametrize(
    "name",
    ["xla_gpu_enable_async_all_reduce", "xla_gpu_enable_async_all_gather", "xla_tpu_enable_latency_hiding_scheduler"],
)
def test_names_this_jaxlib_rejects(mlp_lowered, name):
    """The old async switches are gone; TPU flags live in libtpu, not in DebugOptions,
    which is why compiler_options passes them for TPU only."""
    with pytest.raises(Exception, match="No such compile option"):
        mlp_lowered.compile(compiler_options={name: True})


def test_platform_gating_and_overrides():
    assert compiler_options(comm(), "cpu") == {}
    cpu = compiler_options(comm(overlap=True, combine_threshold_bytes=1024), "cpu")
    assert not any(k.startswith(("xla_gpu", "xla_tpu")) for k in cpu)
    assert not any(k.startswith("xla_gpu") for k in compiler_options(comm(overlap=True), "tpu"))
    user = compiler_options(comm(overlap=True, xla_options={"xla_gpu_enable_latency_hiding_scheduler": False}), "gpu")
    assert user["xla_gpu_enable_latency_hiding_scheduler"] is False  # comm.xla_options win
    with pytest.raises(ValueError, match="unknown platform 'metal'"):
        compiler_options(comm(), "metal")


# ---------------------------------------------------------------------------
# What XLA:CPU does.


def test_cpu_combines_all_reduces_by_count_not_by_threshold(mesh):
    """XLA:CPU's all-reduce combiner has a fixed limit of 256 operands and no byte
    limit; the combine-threshold options do not change it, disabling the pass does."""
    n = 300
    xs = [jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P("data"))) for _ in range(n)]
    lowered = jax.jit(lambda xs: [x.sum(0) for x in xs], out_shardings=NamedSharding(mesh, P())).lower(xs)

    def all_reduces(opts):
        return collective_summary(lowered.compile(compiler_options=opts).as_text())["all-reduce"]

    default = all_reduces({})
    tiny = all_reduces(
        {**compiler_options(comm(combine_threshold_bytes=1), "gpu"), "xla_gpu_collective_combine_threshold_count": 1}
    )
    separate = all_reduces(NO_COMBINER)
    assert default["count"] == tiny["count"] == 2  # 256 + 44 operands
    assert separate["count"] == n
    assert default["payload_bytes"] == separate["payload_bytes"] == n * 4 * 4  # same data, fewer messages


def test_cpu_has_no_async_collectives(mlp_lowered):
    for opts in (compiler_options(comm(overlap=True), "cpu"), compiler_options(comm(overlap=True), "gpu"), NO_COMBINER):
        text = mlp_lowered.compile(compiler_options=opts).as_text()
        schedule = async_collective_schedule(text)
        assert schedule and not any(c.is_async for c in schedule)
        assert "all-reduce-start" not in text and "async-start" not in text


def test_gradient_all_reduces_issued_during_backward_only_without_the_combiner(mlp_lowered):
    """Default CPU: one combined all-reduce of all 12 gradients after the backward
    pass (one bucket the size of the model). Without the combiner (one bucket per
    gradient) the scheduler issues each layer's all-reduces as soon as its
    gradients exist, between the remaining layers' backward ops."""
    combined = async_collective_schedule(mlp_lowered.compile().as_text())
    assert [(c.kind, c.gradient, c.before_backward_end) for c in combined] == [("all-reduce", True, False)]
    assert not gradients_issued_before_backward_end(mlp_lowered.compile().as_text())

    text = mlp_lowered.compile(compiler_options=NO_COMBINER).as_text()
    separate = async_collective_schedule(text)
    assert len(separate) == 2 * L and all(c.gradient for c in separate)
    early = [c for c in separate if c.before_backward_end]
    assert len(early) >= 2 * (L - 1)  # all but the first layer's (the last to be computed)
    assert separate[0].backward_compute_after > separate[-1].backward_compute_after == 0
    assert gradients_issued_before_backward_end(text)
    assert "gradient" in format_schedule(separate)


def test_lm_train_step_reduces_layer_gradients_inside_the_backward_loop(tmp_path):
    """The Trainer's scanned dp step: each layer's gradients are all-reduced in the
    backward while body (once per layer), so before the backward pass ends."""
    from conftest import ROOT, tiny_overrides

    from meshwork.config import load_config
    from meshwork.train.trainer import build_trainer, check_runtime

    cfg = load_config(ROOT / "configs/lm_tiny.yaml", [*tiny_overrides(tmp_path), "mesh.data=8", "rules.preset=dp"])
    trainer = build_trainer(cfg, check_runtime(cfg, None)).compile()
    schedule = async_collective_schedule(trainer.step_fn.as_text())
    in_loop = [c for c in schedule if c.gradient and c.in_loop == cfg.model.n_layers]
    assert in_loop and all(c.before_backward_end for c in in_loop)


# ---------------------------------------------------------------------------
# GPU: lowering only (compiling for cuda needs a GPU), and the reader on a
# scheduled GPU excerpt.


def test_train_step_lowers_for_gpu(mesh):
    step, args = _mlp_step(mesh)
    lowered = step.trace(*args).lower(lowering_platforms=("cuda",))
    assert "mhlo.num_partitions = 8" in lowered.as_text()


# A data-parallel 2-layer step as XLA:GPU schedules it with the latency-hiding
# scheduler (is_scheduled=true; instructions in execution order): the layer-2
# weight gradient's all-reduce starts before layer 1's backward gemms and ends
# after them; an FSDP-style reduce-scatter of layer 1's gradient is an
# async-start wrapping a reduce-scatter; a forward all-gather prefetch and a
# collective-permute pair; the loss all-reduce is synchronous.
GPU_HLO = r"""HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[32,32]{1,0}, f32[32,32]{1,0}, f32[8,32]{1,0})->(f32[32,32]{1,0}, f32[4,32]{1,0})}, num_partitions=8

%region_0.1 (Arg_0.2: f32[], Arg_1.3: f32[]) -> f32[] {
  %Arg_0.2 = f32[] parameter(0)
  %Arg_1.3 = f32[] parameter(1)
  ROOT %add.4 = f32[] add(%Arg_0.2, %Arg_1.3)
}

%fused_tanh (param_0: f32[8,32]) -> f32[8,32] {
  %param_0 = f32[8,32]{1,0} parameter(0)
  ROOT %tanh.1 = f32[8,32]{1,0} tanh(%param_0)
}

%fused_tanh_grad (param_0.1: f32[8,32], param_1.1: f32[8,32]) -> f32[8,32] {
  %param_0.1 = f32[8,32]{1,0} parameter(0)
  %param_1.1 = f32[8,32]{1,0} parameter(1)
  ROOT %multiply.2 = f32[8,32]{1,0} multiply(%param_0.1, %param_1.1)
}

%fused_sgd (param_0.2: f32[32,32], param_1.2: f32[32,32]) -> f32[32,32] {
  %param_0.2 = f32[32,32]{1,0} parameter(0)
  %param_1.2 = f32[32,32]{1,0} parameter(1)
  ROOT %subtract.3 = f32[32,32]{1,0} subtract(%param_0.2, %param_1.2)
}

%async_computation (param_0.5: f32[32,32]) -> f32[4,32] {
  %param_0.5 = f32[32,32]{1,0} parameter(0)
  ROOT %reduce-scatter.1 = f32[4,32]{1,0} reduce-scatter(%param_0.5), channel_id=3, replica_groups=[1,8]<=[8], use_global_device_ids=true, dimensions={0}, to_apply=%region_0.1
}

ENTRY %main.40_spmd (param: f32[32,32], param.1: f32[4,32], param.2: f32[8,32]) -> (f32[32,32], f32[4,32]) {
  %param.2 = f32[8,32]{1,0} parameter(2), sharding={devices=[8,1]<=[8]}, metadata={op_name="x"}
  %param.1 = f32[4,32]{1,0} parameter(1), sharding={devices=[8,1]<=[8]}, metadata={op_name="ps[0]"}
  %param = f32[32,32]{1,0} parameter(0), sharding={replicated}, metadata={op_name="ps[1]"}
  %all-gather-start = (f32[4,32]{1,0}, f32[32,32]{1,0}) all-gather-start(%param.1), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/jvp()/all_gather"}, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"collective_backend_config":{"is_sync":false,"no_parallel_custom_call":false,"is_pipelined":false},"force_earliest_schedule":false}
  %collective-permute-start = (f32[8,32]{1,0}, f32[8,32]{1,0}) collective-permute-start(%param.2), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}, metadata={op_name="jit(step)/jvp()/ppermute"}
  %all-gather-done = f32[32,32]{1,0} all-gather-done(%all-gather-start), metadata={op_name="jit(step)/jvp()/all_gather"}
  %custom-call.1 = (f32[8,32]{1,0}, s8[4194304]{0}) custom-call(%param.2, %all-gather-done), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/jvp()/dot_general"}, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %get-tuple-element.1 = f32[8,32]{1,0} get-tuple-element(%custom-call.1), index=0
  %tanh_fusion = f32[8,32]{1,0} fusion(%get-tuple-element.1), kind=kLoop, calls=%fused_tanh, metadata={op_name="jit(step)/jvp()/tanh"}
  %collective-permute-done = f32[8,32]{1,0} collective-permute-done(%collective-permute-start), metadata={op_name="jit(step)/jvp()/ppermute"}
  %custom-call.2 = (f32[8,32]{1,0}, s8[4194304]{0}) custom-call(%tanh_fusion, %param), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/jvp()/dot_general"}
  %get-tuple-element.2 = f32[8,32]{1,0} get-tuple-element(%custom-call.2), index=0
  %loss = f32[] all-reduce(%get-tuple-element.2), channel_id=4, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%region_0.1, metadata={op_name="jit(step)/jvp()/reduce_sum"}
  %custom-call.3 = (f32[32,32]{1,0}, s8[4194304]{0}) custom-call(%tanh_fusion, %collective-permute-done), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
  %get-tuple-element.3 = f32[32,32]{1,0} get-tuple-element(%custom-call.3), index=0
  %all-reduce-start = f32[32,32]{1,0} all-reduce-start(%get-tuple-element.3), channel_id=5, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%region_0.1, metadata={op_name="jit(step)/transpose(jvp())/dot_general"}, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"collective_backend_config":{"is_sync":false,"no_parallel_custom_call":false,"is_pipelined":false},"force_earliest_schedule":false}
  %custom-call.4 = (f32[8,32]{1,0}, s8[4194304]{0}) custom-call(%collective-permute-done, %param), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
  %get-tuple-element.4 = f32[8,32]{1,0} get-tuple-element(%custom-call.4), index=0
  %tanh_grad_fusion = f32[8,32]{1,0} fusion(%get-tuple-element.4, %tanh_fusion), kind=kLoop, calls=%fused_tanh_grad, metadata={op_name="jit(step)/transpose(jvp())/mul"}
  %custom-call.5 = (f32[32,32]{1,0}, s8[4194304]{0}) custom-call(%param.2, %tanh_grad_fusion), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
  %get-tuple-element.5 = f32[32,32]{1,0} get-tuple-element(%custom-call.5), index=0
  %reduce-scatter-start = ((f32[32,32]{1,0}), f32[4,32]{1,0}) async-start(%get-tuple-element.5), calls=%async_computation, metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
  %all-reduce-done = f32[32,32]{1,0} all-reduce-done(%all-reduce-start), metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
  %sgd_fusion = f32[32,32]{1,0} fusion(%param, %all-reduce-done), kind=kLoop, calls=%fused_sgd, metadata={op_name="jit(step)/sub"}
  %reduce-scatter-done = f32[4,32]{1,0} async-done(%reduce-scatter-start), metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
  ROOT %tuple = (f32[32,32]{1,0}, f32[4,32]{1,0}) tuple(%sgd_fusion, %reduce-scatter-done)
}
"""


def test_schedule_of_a_gpu_excerpt():
    by_name = {c.name: c for c in async_collective_schedule(GPU_HLO)}
    assert list(by_name) == [
        "all-gather-start",
        "collective-permute-start",
        "loss",
        "all-reduce-start",
        "reduce-scatter-start",
    ]
    ag, cp, loss, ar, rs = by_name.values()
    assert (ag.kind, ag.is_async, ag.done_name, ag.overlapped_compute) == ("all-gather", True, "all-gather-done", 0)
    assert (cp.kind, cp.overlapped_compute) == ("collective-permute", 2)  # a gemm and the tanh fusion
    assert (loss.kind, loss.is_async, loss.start == loss.done, loss.gradient) == ("all-reduce", False, True, False)
    # The layer-2 gradient all-reduce hides behind layer 1's two backward gemms and its tanh-grad fusion.
    assert (ar.kind, ar.is_async, ar.done_name, ar.overlapped_compute) == ("all-reduce", True, "all-reduce-done", 3)
    assert ar.gradient and ar.before_backward_end and ar.backward_compute_after == 3
    # The reduce-scatter wrapped in async-start: issued after the last backward gemm, so it hides
    # only behind the optimizer update.
    assert (rs.kind, rs.is_async, rs.done_name, rs.overlapped_compute) == (
        "reduce-scatter",
        True,
        "reduce-scatter-done",
        1,
    )
    assert rs.gradient and not rs.before_backward_end
    assert gradients_issued_before_backward_end(GPU_HLO)


def test_gradient_all_reduce_after_the_backward_pass_is_not_early():
    """The same step with the all-reduce moved next to its done (as without the
    latency-hiding scheduler): nothing overlapped, issued after the backward pass."""
    lines = GPU_HLO.splitlines()
    start = next(i for i, line in enumerate(lines) if "%all-reduce-start = " in line)
    done = next(i for i, line in enumerate(lines) if "%all-reduce-done = " in line)
    lines.insert(done - 1, lines.pop(start))
    late = "\n".join(lines)
    ar = next(c for c in async_collective_schedule(late) if c.kind == "all-reduce" and c.is_async)
    assert ar.overlapped_compute == 0 and not ar.before_backward_end
    assert not gradients_issued_before_backward_end(late)
