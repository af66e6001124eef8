"""Documents packed into one row stay apart: attention sees only its own document (segment ids,
on every kernel), and the loss skips the target that starts the next document."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from meshwork.config_sections import ModelConfig
from meshwork.models.layers.attention import attend
from meshwork.models.transformer import Transformer
from meshwork.objectives.next_token import token_cross_entropy
from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.parallel import use_rules
from meshwork.sharding.rules import rules_for


def tiny(attention: str) -> Transformer:
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, attention=attention)
    return Transformer(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("attention", ["xla", "reference", "pallas"])
def test_a_packed_document_computes_what_it_computes_alone(attention):
    """Row = doc A (5 tokens) + doc B (11 tokens): B's logits equal B run alone (RoPE is relative,
    so B's shifted positions do not matter), and without segment ids they do not."""
    tokens = jax.random.randint(jax.random.key(1), (1, 16), 0, 64)
    a, b = tokens[:, :5], tokens[:, 5:]
    segments = jnp.array([[1] * 5 + [2] * 11], jnp.int32)
    model = tiny(attention)
    packed = model(tokens, segment_ids_BL=segments)
    alone_a, alone_b = model(a), model(b)
    scale = float(jnp.abs(alone_b).max())
    assert float(jnp.abs(packed[:, 5:] - alone_b).max()) / scale < 1e-5
    assert float(jnp.abs(packed[:, :5] - alone_a).max()) / scale < 1e-5
    # Without the segment ids B attends to A: clearly different (so the check above can fail).
    assert float(jnp.abs(model(tokens)[:, 5:] - alone_b).max()) / scale > 1e-2


def test_segment_ids_reach_every_layer_under_jit_and_grad():
    """The gradient of B's loss with segment ids does not depend on A's tokens."""
    model = tiny("xla")
    graphdef, params = nnx.split(model)
    segments = jnp.array([[1] * 6 + [2] * 10], jnp.int32)

    def loss_of_b(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens, segment_ids_BL=segments)
        return logits[:, 6:].sum()

    tokens = jax.random.randint(jax.random.key(2), (1, 16), 0, 64)
    other = tokens.at[:, :6].set((tokens[:, :6] + 7) % 64)  # a different document A, same B
    g1, g2 = (jax.jit(jax.grad(loss_of_b))(params, t) for t in (tokens, other))
    # Only A's own embedding rows may differ; every weight shared by both documents gets B's gradient alone.
    diffs = [
        float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)) if x.shape != (64, 32)
    ]
    assert max(diffs) < 1e-4


def test_the_loss_counts_only_targets_within_a_document():
    logits = jax.random.normal(jax.random.key(3), (2, 6, 10))
    targets = jax.random.randint(jax.random.key(4), (2, 6), 0, 10)
    mask = jnp.array([[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 0, 1]], jnp.float32)
    per_token = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
    want = float((per_token * mask).sum() / mask.sum())
    got = float(token_cross_entropy(logits, {"targets": targets, "loss_mask": mask}))
    assert got == pytest.approx(want, rel=1e-6)
    assert float(token_cross_entropy(logits, {"targets": targets})) == pytest.approx(float(per_token.mean()), rel=1e-6)
    assert abs(got - float(per_token.mean())) > 1e-3


def test_the_pallas_kernel_takes_each_devices_rows_of_segment_ids():
    """Under a mesh the kernel runs per device (shard_map); the segment ids are split by batch
    like the activations, so a sharded run equals one device."""
    kq, kk, kv = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(kq, (4, 16, 4, 8))
    k, v = jax.random.normal(kk, (4, 16, 2, 8)), jax.random.normal(kv, (4, 16, 2, 8))
    seg = jnp.cumsum(jax.random.bernoulli(jax.random.key(6), 0.2, (4, 16)), axis=1).astype(jnp.int32)
    want = attend(q, k, v, impl="reference", segment_ids_BL=seg)
    mesh = make_mesh({"data": 4, "tensor": 2})
    with jax.set_mesh(mesh), use_rules(rules_for("tp")):
        got = jax.jit(lambda q, k, v, s: attend(q, k, v, impl="pallas", segment_ids_BL=s))(q, k, v, seg)
    assert float(jnp.abs(got - want).max()) < 1e-5
