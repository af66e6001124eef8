"""The UNet and the DDPM math match diffusers (golden files; no torch), and the UNet shards.

tests/fixtures/make_diffusers_golden.py wrote tests/fixtures/diffusers/ with
diffusers on CPU (versions in tests/fixtures/diffusers/versions.json).
"""

import doctest
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT
from flax import nnx
from safetensors.numpy import load_file, save_file

from meshwork.config_sections import DiffusionConfig, UNetConfig
from meshwork.diffusion import images
from meshwork.diffusion import schedule as diffusion
from meshwork.diffusion.sampling import ddim_sample
from meshwork.inference.diffusers_import import build_unet, config_from_diffusers, load_diffusers_unet
from meshwork.models.unet import UNet
from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.parallel import use_rules
from meshwork.sharding.rules import logical_to_sharding, rules_for

FIXTURES = ROOT / "tests/fixtures/diffusers"
MODELS = ["unet_class", "unet_uncond"]


def diffusers_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def golden_inputs(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """(x NHWC, timesteps, labels or None, diffusers' output NHWC)."""
    g = np.load(FIXTURES / name / "golden.npz")
    nhwc = lambda a: a.transpose(0, 2, 3, 1)  # noqa: E731
    return nhwc(g["x"]), g["timesteps"], g["class_labels"] if "class_labels" in g else None, nhwc(g["out"])


@nnx.jit
def forward(model, x, t, labels):
    return model(x, t, labels)


def max_error(model, name: str) -> float:
    x, t, labels, want = golden_inputs(name)
    got = np.asarray(forward(model, x, t, labels))
    assert got.dtype == np.float32 and got.shape == want.shape
    return float(np.abs(got - want).max())


@pytest.fixture(scope="module")
def loaded():
    return {name: load_diffusers_unet(FIXTURES / name) for name in MODELS}


# ---------------------------------------------------------------- UNet parity


@pytest.mark.parametrize("name", MODELS)
def test_output_matches_diffusers(name, loaded):
    cfg, params = loaded[name]
    assert max_error(build_unet(cfg, params), name) <= 1e-4


def test_pallas_attention_serves_the_unet(loaded):
    """The UNet's attention goes through `attend`: the Pallas flash kernel (interpret mode
    here) gives diffusers' output too."""
    cfg, params = loaded["unet_uncond"]
    assert max_error(build_unet(cfg, params, attention="pallas"), "unet_uncond") <= 1e-4


def test_remat_keeps_values_and_gradients():
    cfg = UNetConfig(
        block_out_channels=[8],
        down_block_types=["AttnDownBlock2D"],
        up_block_types=["AttnUpBlock2D"],
        norm_num_groups=4,
        attention_head_dim=4,
    )
    x, t = jax.random.normal(jax.random.key(0), (2, 4, 4, 1)), jnp.array([3, 700])

    def value_and_grad(remat):
        model = UNet(cfg, remat=remat, rngs=nnx.Rngs(0))
        return nnx.jit(nnx.value_and_grad(lambda m: jnp.mean(m(x, t) ** 2)))(model)

    (loss, grads), (loss_remat, grads_remat) = value_and_grad("none"), value_and_grad("full")
    assert float(loss) == pytest.approx(float(loss_remat), rel=1e-6)
    for g, g_remat in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_remat)):
        np.testing.assert_allclose(g_remat, g, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("remat", ["full", "dots_saveable"])
def test_remat_unet_samples(remat):
    """A run trained with train.remat is sampled with the UNet built the same way (load_run,
    log.sample_every): the samplers merge the weights under jit and call the UNet inside
    fori_loop, a trace the remat wrapper must not write back into (it raised TraceContextError).
    Samples equal the plain UNet's, and the training gradient still checkpoints every block."""
    cfg = UNetConfig(
        sample_size=4,
        block_out_channels=[8],
        down_block_types=["AttnDownBlock2D"],
        up_block_types=["AttnUpBlock2D"],
        norm_num_groups=4,
        attention_head_dim=4,
        num_class_embeds=3,
    )
    labels = jnp.array([0, 1])

    def sample(remat):
        graphdef, state = nnx.split(UNet(cfg, remat=remat, rngs=nnx.Rngs(0)))
        fn = jax.tree_util.Partial(images._apply, graphdef, state)  # as sample_images passes the UNet
        return ddim_sample(
            fn,
            (2, 4, 4, 1),
            jax.random.key(1),
            DiffusionConfig(),
            steps=3,
            labels=labels,
            guidance_scale=2.0,
            null_label=2,
        )

    np.testing.assert_allclose(sample(remat), sample("none"), atol=1e-5, rtol=1e-5)

    model = UNet(cfg, remat=remat, rngs=nnx.Rngs(0))
    x, t = jnp.ones((2, 4, 4, 1)), jnp.array([3, 700])
    jaxpr = jax.make_jaxpr(nnx.grad(lambda m: jnp.mean(m(x, t, labels) ** 2)))(model)
    levels = [*model.down_blocks, model.mid_block, *model.up_blocks]
    blocks = sum(len(level.resnets) + len(level.attentions) for level in levels)  # 9 here
    assert sum(e.primitive.name == "remat2" for e in jaxpr.jaxpr.eqns) == blocks


def test_parity_is_sensitive_to_the_conventions(loaded):
    """A wrong sinusoid order or an ignored norm scale must show far above the tolerance."""
    cfg, params = loaded["unet_uncond"]
    assert max_error(build_unet(cfg.model_copy(update={"flip_sin_to_cos": True}), params), "unet_uncond") > 1e-2
    params = jax.tree.map(np.copy, params)
    params["down_blocks"][0]["attentions"][1]["group_norm"]["scale"][:] = 1.0
    assert max_error(build_unet(cfg, params), "unet_uncond") > 1e-2


def test_config_mapping():
    c = config_from_diffusers(diffusers_config("unet_class"))
    assert (c.sample_size, c.in_channels, c.out_channels, c.block_out_channels) == (16, 2, 2, [16, 32])
    assert (c.layers_per_block, c.norm_num_groups, c.norm_eps, c.attention_head_dim) == (1, 8, 1e-5, 8)
    assert c.num_class_embeds == 10 and c.mid_block_attention and c.flip_sin_to_cos and c.freq_shift == 0
    u = config_from_diffusers(diffusers_config("unet_uncond"))
    assert u.down_block_types == ["AttnDownBlock2D", "DownBlock2D"]
    assert u.up_block_types == ["UpBlock2D", "AttnUpBlock2D"]
    assert (u.num_class_embeds, u.mid_block_attention, u.flip_sin_to_cos, u.freq_shift) == (None, False, False, 1)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"time_embedding_type": "fourier"}, "time_embedding_type='fourier'"),
        ({"resnet_time_scale_shift": "scale_shift"}, "resnet_time_scale_shift"),
        ({"down_block_types": ["SkipDownBlock2D", "AttnDownBlock2D"]}, "down_block_types"),
        ({"attention_head_dim": None}, "attention_head_dim=None"),
        ({"class_embed_type": "timestep"}, "class_embed_type"),
        ({"act_fn": "gelu"}, "act_fn='gelu'"),
        ({"_class_name": "UNet2DConditionModel"}, "UNet2DModel"),
    ],
)
def test_unsupported_configs_raise(change, match):
    with pytest.raises(ValueError, match=match):
        config_from_diffusers(diffusers_config("unet_class") | change)


def test_weights_that_do_not_fit_the_config_raise(tmp_path):
    shutil.copy(FIXTURES / "unet_class/diffusion_pytorch_model.safetensors", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(diffusers_config("unet_class") | {"add_attention": False}))
    with pytest.raises(ValueError, match="have no place"):
        load_diffusers_unet(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(diffusers_config("unet_class") | {"in_channels": 3}))
    with pytest.raises(ValueError, match="conv_in.weight' has shape"):
        load_diffusers_unet(tmp_path)


def test_pipeline_layout_and_float32_weights(tmp_path, loaded):
    """A pipeline folder holds the UNet in unet/; float32 files load to the same parameters."""
    unet = tmp_path / "unet"
    unet.mkdir()
    shutil.copy(FIXTURES / "unet_class/config.json", unet)
    tensors = load_file(FIXTURES / "unet_class/diffusion_pytorch_model.safetensors")
    assert {a.dtype for a in tensors.values()} == {np.dtype(np.float16)}
    save_file({k: a.astype(np.float32) for k, a in tensors.items()}, unet / "diffusion_pytorch_model.safetensors")
    _, params = load_diffusers_unet(tmp_path)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(loaded["unet_class"][1])):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want.astype(np.float32))


def test_parameters_carry_logical_names():
    model = nnx.eval_shape(lambda: UNet(UNetConfig(block_out_channels=[16, 32], num_class_embeds=10), rngs=nnx.Rngs(0)))
    mesh, rules = make_mesh({"fsdp": -1}), rules_for("fsdp")
    for path, var in jax.tree_util.tree_leaves_with_path(
        nnx.state(model, nnx.Param), is_leaf=lambda v: isinstance(v, nnx.Variable)
    ):
        names, shape = var.get_metadata()["out_sharding"], var.shape
        assert len(names) == len(shape), path
        # Under fsdp every weight matrix is split somewhere (the q/k/v biases stay whole, as in the LMs).
        if len(shape) > 1 and names != ("heads", "head_dim"):
            assert "fsdp" in logical_to_sharding(names, mesh, rules).spec, path


def test_labels_are_required_exactly_when_class_conditional():
    # The check comes before any arithmetic, so abstract models (no weights drawn) suffice.
    small = dict(block_out_channels=[8, 16], norm_num_groups=4, attention_head_dim=4)
    cond = nnx.eval_shape(lambda: UNet(UNetConfig(**small, num_class_embeds=3), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="pass labels_B"):
        cond(jnp.zeros((1, 8, 8, 1)), jnp.array([3]))
    uncond = nnx.eval_shape(lambda: UNet(UNetConfig(**small), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="takes no labels"):
        uncond(jnp.zeros((1, 8, 8, 1)), jnp.array([3]), jnp.array([1]))


# ---------------------------------------------------------------- sharding


def place(model: nnx.Module, mesh, rules) -> nnx.Module:
    """Each parameter put where its logical names say, under `rules`."""
    graphdef, state = nnx.split(model)

    def put(v):
        return v.replace(jax.device_put(v[...], logical_to_sharding(v.get_metadata()["out_sharding"], mesh, rules)))

    return nnx.merge(graphdef, jax.tree.map(put, state, is_leaf=lambda v: isinstance(v, nnx.Variable)))


def test_fsdp_sharded_output_equals_unsharded(loaded):
    cfg, params = loaded["unet_class"]
    model = build_unet(cfg, params)
    key = jax.random.key(1)
    x = jax.random.normal(key, (8, 16, 16, 2))
    t = jnp.arange(8) * 120
    labels = jnp.arange(8) % 10
    want = forward(model, x, t, labels)

    mesh, rules = make_mesh({"data": 2, "fsdp": 4}), rules_for("fsdp")
    with jax.set_mesh(mesh), use_rules(rules):
        sharded = place(model, mesh, rules)
        kernel = sharded.mid_block.resnets[0].conv1.kernel[...]
        assert kernel.addressable_shards[0].data.shape == (3, 3, 32, 8)  # output channels split 4 ways
        batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
        got = forward(sharded, jax.device_put(x, batch), jax.device_put(t, batch), jax.device_put(labels, batch))
    assert got.sharding.spec[0] == ("data", "fsdp")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


# ---------------------------------------------------------------- DDPM


@pytest.fixture(scope="module")
def ddpm():
    meta = json.loads((FIXTURES / "ddpm.json").read_text())
    return meta, dict(np.load(FIXTURES / "ddpm.npz"))


def diffusion_config(spec: dict, **kw) -> DiffusionConfig:
    schedule = {"linear": "linear", "squaredcos_cap_v2": "cosine"}[spec["beta_schedule"]]
    extra = {k: spec[k] for k in ("beta_start", "beta_end") if k in spec}
    return DiffusionConfig(num_train_timesteps=spec["num_train_timesteps"], schedule=schedule, **extra, **kw)


def test_schedules_match_diffusers(ddpm):
    meta, g = ddpm
    for name, spec in meta["schedules"].items():
        cfg = diffusion_config(spec)
        np.testing.assert_allclose(diffusion.betas(cfg), g[f"{name}/betas"], rtol=1e-6, atol=1e-9, err_msg=name)
        np.testing.assert_allclose(
            diffusion.alphas_cumprod(cfg), g[f"{name}/alphas_cumprod"], rtol=2e-5, atol=1e-9, err_msg=name
        )
    cosine = diffusion.betas(diffusion_config(meta["schedules"]["cosine"]))
    assert float(cosine.max()) == pytest.approx(0.999)  # the cap binds at the end


def test_add_noise_and_velocity_match_diffusers(ddpm):
    meta, g = ddpm
    t = g["noise_timesteps"]
    for name in ("linear", "cosine"):
        abar = diffusion.alphas_cumprod(diffusion_config(meta["schedules"][name]))
        np.testing.assert_allclose(
            diffusion.add_noise(g["x0"], g["noise"], t, abar), g[f"{name}/add_noise"], atol=1e-5, err_msg=name
        )
        np.testing.assert_allclose(
            diffusion.v_target(g["x0"], g["noise"], t, abar), g[f"{name}/velocity"], atol=1e-5, err_msg=name
        )


def test_ddpm_step_matches_diffusers(ddpm):
    meta, g = ddpm
    for case in meta["steps"]:
        n = f"step/{case['name']}/"
        abar = diffusion.alphas_cumprod(diffusion_config(meta["schedules"][case["schedule"]]))
        prediction = {"epsilon": "epsilon", "v_prediction": "v"}[case["prediction_type"]]
        prev, x0 = diffusion.ddpm_step(
            g[n + "model_output"],
            case["timestep"],
            g[n + "sample"],
            None,
            abar,
            prev_t=case["prev_timestep"],
            prediction=prediction,
            clip_sample=case["clip_sample"],
            noise=g[n + "variance_noise"],
        )
        np.testing.assert_allclose(x0, g[n + "pred_original_sample"], atol=1e-4, rtol=1e-5, err_msg=case["name"])
        np.testing.assert_allclose(prev, g[n + "prev_sample"], atol=1e-4, rtol=1e-5, err_msg=case["name"])


def test_ddpm_step_per_example_timesteps_and_key():
    """t (B,) steps each example as its own scalar t would; at t = 0 no noise is added."""
    abar = diffusion.alphas_cumprod(DiffusionConfig())
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x, out = jax.random.normal(k1, (3, 4, 4, 1)), jax.random.normal(k2, (3, 4, 4, 1))
    z = jax.random.normal(k3, x.shape)
    t = jnp.array([0, 5, 700])
    prev, _ = diffusion.ddpm_step(out, t, x, None, abar, noise=z)
    for i in range(3):
        one, _ = diffusion.ddpm_step(out[i : i + 1], t[i], x[i : i + 1], None, abar, noise=z[i : i + 1])
        np.testing.assert_allclose(prev[i : i + 1], one, atol=1e-6)
    keyed, _ = diffusion.ddpm_step(out, 0, x, jax.random.key(5), abar)
    unkeyed, _ = diffusion.ddpm_step(out, 0, x, None, abar, noise=jnp.zeros_like(x))
    np.testing.assert_array_equal(keyed, unkeyed)


@pytest.mark.parametrize("prediction", ["epsilon", "v"])
def test_diffusion_loss_targets(prediction):
    """An oracle that knows x0 inverts the forward process exactly: zero loss; predicting
    zeros costs the target's second moment (1 for epsilon)."""
    cfg = DiffusionConfig(prediction=prediction, num_train_timesteps=100)
    abar = diffusion.alphas_cumprod(cfg)
    x0 = jax.random.uniform(jax.random.key(1), (64, 4, 4, 1), minval=-1, maxval=1)
    labels = jnp.arange(64)
    seen = {}

    def oracle(x_t, t, y):
        seen["labels"] = y
        a = abar[t][:, None, None, None]
        eps = (x_t - jnp.sqrt(a) * x0) / jnp.sqrt(1 - a)
        return eps if prediction == "epsilon" else jnp.sqrt(a) * eps - jnp.sqrt(1 - a) * x0

    loss, metrics = diffusion.diffusion_loss(oracle, x0, jax.random.key(2), labels, cfg)
    assert float(loss) < 1e-6 and metrics["mse"] == loss and seen["labels"] is labels
    zero_loss, _ = jax.jit(lambda k: diffusion.diffusion_loss(lambda x, t, y: jnp.zeros_like(x), x0, k, None, cfg))(
        jax.random.key(3)
    )
    if prediction == "epsilon":
        assert 0.9 < float(zero_loss) < 1.1
    else:  # E[v^2] = abar E[eps^2] + (1 - abar) E[x0^2], between 1/3 and 1
        assert 1 / 3 < float(zero_loss) < 1.0


def test_docstring_examples():
    assert doctest.testmod(diffusion, optionflags=doctest.ELLIPSIS).failed == 0
