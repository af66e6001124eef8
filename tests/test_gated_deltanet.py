"""Gated DeltaNet (Qwen3-Next's linear attention): the chunked form equals the recurrence, the layer
equals transformers' (golden files from tests/fixtures/make_gated_deltanet_golden.py; no torch here),
decoding through the carried state equals the full forward, packed documents compute alone, and the
layer sharded over data 4 x tensor 2 equals one device, forward and gradients."""

import doctest
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import meshwork.kernels.gated_delta_rule
import meshwork.models.layers.gated_deltanet
from meshwork.config_sections import LinearAttentionConfig
from meshwork.engine.recurrent_states import state_bytes
from meshwork.kernels.gated_delta_rule import chunked_gated_delta_rule, recurrent_gated_delta_rule
from meshwork.models.layers.gated_deltanet import (
    GatedDeltaNet,
    GatedDeltaNetState,
    from_hf,
    linear_attention_from_hf,
    to_hf,
)
from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.parallel import use_rules
from meshwork.sharding.rules import logical_to_sharding, rules_for

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "gated_deltanet"
D = 16
CFG = LinearAttentionConfig(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, conv_kernel=4, chunk_size=4)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def make_layer(cfg=CFG, d_model=D, seed=0, eps=1e-6) -> GatedDeltaNet:
    layer = GatedDeltaNet(
        d_model,
        cfg,
        init_std=d_model**-0.5,
        out_std=0.3,
        norm_eps=eps,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs=nnx.Rngs(seed),
    )
    # Milder decays than the init's A up to 16, so tokens chunks apart still meet.
    layer.A_log[...] = jnp.log(jnp.linspace(0.05, 1.0, cfg.num_v_heads))
    return layer


def load(layer: GatedDeltaNet, params: dict) -> None:
    for path, var in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
        name = ".".join(map(str, path))
        assert var[...].shape == params[name].shape, (name, var[...].shape, params[name].shape)
        var[...] = jnp.asarray(params[name])


def rule_inputs(key, B=2, L=20, G=2, H=4, Kk=8, Kv=6):
    ks = jax.random.split(key, 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(ks[0], (B, L, G, Kk)))
    k = unit(jax.random.normal(ks[1], (B, L, G, Kk)))
    v = jax.random.normal(ks[2], (B, L, H, Kv))
    g = -0.5 * jnp.exp(jax.random.normal(ks[3], (B, L, H)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, L, H)))
    state = jax.random.normal(ks[5], (B, H, Kk, Kv))
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk", [1, 4, 7, 32])  # 7 does not divide 20; 32 is longer than the sequence
def test_chunked_equals_recurrent(chunk):
    q, k, v, g, beta, s0 = rule_inputs(jax.random.key(0))
    segs = jnp.array([[0] * 6 + [1] * 9 + [2] * 5, [3] * 20])  # row 0: three packed documents
    for segment_ids in (None, segs):
        o_ref, s_ref = jax.jit(recurrent_gated_delta_rule)(q, k, v, g, beta, s0, segment_ids_BL=segment_ids)
        o, s = jax.jit(chunked_gated_delta_rule, static_argnums=5)(
            q, k, v, g, beta, chunk, s0, segment_ids_BL=segment_ids
        )
        assert o.shape == v.shape and s.shape == s0.shape and s.dtype == jnp.float32
        assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


@pytest.mark.parametrize("L", [1, 7, 70])
def test_layer_equals_transformers(L):
    """Qwen3NextGatedDeltaNet's output (torch's chunked path, chunks of 64) at 1, 7 and 70 tokens, read
    through `from_hf`; chunks of 16 here, so 70 tokens cross four chunk boundaries and a ragged end."""
    hf = json.loads((FIXTURE / "config.json").read_text())
    cfg = linear_attention_from_hf(hf, chunk_size=16)
    layer = make_layer(cfg, hf["hidden_size"], eps=hf["rms_norm_eps"])
    load(layer, from_hf(load_file(FIXTURE / "layer.safetensors"), cfg))
    golden = np.load(FIXTURE / "golden.npz")
    y = jax.jit(lambda x: layer(x))(jnp.asarray(golden[f"x_{L}"]))
    assert rel_err(y, golden[f"y_{L}"]) < 1e-5


def test_hf_layout_round_trips_bit_exactly():
    hf = json.loads((FIXTURE / "config.json").read_text())
    cfg = linear_attention_from_hf(hf)
    tensors = load_file(FIXTURE / "layer.safetensors")
    ours = from_hf(tensors, cfg)
    back = to_hf(ours, cfg)
    assert set(back) == set(tensors) and all(np.array_equal(back[n], tensors[n]) for n in tensors)
    # Grouped by key head: key group 1's rows are w_qkvz[:, 1] ([q, k, v of its value heads, z of them]).
    G = cfg.num_k_heads
    group_1 = tensors["in_proj_qkvz.weight"].reshape(G, -1, hf["hidden_size"])[1]
    np.testing.assert_array_equal(ours["w_qkvz"][:, 1], group_1.T)


def test_prefill_then_decode_equals_the_full_forward():
    """5 tokens prefilled (chunked, a ragged chunk), 3 more as a second prefill chunk from that state,
    then 4 decoded one at a time (the recurrence): the full forward's outputs, and every call keeps
    the state's shapes."""
    layer = make_layer()
    x = jax.random.normal(jax.random.key(1), (2, 12, D))
    full = jax.jit(lambda x: layer(x))(x)
    step = jax.jit(layer.cached)
    state = layer.init_state(2)
    outs = []
    for start, stop in [(0, 5), (5, 8), *((t, t + 1) for t in range(8, 12))]:
        y, new_state = step(x[:, start:stop], state)
        assert jax.tree.map(jnp.shape, new_state) == jax.tree.map(jnp.shape, state)
        outs.append(y)
        state = new_state
    assert rel_err(jnp.concatenate(outs, axis=1), full) < 1e-5


def test_packed_documents_each_compute_alone():
    """Segment ids restart the convolution window and the state: each packed document's outputs are
    those of the document alone (3 and 6 tokens, with chunks of 4 so the boundary falls mid-chunk)."""
    layer = make_layer()
    x = jax.random.normal(jax.random.key(2), (1, 9, D))
    segment_ids = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    packed = jax.jit(lambda x, s: layer(x, segment_ids_BL=s))(x, segment_ids)
    alone = [jax.jit(lambda x: layer(x))(x[:, a:b]) for a, b in ((0, 3), (3, 9))]
    assert rel_err(packed, jnp.concatenate(alone, axis=1)) < 1e-5


def loss_and_grads(graphdef, x):
    def loss(params, x):
        y = nnx.merge(graphdef, params)(x)
        return jnp.mean(jnp.square(y)), y

    return jax.value_and_grad(loss, has_aux=True)


def test_gradients_reach_the_decay_parameters():
    layer = make_layer()
    graphdef, params = nnx.split(layer)
    x = jax.random.normal(jax.random.key(3), (2, 10, D))
    (_, _), grads = jax.jit(loss_and_grads(graphdef, x))(params, x)
    for name in ("A_log", "dt_bias", "w_ba", "conv"):
        g = np.asarray(grads[name][...])
        assert np.isfinite(g).all() and np.abs(g).min() > 0, name


def test_sharded_forward_and_gradients_equal_one_device():
    """data 4 x tensor 2 under the `tp` preset: the batch split over data, key and value heads over
    tensor (each device holds half the heads of every weight); loss, output and every gradient equal
    one device within 1e-5."""
    layer = make_layer()
    graphdef, params = nnx.split(layer)
    x = jax.random.normal(jax.random.key(4), (4, 10, D))
    f = loss_and_grads(graphdef, x)
    (loss_1, y_1), grads_1 = jax.jit(f)(params, x)

    mesh, rules = make_mesh({"data": 4, "tensor": 2}), rules_for("tp")
    with jax.set_mesh(mesh), use_rules(rules):
        placed = jax.tree.map(
            lambda v: v.replace(
                jax.device_put(v[...], logical_to_sharding(v.get_metadata()["out_sharding"], mesh, rules))
            ),
            params,
            is_leaf=lambda v: isinstance(v, nnx.Variable),
        )
        full = placed["w_qkvz"][...].shape
        assert placed["w_qkvz"][...].addressable_shards[0].data.shape == (D, full[1] // 2, full[2])
        assert placed["wo"][...].addressable_shards[0].data.shape[0] == placed["wo"][...].shape[0] // 2
        x_sharded = jax.device_put(x, logical_to_sharding(("act_batch", "act_seq", "act_embed"), mesh, rules))
        (loss_n, y_n), grads_n = jax.jit(f)(placed, x_sharded)
    assert y_n.addressable_shards[0].data.shape[0] == 1
    assert rel_err(loss_n, loss_1) < 1e-5 and rel_err(y_n, y_1) < 1e-5
    for (path, g_1), (_, g_n) in zip(nnx.to_flat_state(grads_1), nnx.to_flat_state(grads_n)):
        assert rel_err(g_n[...], g_1[...]) < 1e-5, path


def test_state_bytes_are_what_init_state_allocates():
    layer = make_layer()
    state = layer.init_state(3, jnp.bfloat16)
    assert isinstance(state, GatedDeltaNetState) and state.recurrent_BHKK.dtype == jnp.float32
    assert sum(a.nbytes for a in jax.tree.leaves(state)) == 3 * state_bytes(CFG, jnp.bfloat16)
    assert set(GatedDeltaNetState.logical_axes()) == {f.name for f in GatedDeltaNetState.__dataclass_fields__.values()}


def test_value_heads_must_be_a_multiple_of_key_heads():
    with pytest.raises(ValueError, match="num_v_heads=6 must be a multiple of num_k_heads=4"):
        LinearAttentionConfig(num_k_heads=4, num_v_heads=6)


@pytest.mark.parametrize("module", [meshwork.kernels.gated_delta_rule, meshwork.models.layers.gated_deltanet])
def test_docstring_examples(module):
    assert doctest.testmod(module).failed == 0
