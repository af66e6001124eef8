"""The fused, chunked head + cross-entropy (train.loss_chunk) is the plain loss, its gradients
included, on one device and sharded, and the compiled step no longer holds the (B*L, V) logits."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, tiny_overrides
from jax.sharding import NamedSharding, PartitionSpec

from meshwork.config import load_config
from meshwork.data.text import train_iterator
from meshwork.models.build import build_model, split_model
from meshwork.objectives.fused_ce import fused_cross_entropy
from meshwork.objectives.next_token import next_token_loss, token_cross_entropy
from meshwork.partitioning import variable_shardings
from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.parallel import use_rules
from meshwork.sharding.rules import rules_for
from meshwork.train.trainer import build_trainer, check_runtime

V = 256  # lm_tiny's byte vocabulary


def max_rel(got, want) -> float:
    """Largest difference relative to the largest magnitude: elementwise rtol means nothing for
    gradient entries that are zero up to rounding."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def tree_max_rel(got, want) -> float:
    return max(max_rel(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("chunk", [8, 7, 1000], ids=["divides", "ragged", "one-chunk"])
def test_fused_loss_and_grads_equal_plain(tied, masked, chunk):
    B, L, D, Vs = 2, 12, 16, 40
    kh, kw, kt, km = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(kh, (B, L, D))
    w = jax.random.normal(kw, (Vs, D) if tied else (D, Vs)) * 0.3  # tied: the (V, D) embedding table
    targets = jax.random.randint(kt, (B, L), 0, Vs)
    mask = (jax.random.uniform(km, (B, L)) > 0.3).astype(jnp.int32) if masked else None
    batch = {"targets": targets, **({"loss_mask": mask} if masked else {})}
    w_DV = (lambda w: w.T) if tied else (lambda w: w)

    def plain(h, w):
        return token_cross_entropy(jnp.einsum("BLD,DV->BLV", h, w_DV(w)), batch)

    def fused(h, w):
        return fused_cross_entropy(h, w_DV(w), targets, mask, chunk=chunk)

    want, (dh_want, dw_want) = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(h, w)
    got, (dh_got, dw_got) = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(h, w)
    errs = max_rel(got, want), max_rel(dh_got, dh_want), max_rel(dw_got, dw_want)
    print(f"loss, dh, dW max relative difference: {errs}")
    assert max(errs) < 1e-6, errs


def cfg_with(tmp_path, *extra):
    return load_config(ROOT / "configs/lm_tiny.yaml", [*tiny_overrides(tmp_path), *extra])


@pytest.fixture(scope="module")
def batch():
    tokens = jax.random.randint(jax.random.key(3), (8, 17), 0, V)
    mask = (jax.random.uniform(jax.random.key(4), (8, 16)) > 0.2).astype(jnp.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}


def loss_and_grads(graphdef, params, buffers, batch, loss_chunk):
    loss_fn = next_token_loss(graphdef, loss_chunk)
    return jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, buffers, b)[0]))(params, batch)


@pytest.mark.parametrize(
    "config, tied", [("lm_tiny", False), ("lm_tiny", True), ("moe_tiny", False)], ids=["untied", "tied", "moe"]
)
def test_model_loss_with_chunks_equals_plain(tmp_path, batch, config, tied):
    cfg = load_config(
        ROOT / f"configs/{config}.yaml", [*tiny_overrides(tmp_path), f"model.tie_embeddings={str(tied).lower()}"]
    )
    model = build_model(cfg)
    graphdef, params, buffers = split_model(model)
    want, g_want = loss_and_grads(graphdef, params, buffers, batch, None)
    got, g_got = loss_and_grads(graphdef, params, buffers, batch, 40)  # 128 rows: 4 chunks, the last padded
    errs = max_rel(got, want), tree_max_rel(g_got, g_want)
    print(f"loss, params' grads max relative difference: {errs}")
    assert max(errs) < 1e-6, errs


def test_bfloat16_compute_tracks_plain(tmp_path, batch):
    # bf16 operands, float32 accumulation: the chunked loss rounds no more than the plain one.
    graphdef, params, buffers = split_model(build_model(cfg_with(tmp_path, "train.compute_dtype=bfloat16")))
    want, g_want = loss_and_grads(graphdef, params, buffers, batch, None)
    got, g_got = loss_and_grads(graphdef, params, buffers, batch, 40)
    errs = max_rel(got, want), tree_max_rel(g_got, g_want)
    print(f"bfloat16: loss, grads max relative difference: {errs}")
    assert errs[0] < 1e-3 and errs[1] < 3e-2, errs


@pytest.mark.parametrize(
    "sizes, preset", [(dict(fsdp=8), "fsdp"), (dict(data=4, tensor=2), "tp")], ids=["fsdp8", "data4xtensor2-tp"]
)
def test_sharded_chunked_loss_equals_one_device(tmp_path, batch, sizes, preset):
    cfg = cfg_with(tmp_path, "model.tie_embeddings=false")
    graphdef, params, buffers = split_model(build_model(cfg))
    want, g_want = loss_and_grads(graphdef, params, buffers, batch, None)
    mesh, rules = make_mesh({"data": 1, **sizes}), rules_for(preset)
    with jax.set_mesh(mesh), use_rules(rules):
        placed = jax.device_put(params, variable_shardings(params, mesh, rules))
        sharded = jax.device_put(batch, NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
        got, g_got = loss_and_grads(graphdef, placed, buffers, sharded, 24)
    head = placed["head"]["lm_head"][...]
    assert head.addressable_shards[0].data.shape != head.shape  # the head really was split
    errs = max_rel(got, want), tree_max_rel(g_got, g_want)
    print(f"{preset} {sizes}: loss, grads max relative difference: {errs}")
    assert max(errs) < 1e-6, errs


def logits_shapes(hlo: str, B: int, L: int, V: int = V) -> set[str]:
    """The float32 arrays of the whole batch's logits, (B, L, V) or (B*L, V), in an HLO text."""
    return set(re.findall(rf"f32\[(?:{B},{L}|{B * L}),{V}\]", hlo))


def test_compiled_loss_holds_no_full_logits(tmp_path, batch):
    # A vocabulary and a depth where the head is the largest activation, as in real LMs
    # (at lm_tiny's 256 bytes the backward pass through the blocks sets the peak).
    B, L = batch["inputs"].shape
    V = 4096
    graphdef, params, buffers = split_model(
        build_model(cfg_with(tmp_path, f"model.vocab_size={V}", "model.n_layers=1"))
    )
    compiled = {}
    for chunk in (None, 16):
        loss_fn = next_token_loss(graphdef, chunk)
        fn = jax.jit(jax.value_and_grad(lambda p, b, loss_fn=loss_fn: loss_fn(p, buffers, b)[0]))
        compiled[chunk] = fn.lower(params, batch).compile()
    plain, fused = (compiled[c].as_text() for c in (None, 16))
    temp = {c: compiled[c].memory_analysis().temp_size_in_bytes for c in compiled}
    print(f"temp bytes plain {temp[None]}, chunked {temp[16]}; plain's logits arrays {logits_shapes(plain, B, L, V)}")
    assert logits_shapes(plain, B, L, V)
    assert not logits_shapes(fused, B, L, V)
    assert f"f32[16,{V}]" in fused  # one chunk's logits is what remains
    assert temp[16] < 0.6 * temp[None]


STEPS = 3
STEP_OVERRIDES = ["optimizer.init_lr_ratio=0.1", "optimizer.warmup_steps=10"]  # a nonzero first lr


def train_steps(tmp_path, overrides):
    cfg = load_config(ROOT / "configs/lm_tiny.yaml", [*tiny_overrides(tmp_path), *STEP_OVERRIDES, *overrides])
    files = check_runtime(cfg, jax.devices()[:1])
    trainer = build_trainer(cfg, files, jax.devices()[:1]).compile()
    batches = train_iterator(str(files.train), cfg.data.seq_len, cfg.train.global_batch, seed=0)
    state, losses = trainer.init_state(), []
    for _ in range(STEPS):
        state, metrics = trainer.step_fn(state, trainer.to_device(next(batches)))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state.params), trainer.step_fn.as_text()


def test_training_with_loss_chunk_equals_plain(tmp_path):
    losses, params, hlo = train_steps(tmp_path / "plain", ["mesh.data=1"])
    losses_c, params_c, hlo_c = train_steps(tmp_path / "chunked", ["mesh.data=1", "train.loss_chunk=48"])
    print(f"losses plain {losses}, chunked {losses_c}; params max relative difference {tree_max_rel(params_c, params)}")
    np.testing.assert_allclose(losses_c, losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params_c), jax.tree.leaves(params)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    # The option reached the trainer's step: its program has no whole-batch logits left.
    assert logits_shapes(hlo, 8, 32) and not logits_shapes(hlo_c, 8, 32)


def test_loss_chunk_refuses_pipelines(tmp_path):
    from meshwork.config import ConfigError

    with pytest.raises(ConfigError, match="train.loss_chunk"):
        cfg_with(
            tmp_path,
            "train.loss_chunk=64",
            "mesh.stage=2",
            "mesh.data=4",
            "train.pipeline=gpipe",
            "train.microbatches=2",
        )


def test_fsdp_gathers_the_head_once_and_reduces_its_gradient_once(tmp_path, batch):
    """However many chunks, one all-gather of the head weight and one reduction of its gradient
    per step: each device sums its own rows' dW over the chunks before any communication."""
    cfg = cfg_with(tmp_path, "model.tie_embeddings=false")
    graphdef, params, buffers = split_model(build_model(cfg))
    mesh, rules = make_mesh({"data": 1, "fsdp": 8}), rules_for("fsdp")
    D = cfg.model.d_model
    with jax.set_mesh(mesh), use_rules(rules):
        placed = jax.device_put(params, variable_shardings(params, mesh, rules))
        sharded = jax.device_put(batch, NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
        loss_fn = next_token_loss(graphdef, 16)  # 128 rows: 8 chunks
        fn = jax.jit(jax.grad(lambda p, b: loss_fn(p, buffers, b)[0]))
        hlo = fn.lower(placed, sharded).compile().as_text()
    # Only the entry computation runs once per step: a collective in the chunk loop's body runs per chunk.
    entry = hlo[hlo.index("\nENTRY") :]
    full = rf"\w+\[{D},{V}\]"
    count = {
        what: (len(re.findall(pattern, hlo)), len(re.findall(pattern, entry)))
        for what, pattern in {
            "all-gather": rf"= {full}\S* all-gather\(",
            "reduction": rf"= (?:\([^)]*)?{full}[^=]*? (?:all-reduce|reduce-scatter)\(",
        }.items()
    }
    print(f"(D, V) collectives (in the program, in its entry): {count}")
    assert count == {"all-gather": (1, 1), "reduction": (1, 1)}, count
