"""perf/step_profile.py: the HLO text parser, the (part, kind) of an instruction, and one real
profiler trace of a small jitted function grouped by its named scopes."""

import jax
import jax.numpy as jnp
import pytest

from meshwork.perf.step_profile import (
    KINDS,
    Instruction,
    StepProfile,
    classify,
    parse_hlo,
    profile_steps,
)

LAYERS = "layers (projections, MLP, norms)"

# Hand-written, in the form XLA prints: a fusion whose body holds a dot, a convert, a fusion of
# elementwise ops inside a scan body, a while loop, a tuple-typed ROOT, and a dot fusion XLA left
# without a name stack (read through an unnamed bitcast by a named add, as the chunked loss's
# weight-gradient dot is).
HLO = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[2]{0}, f32[2,2]{1,0})->(f32[2]{0}, s32[])}

FileLocations
1 {file_name_id=1 function_name_id=1 line=3 end_line=3 column=5 end_column=16}

%fused_dot (param_0: f32[2,2], param_1: f32[2]) -> f32[2] {
  %param_0 = f32[2,2]{1,0} parameter(0)
  %param_1 = f32[2]{0} parameter(1)
  ROOT %dot.1 = f32[2]{0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/transpose(jvp(attention_core))/dot_general" stack_frame_id=1}
}

%fused_mul (param_0.1: f32[2]) -> f32[2] {
  %param_0.1 = f32[2]{0} parameter(0)
  %constant.1 = f32[] constant(2)
  %broadcast.1 = f32[2]{0} broadcast(%constant.1), dimensions={}
  ROOT %multiply.1 = f32[2]{0} multiply(%param_0.1, %broadcast.1), metadata={op_name="jit(step)/while/body/mul"}
}

%cond.1 (arg.1: (s32[], f32[2])) -> pred[] {
  %arg.1 = (s32[], f32[2]{0}) parameter(0)
  %gte.1 = s32[] get-tuple-element(%arg.1), index=0
  %constant.2 = s32[] constant(3)
  ROOT %lt.1 = pred[] compare(%gte.1, %constant.2), direction=LT, metadata={op_name="jit(step)/while/cond/lt"}
}

ENTRY %main.9 (x: f32[2], w: f32[2,2]) -> (f32[2], s32[]) {
  %x = f32[2]{0} parameter(0), metadata={op_name="x"}
  %w = f32[2,2]{1,0} parameter(1), metadata={op_name="w"}
  %dot_fusion = f32[2]{0} fusion(%w, %x), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(step)/transpose(jvp(attention_core))/dot_general" stack_frame_id=1}
  %convert.3 = bf16[2]{0} convert(%dot_fusion), metadata={op_name="jit(step)/jvp(lm_head)/convert_element_type"}
  %mul_fusion = f32[2]{0} fusion(%x), kind=kLoop, calls=%fused_mul, metadata={op_name="jit(step)/while/body/mul"}
  %unnamed_dot = f32[2]{0} fusion(%w, %x), kind=kOutput, calls=%fused_dot
  %bitcast.8 = f32[1,2]{1,0} bitcast(%unnamed_dot)
  %add.7 = f32[1,2]{1,0} add(%bitcast.8, %bitcast.8), metadata={op_name="jit(step)/jvp(loss)/while/body/add"}
  %c = s32[] constant(0)
  %tuple.4 = (s32[], f32[2]{0}) tuple(%c, %mul_fusion)
  %while.1 = (s32[], f32[2]{0}) while(%tuple.4), condition=%cond.1, body=%fused_mul
  ROOT %tuple.5 = (f32[2]{0}, s32[]) tuple(%mul_fusion, %c)
}
"""


def test_parse_hlo_opcodes_names_and_computations():
    instructions, computations = parse_hlo(HLO)
    opcodes = {name: i.opcode for name, i in instructions.items()}
    assert opcodes == {
        "param_0": "parameter",
        "param_1": "parameter",
        "dot.1": "dot",
        "param_0.1": "parameter",
        "constant.1": "constant",
        "broadcast.1": "broadcast",
        "multiply.1": "multiply",
        "arg.1": "parameter",
        "gte.1": "get-tuple-element",
        "constant.2": "constant",
        "lt.1": "compare",
        "x": "parameter",
        "w": "parameter",
        "dot_fusion": "fusion",
        "convert.3": "convert",
        "mul_fusion": "fusion",
        "unnamed_dot": "fusion",
        "bitcast.8": "bitcast",
        "add.7": "add",
        "c": "constant",
        "tuple.4": "tuple",
        "while.1": "while",
        "tuple.5": "tuple",
    }
    assert instructions["dot_fusion"].calls == ("fused_dot",)
    assert instructions["dot_fusion"].op_name == "jit(step)/transpose(jvp(attention_core))/dot_general"
    assert set(instructions["while.1"].calls) == {"cond.1", "fused_mul"}
    assert instructions["tuple.5"].op_name == "" and instructions["tuple.5"].calls == ()
    assert instructions["dot_fusion"].operands == ("w", "x") and instructions["tuple.5"].operands == ("mul_fusion", "c")
    # Unnamed instructions take their nearest named user's name stack, through unnamed ones;
    # one nothing reads (the ROOT tuple) keeps none.
    assert (
        instructions["unnamed_dot"].op_name == instructions["bitcast.8"].op_name == "jit(step)/jvp(loss)/while/body/add"
    )
    assert computations == {
        "fused_dot": {"parameter", "dot"},
        "fused_mul": {"parameter", "constant", "broadcast", "multiply"},
        "cond.1": {"parameter", "get-tuple-element", "constant", "compare"},
        "main.9": {"parameter", "fusion", "convert", "constant", "tuple", "while", "bitcast", "add"},
    }


def test_classify_the_parsed_instructions():
    instructions, computations = parse_hlo(HLO)
    got = {
        name: classify(instructions[name], computations)
        for name in ("dot_fusion", "convert.3", "mul_fusion", "tuple.5", "dot.1", "unnamed_dot")
    }
    assert got == {
        "dot_fusion": ("attention core", "matmul"),  # a fusion is a matmul when its body holds a dot
        "convert.3": ("LM head + loss", "copy/convert"),
        "mul_fusion": (LAYERS, "elementwise/other"),
        "tuple.5": ("other", "copy/convert"),
        "dot.1": ("attention core", "matmul"),
        "unnamed_dot": ("LM head + loss", "matmul"),  # named after the add that reads it
    }


@pytest.mark.parametrize(
    "op_name, part",
    [
        ("jit(f)/transpose(jvp(attention_core))/dot_general", "attention core"),
        ("jit(f)/jvp(lm_head)/dot_general", "LM head + loss"),
        ("jit(step)/jvp(loss)/log_softmax", "LM head + loss"),
        ("jit(step)/jvp(embed)/gather", "embedding"),
        ("jit(step)/nan_guard/optimizer/add", "optimizer"),  # the optimizer runs inside the guard's branch
        ("jit(step)/nan_guard/select_n", "NaN guard"),
        ("jit(step)/while/body/attention_core/dot_general", "attention core"),  # attention inside a layer
        ("jit(f)/while/body/closed_call/dot_general", LAYERS),
        ("jit(f)/transpose(jvp())/while/body/closed_call/checkpoint/rematted_computation/tanh", LAYERS),
        ("jit(step)/embedding_table_norm/add", "other"),  # a whole scope name, not a prefix of one
        ("jit(f)/add", "other"),
        ("", "other"),
    ],
)
def test_classify_part_from_the_name_stack(op_name, part):
    assert classify(Instruction("add", op_name, ()), {})[0] == part


@pytest.mark.parametrize(
    "opcode, body, kind",
    [
        ("dot", None, "matmul"),
        ("convolution", None, "matmul"),
        ("all-reduce-start", None, "collective"),
        ("all-gather-done", None, "collective"),
        ("reduce-scatter", None, "collective"),
        ("convert", None, "copy/convert"),
        ("transpose", None, "copy/convert"),
        ("add", None, "elementwise/other"),
        ("reduce", None, "elementwise/other"),
        ("fusion", {"parameter", "dot", "add"}, "matmul"),
        ("fusion", {"parameter", "all-reduce", "dot"}, "collective"),
        ("fusion", {"parameter", "convert", "bitcast", "reshape"}, "copy/convert"),
        ("fusion", {"parameter", "exponential", "add"}, "elementwise/other"),
    ],
)
def test_classify_kind_from_the_opcode(opcode, body, kind):
    computations = {"body": body} if body else {}
    instr = Instruction(opcode, "jit(f)/x", ("body",) if body else ())
    assert classify(instr, computations) == ("other", kind)
    assert kind in KINDS


def _scoped(x):
    with jax.named_scope("attention_core"):
        y = x @ x
    with jax.named_scope("optimizer"):
        z = jnp.tanh(y) * 0.5 + jnp.exp(-y * y)
    return z


@pytest.fixture(scope="module")
def traced():
    """One compile and one trace of 3 steps for the whole module."""
    jitted = jax.jit(_scoped)
    x = jax.random.normal(jax.random.key(0), (256, 256), jnp.float32)
    text = jitted.lower(x).compile().as_text()
    jax.block_until_ready(jitted(x))  # compiled before the traced steps
    prof = profile_steps(jitted, ((x,) for _ in range(3)), text, steps=3)
    return prof, text


def test_trace_groups_op_time_by_part_and_kind(traced):
    prof, _ = traced
    assert isinstance(prof, StepProfile) and prof.steps == 3 and prof.devices == 1
    assert prof.by_part_kind.get(("attention core", "matmul"), 0.0) > 0
    assert prof.by_part_kind.get(("optimizer", "elementwise/other"), 0.0) > 0
    assert all(v >= 0 for v in prof.by_part_kind.values())
    assert all(k in KINDS for _, k in prof.by_part_kind)


def test_trace_busy_time_within_wall_time(traced):
    prof, _ = traced
    assert 0 < prof.busy_s <= prof.wall_s * 1.05
    # The busy time is the union of the op intervals: never more than their sum.
    assert sum(prof.by_part_kind.values()) >= prof.busy_s * (1 - 1e-9)
    assert prof.host_gap_s == pytest.approx(max(prof.wall_s - prof.busy_s, 0.0))


def test_trace_table_and_top_ops(traced):
    prof, text = traced
    table = prof.table()
    assert table.splitlines()[0] == "| part | " + " | ".join(KINDS) + " | total ms | share |"
    assert "| attention core |" in table and "| optimizer |" in table and "| **all ops** |" in table
    assert "step wall" in table and "host gap" in table

    instructions, computations = parse_hlo(text)
    assert prof.top_ops, "no op of the module in the trace"
    for name, seconds, part, kind in prof.top_ops:
        assert name in instructions
        assert (part, kind) == classify(instructions[name], computations)
        assert seconds > 0
    times = [t for _, t, _, _ in prof.top_ops]
    assert times == sorted(times, reverse=True)
    # Fewer than 30 ops: the top list holds them all, so it adds up to the grouped time.
    assert sum(times) == pytest.approx(sum(prof.by_part_kind.values()), rel=1e-9)
