"""Hugging Face checkpoints: layer-at-a-time loading onto devices, and export back (no torch).

`load_hf_model` must keep host memory near one tensor (measured with tracemalloc,
which sees numpy's and safetensors' buffers but not XLA's device buffers), place
every weight in its sharding, and agree with `load_hf_checkpoint`; `export_hf`
must be the exact inverse of the loader. tests/fixtures/check_hf_export.py
checks separately that transformers reads the exports (it needs torch).
"""

import doctest
import json
import tracemalloc
import warnings

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import ROOT
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

import meshwork.inference.hf_export
import meshwork.models.hf
import meshwork.models.hf.config
import meshwork.models.hf.files
import meshwork.models.hf.layout
from meshwork.config import load_config
from meshwork.config_sections import ModelConfig, MoEConfig
from meshwork.inference.hf_export import export_hf, hf_model_type
from meshwork.models.hf import build_hf_model, hf_param_shardings, load_hf_checkpoint, load_hf_config, load_hf_model
from meshwork.models.moe import MoETransformer
from meshwork.models.transformer import Transformer
from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.rules import rules_for

FIXTURES = ROOT / "tests/fixtures/hf"

# A ~45 MB Llama: one layer's tensors are 3.75 MB (< 1/6 of the file), the largest tensor 4 MB.
L, D, F, V, H, G = 10, 256, 1024, 4096, 8, 4
K = D // H


def _llama_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    def w(*shape):
        return rng.standard_normal(shape, dtype=np.float32) / np.float32(shape[-1] ** 0.5)

    t = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": 1 + w(D) / 4, "lm_head.weight": w(V, D)}
    for i in range(L):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": 1 + w(D) / 4,
            p + "post_attention_layernorm.weight": 1 + w(D) / 4,
            p + "self_attn.q_proj.weight": w(H * K, D),
            p + "self_attn.k_proj.weight": w(G * K, D),
            p + "self_attn.v_proj.weight": w(G * K, D),
            p + "self_attn.o_proj.weight": w(D, H * K),
            p + "mlp.gate_proj.weight": w(F, D),
            p + "mlp.up_proj.weight": w(F, D),
            p + "mlp.down_proj.weight": w(D, F),
        }
    return t


@pytest.fixture(scope="module")
def big_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("big_llama")
    save_file(_llama_tensors(np.random.default_rng(0)), path / "model.safetensors")
    config = dict(
        model_type="llama",
        vocab_size=V,
        hidden_size=D,
        intermediate_size=F,
        num_hidden_layers=L,
        num_attention_heads=H,
        num_key_value_heads=G,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    (path / "config.json").write_text(json.dumps(config))
    return path


def _file_tensor(path, name: str) -> np.ndarray:
    with safe_open(path / "model.safetensors", framework="numpy") as f:
        return f.get_tensor(name)


def test_safetensors_arrays_own_their_memory(tmp_path):
    """TensorReader.get skips a copy because get_tensor returns a fresh buffer, not a view of
    the mapping; a safetensors version that changed this must fail here, not corrupt models."""
    save_file({"x": np.arange(6, dtype=np.float32).reshape(2, 3)}, tmp_path / "a.safetensors")
    with safe_open(tmp_path / "a.safetensors", framework="numpy") as f:
        a, b = f.get_tensor("x"), f.get_tensor("x")
    assert not np.shares_memory(a, b)
    a[0, 0] = 42.0  # writable, and closing the file left it valid
    np.testing.assert_array_equal(b, np.arange(6, dtype=np.float32).reshape(2, 3))


def test_load_hf_model_holds_about_one_tensor_in_host_memory(big_llama):
    size = (big_llama / "model.safetensors").stat().st_size
    layer = sum(
        x.nbytes for k, x in _llama_tensors(np.random.default_rng(0)).items() if k.startswith("model.layers.0.")
    )
    assert 40e6 < size < 60e6 and layer < size / 6
    load_hf_model(FIXTURES / "llama")  # imports and jax's first-use caches are not the loader's memory

    def traced_peak(load):
        tracemalloc.start()
        try:
            out = load(big_llama)
            return tracemalloc.get_traced_memory()[1], out
        finally:
            tracemalloc.stop()

    # Calibration: tracemalloc does see what safetensors reads (the all-numpy path holds the model).
    peak_numpy, _ = traced_peak(load_hf_checkpoint)
    assert peak_numpy > size
    peak, (cfg, model) = traced_peak(load_hf_model)
    print(
        f"file {size / 2**20:.1f} MiB, one layer {layer / 2**20:.2f} MiB, "
        f"load_hf_model peak {peak / 2**20:.2f} MiB, load_hf_checkpoint peak {peak_numpy / 2**20:.1f} MiB"
    )
    assert peak < size / 4

    # The model holds the file's tensors, layer by layer in place.
    assert (cfg.n_layers, cfg.d_model, cfg.d_ff) == (L, D, F)
    np.testing.assert_array_equal(model.embed.table[...], _file_tensor(big_llama, "model.embed_tokens.weight"))
    np.testing.assert_array_equal(model.head.lm_head[...], _file_tensor(big_llama, "lm_head.weight").T)
    for i in (0, 6, L - 1):
        p = f"model.layers.{i}."
        np.testing.assert_array_equal(
            model.blocks.attn.wq[...][i], _file_tensor(big_llama, p + "self_attn.q_proj.weight").T.reshape(D, H, K)
        )
        np.testing.assert_array_equal(
            model.blocks.attn.wo[...][i], _file_tensor(big_llama, p + "self_attn.o_proj.weight").T.reshape(H, K, D)
        )
        np.testing.assert_array_equal(
            model.blocks.mlp.w_down[...][i], _file_tensor(big_llama, p + "mlp.down_proj.weight").T
        )
        np.testing.assert_array_equal(
            model.blocks.mlp_norm.scale[...][i], _file_tensor(big_llama, p + "post_attention_layernorm.weight")
        )


def test_sharded_load_gives_the_unsharded_logits(big_llama):
    mesh = make_mesh({"data": 4, "tensor": 2})
    shardings = hf_param_shardings(load_hf_config(big_llama), mesh, rules_for("tp"))
    _, sharded = load_hf_model(big_llama, shardings=shardings)
    _, single = load_hf_model(big_llama)

    wq = sharded.blocks.attn.wq[...]  # (layers, D, H, K), heads split over tensor
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor", None)
    assert {s.data.shape for s in wq.addressable_shards} == {(L, D, H // 2, K)}
    assert sharded.head.lm_head[...].addressable_shards[0].data.shape == (D, V // 2)
    tokens = np.random.default_rng(1).integers(0, V, (4, 16), dtype=np.int32)
    np.testing.assert_allclose(np.asarray(sharded(tokens)), np.asarray(single(tokens)), atol=2e-5, rtol=0)


@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen2_moe"])
def test_load_hf_model_equals_load_hf_checkpoint(name):
    """Both loaders walk one table; this covers expert stacking and leading dense layers too."""
    _, params = load_hf_checkpoint(FIXTURES / name)
    _, model = load_hf_model(FIXTURES / name)
    got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert jax.tree.structure(got) == jax.tree.structure(params)
    for g, want in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
        np.testing.assert_array_equal(g, want)


def test_bfloat16_file_is_cast_on_the_devices(tmp_path):
    with safe_open(FIXTURES / "llama/model.safetensors", framework="numpy") as f:
        save_file({k: f.get_tensor(k).astype(ml_dtypes.bfloat16) for k in f.keys()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((FIXTURES / "llama/config.json").read_text())
    _, bf16 = load_hf_checkpoint(tmp_path)
    _, f32_model = load_hf_model(tmp_path)
    _, bf16_model = load_hf_model(tmp_path, dtype=jax.numpy.bfloat16)
    for model, dtype in ((f32_model, np.float32), (bf16_model, ml_dtypes.bfloat16)):
        got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        for g, want in zip(jax.tree.leaves(got), jax.tree.leaves(bf16)):
            assert g.dtype == dtype
            np.testing.assert_array_equal(np.asarray(g), want.astype(dtype))


# ---------------------------------------------------------------- export


def _random_model(cfg: ModelConfig, seed: int = 0):
    """A meshwork model of `cfg` with every parameter random (norm scales near one), so a swapped
    mapping cannot hide behind an init. Built abstractly and filled: an eager init costs seconds."""
    cls = MoETransformer if cfg.kind == "moe" else Transformer
    shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0))), nnx.Param))
    rng = np.random.default_rng(seed)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: (
            (1.0 if "scale" in jax.tree_util.keystr(path) else 0.0)
            + rng.standard_normal(x.shape).astype(np.float32) / np.sqrt(x.shape[-1])
        ),
        shapes,
    )
    model = build_hf_model(cfg, params)
    assert isinstance(model, cls)
    return model


def _round_trip(tmp_path, cfg: ModelConfig, model):
    path = export_hf(cfg, model, tmp_path / "export", max_position_embeddings=128)
    config = json.loads((path / "config.json").read_text())
    cfg2, params2 = load_hf_checkpoint(path)
    want = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert jax.tree.structure(params2) == jax.tree.structure(want)
    for got, ref in zip(jax.tree.leaves(params2), jax.tree.leaves(want)):
        np.testing.assert_array_equal(got, np.asarray(ref))
    for field in (
        "kind",
        "vocab_size",
        "d_model",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "resolved_head_dim",
        "rope_theta",
        "norm_eps",
        "qkv_bias",
        "tie_embeddings",
        "init_std",
    ):
        assert getattr(cfg2, field) == getattr(cfg, field), field
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 24), dtype=np.int32)
    np.testing.assert_array_equal(np.asarray(build_hf_model(cfg2, params2)(tokens)), np.asarray(model(tokens)))
    return config, cfg2


@pytest.mark.parametrize("tied", [False, True])
def test_export_round_trip_transformer(tmp_path, tied):
    cfg = load_config(
        ROOT / "configs/lm_tiny.yaml",
        [f"model.tie_embeddings={str(tied).lower()}", "model.rope_theta=50000.0", "model.norm_eps=1e-6"],
    ).model
    config, _ = _round_trip(tmp_path, cfg, _random_model(cfg))
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is tied and config["max_position_embeddings"] == 128
    assert config["torch_dtype"] == config["dtype"] == "float32" and config["eos_token_id"] is None
    with safe_open(tmp_path / "export/model.safetensors", framework="numpy") as f:
        assert ("lm_head.weight" in f.keys()) is not tied


def test_export_round_trip_moe(tmp_path):
    moe_cfg = load_config(ROOT / "configs/moe_tiny.yaml").model
    # moe_tiny keeps a leading dense layer, which Mixtral cannot express; and Mixtral is
    # dropless, so the logits compare with meshwork's dropless forward.
    assert moe_cfg.moe.router == "softmax" and moe_cfg.moe.norm_topk_prob and moe_cfg.moe.first_dense_layers == 1
    cfg = moe_cfg.model_copy(
        update={"moe": moe_cfg.moe.model_copy(update={"first_dense_layers": 0, "capacity_factor": None})}
    )
    config, cfg2 = _round_trip(tmp_path, cfg, _random_model(cfg))
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 8
    assert (cfg2.moe.n_experts, cfg2.moe.top_k, cfg2.moe.d_expert) == (8, 2, 192)
    assert cfg2.moe.aux_loss_coef == cfg.moe.aux_loss_coef


@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen2", "qwen3", "qwen3_moe", "mistral", "qwen2_moe"])
def test_export_of_a_loaded_checkpoint_rewrites_its_tensors(tmp_path, name):
    """load then export reproduces the hub file's tensors bit for bit (the loader's exact inverse),
    in the checkpoint's own architecture (Mistral's, without a window, is Llama's)."""
    cfg, model = load_hf_model(FIXTURES / name)
    export_hf(cfg, model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())["model_type"]
    assert written == ("llama" if name == "mistral" else name)
    with (
        safe_open(FIXTURES / name / "model.safetensors", framework="numpy") as a,
        safe_open(tmp_path / "model.safetensors", framework="numpy") as b,
    ):
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            np.testing.assert_array_equal(a.get_tensor(k), b.get_tensor(k), err_msg=k)


@pytest.mark.parametrize(
    "cfg, match",
    [
        (
            ModelConfig(kind="moe", moe=MoEConfig(router="sigmoid", first_dense_layers=1)),
            "cannot export to Mixtral: moe.router='sigmoid'.*; moe.first_dense_layers=1",
        ),
        (
            ModelConfig(kind="moe", moe=MoEConfig(n_shared_experts=1, norm_topk_prob=False)),
            "norm_topk_prob=False.*n_shared_experts=1 \\(Mixtral has no shared experts\\)",
        ),
        (ModelConfig(qkv_bias=True, qk_norm=True), "cannot export to Qwen3: qkv_bias=True"),
        (ModelConfig(kind="moe", qkv_bias=True, moe=MoEConfig(router="softmax")), "cannot export to Mixtral: qkv_bias"),
        (
            ModelConfig(kind="moe", qk_norm=True, moe=MoEConfig(n_shared_experts=1)),
            "cannot export to Qwen3-MoE: moe.n_shared_experts=1",
        ),
        (ModelConfig(kind="unet"), "cannot export model.kind='unet'"),
    ],
)
def test_inexpressible_configs_raise(cfg, match):
    with pytest.raises(ValueError, match=match):
        hf_model_type(cfg)


def test_a_capacity_factor_moe_is_refused_unless_dropless_is_allowed(tmp_path):
    """Mixtral is dropless: exporting a capacity-factor run would silently compute other logits."""
    moe = load_config(ROOT / "configs/moe_tiny.yaml").model
    cfg = moe.model_copy(update={"moe": moe.moe.model_copy(update={"first_dense_layers": 0})})
    assert cfg.moe.capacity_factor == 1.25
    model = _random_model(cfg)
    with pytest.raises(
        ValueError,
        match=r"cannot export to Mixtral: moe.capacity_factor=1.25 \(Mixtral is dropless: "
        r"it computes the tokens this model drops.*--allow-dropless",
    ):
        export_hf(cfg, model, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    with pytest.warns(
        UserWarning,
        match=r"exporting moe.capacity_factor=1.25 .* as this model does with "
        r"capacity_factor null",
    ):
        path = export_hf(cfg, model, tmp_path / "allowed", allow_dropless=True)
    cfg2, params2 = load_hf_checkpoint(path)
    assert cfg2.moe.capacity_factor is None  # what the file computes: the dropless model
    for got, ref in zip(jax.tree.leaves(params2), jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))):
        np.testing.assert_array_equal(got, np.asarray(ref))


def test_a_tied_config_with_its_own_head_in_the_file_keeps_that_head(tmp_path):
    """transformers loads a file's lm_head.weight even where config.json says tied (and warns);
    dropping it would change every logit."""
    src = FIXTURES / "llama"
    config = json.loads((src / "config.json").read_text())
    assert not config["tie_word_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    (tmp_path / "model.safetensors").symlink_to(src / "model.safetensors")
    with pytest.warns(
        UserWarning,
        match=r"tie_word_embeddings=true, but the checkpoint's lm_head.weight differs "
        r"from model.embed_tokens.weight \(max \|difference\| .*using the file's lm_head",
    ):
        cfg, model = load_hf_model(tmp_path)
    assert not cfg.tie_embeddings
    golden = np.load(src / "golden.npz")
    got = np.asarray(model(golden["input_ids"]))
    assert np.abs(got - golden["logits"]).max() <= 1e-5 * np.abs(golden["logits"]).max()
    # A tied file that also stores the head as a copy of the embedding stays tied, silently.
    with safe_open(src / "model.safetensors", framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    save_file(tensors, copy / "model.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_hf_config(copy).tie_embeddings and load_hf_checkpoint(copy)[0].tie_embeddings


def test_export_refuses_the_loaded_qwen2_moe_and_stale_files(tmp_path):
    cfg, model = load_hf_model(FIXTURES / "qwen2_moe")
    # Exported as Qwen2-MoE (tests/test_hf_parity.py); without its shared expert's gate, as Mixtral.
    ungated = cfg.model_copy(update={"moe": cfg.moe.model_copy(update={"shared_expert_gate": False})})
    with pytest.raises(ValueError, match="qkv_bias=True.*n_shared_experts=1.*first_dense_layers=1"):
        export_hf(ungated, model, tmp_path)
    assert not any(tmp_path.iterdir())
    cfg, model = load_hf_model(FIXTURES / "llama")
    save_file({"x": np.zeros(1, np.float32)}, tmp_path / "model-00001-of-00002.safetensors")
    with pytest.raises(ValueError, match="already holds \\['model-00001-of-00002.safetensors'\\]"):
        export_hf(cfg, model, tmp_path)


@pytest.mark.parametrize(
    "module",
    [
        meshwork.models.hf,
        meshwork.models.hf.config,
        meshwork.models.hf.files,
        meshwork.models.hf.layout,
        meshwork.inference.hf_export,
    ],
)
def test_doctests(module, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0
