"""Fine-tuning a trained lm_tiny on documentation text: only the method's parameters train,
the frozen base is never differentiated, the loss on both texts is reported, QLoRA tracks
LoRA, and a sharded fine-tuning run resumes exactly."""

import json

import jax
import numpy as np
import pytest
from conftest import ROOT, optimized_override
from flax import nnx

from meshwork.config import ConfigError, load_config
from meshwork.inference.runs import load_run
from meshwork.inference.serve_cli import load_served
from meshwork.run.metrics import read_metrics
from meshwork.train.cli import main as train_main
from meshwork.train.finetune import describe
from meshwork.train.loop import train
from meshwork.train.optim import make_optimizer
from meshwork.train.state import abstract_state
from meshwork.train.trainer import build_trainer, check_runtime

STEPS = 60


def lora_config(base_dir, run_dir, *overrides):
    return load_config(
        ROOT / "configs/lora_tiny.yaml",
        [
            f"run.dir={run_dir}",
            f"finetune.base={base_dir}",
            f"train.steps={STEPS}",
            "log.eval_every=30",
            "log.progress=false",
            "log.tensorboard=false",
            "mesh.data=1",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def base(lm_tiny_runs):
    return lm_tiny_runs["1dev"]


@pytest.fixture(scope="module")
def tuned(base, tmp_path_factory):
    """LoRA and QLoRA runs of STEPS steps from the same base, on one device."""
    out = {}
    for method in ("lora", "qlora"):
        run_dir = tmp_path_factory.mktemp(method)
        out[method] = train(
            lora_config(base["run_dir"], run_dir, f"finetune.method={method}", optimized_override()),
            devices=jax.devices()[:1],
        )
    return out


# The tests that read the 60-step LoRA and QLoRA runs (`tuned`) are in the slow tier.
@pytest.mark.slow
def test_lora_learns_the_docs_and_reports_the_code_loss(base, tuned):
    run = tuned["lora"]
    # Step 0 is the base model exactly (B = 0): its loss on the code it was trained on is the
    # base run's own final validation loss, on the same batches.
    assert run["val_loss_base_data"][0] == pytest.approx(base["val_loss"][max(base["val_loss"])], abs=1e-5)
    docs_before, docs_after = run["val_loss"][0], run["val_loss"][STEPS]
    assert docs_after < docs_before - 0.1, run["val_loss"]
    rows = [r for r in read_metrics(run["run_dir"]) if "val_loss" in r]
    assert [r["step"] for r in rows] == [0, 30, 60] and all("val_loss_base_data" in r for r in rows)


@pytest.mark.slow
def test_only_the_lora_matrices_are_trained(base, tuned):
    state = tuned["lora"]["state"]
    params = jax.tree.leaves(state.params)
    cfg = load_config(ROOT / "configs/lora_tiny.yaml")
    L, D, H, G, K, r = (
        cfg.model.n_layers,
        cfg.model.d_model,
        cfg.model.n_heads,
        cfg.model.n_kv_heads,
        cfg.model.resolved_head_dim,
        cfg.finetune.rank,
    )
    # A and B for W_q (D -> H*K) and W_v (D -> G*K) in every layer.
    assert sum(p.size for p in params) == L * r * ((D + H * K) + (D + G * K))
    # Adam's moments exist for those alone.
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(m.size for m in moments) == 2 * sum(p.size for p in params)
    # The frozen base is bit for bit the base run's weights.
    base_params = jax.tree.leaves(nnx.state(load_run(base["run_dir"])[1], nnx.Param))  # its last checkpoint
    frozen = jax.tree.leaves(state.buffers)
    assert len(frozen) == len(base_params)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(frozen, base_params))


def test_frozen_weights_get_no_gradients_in_the_compiled_step(base, tmp_path):
    flops = {}
    for method in ("lora", "full"):
        cfg = lora_config(base["run_dir"], tmp_path / method, f"finetune.method={method}")
        trainer = build_trainer(cfg, check_runtime(cfg, jax.devices()[:1]), jax.devices()[:1]).compile()
        flops[method] = trainer.step_fn.cost_analysis()["flops"]
    # Full fine-tuning computes dW for every weight (~1/3 of a training step); LoRA only for A and B.
    assert flops["lora"] < 0.8 * flops["full"], flops


@pytest.mark.slow
def test_qlora_tracks_lora(tuned):
    lora, qlora = tuned["lora"]["val_loss"], tuned["qlora"]["val_loss"]
    # 4-bit base weights: the start is within 1% of LoRA's, and so is the loss after fine-tuning.
    assert qlora[0] == pytest.approx(lora[0], rel=0.01)
    assert qlora[STEPS] == pytest.approx(lora[STEPS], rel=0.02), (lora, qlora)
    frozen = tuned["qlora"]["state"].buffers
    int4 = [x for x in jax.tree.leaves(frozen) if x.dtype in (np.int8, np.uint8)]
    assert int4, "no 4-bit weights in the QLoRA base"


@pytest.mark.over_budget("three LoRA runs on 8 devices over the trained base: ~15 s", seconds=45)
def test_sharded_finetuning_resumes_exactly(base, tmp_path):
    # 4 steps, stopped and resumed after 2: a resume that is exact after 2 steps is exact after any.
    # One validation batch per evaluation (not lora_tiny's 4): the claim is the state, which no
    # evaluation touches, and the 3 runs' 5 evaluations of both texts were ~4 s of the test's ~20.
    fsdp = [
        "mesh.data=1",
        "mesh.fsdp=8",
        "rules.preset=fsdp",
        "train.steps=4",
        "log.eval_every=4",
        "checkpoint.every=2",
        "log.eval_batches=1",
    ]
    straight = train(lora_config(base["run_dir"], tmp_path / "straight", *fsdp))
    train(lora_config(base["run_dir"], tmp_path / "resumed", *fsdp, "train.stop_after=2"))
    resumed = train(lora_config(base["run_dir"], tmp_path / "resumed", *fsdp))
    assert resumed["resumed_from"] == 2
    for a, b in zip(jax.tree.leaves(straight["state"]), jax.tree.leaves(resumed["state"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The frozen base is split over the 8 devices like the trainable weights.
    wq = jax.tree.leaves(straight["state"].buffers)[0]
    assert len(wq.addressable_shards) == 8


def test_startup_prints_the_accounting(base, tmp_path, capsys):
    assert (
        train_main(
            [
                "--config",
                str(ROOT / "configs/lora_tiny.yaml"),
                "--dry-run",
                "--json",
                f"finetune.base={base['run_dir']}",
                f"run.dir={tmp_path}",
                "mesh.data=-1",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    state = report["state"]
    assert (
        state["frozen"] > 10 * state["params"] and 0 <= state["opt_state"] - 2 * state["params"] < 64
    )  # + step counts
    # The human-readable start-up line: LoRA r=8 on W_q (128 -> 4x32) and W_v (128 -> 2x32), 4 layers.
    cfg = lora_config(base["run_dir"], tmp_path)
    text = describe(cfg, abstract_state(cfg, make_optimizer(cfg.optimizer, cfg.train.steps)[0])[1])
    trainable = 4 * 8 * ((128 + 128) + (128 + 64))
    assert f"{trainable:,} trainable of {853_120 + trainable:,} parameters" in text
    assert f"gradients {trainable * 4 / 2**20:.2f} MiB, optimizer state {2 * trainable * 4 / 2**20:.2f} MiB" in text


@pytest.mark.parametrize(
    "override, message",
    [
        ("finetune.base=/nonexistent/run", "has no config.yaml"),
        ("model.d_model=64", "model.d_model: the base run"),
        ("finetune.base=null", "finetune.base"),
    ],
)
def test_bad_finetune_configs_exit_2(base, tmp_path, capsys, override, message):
    argv = [
        "--config",
        str(ROOT / "configs/lora_tiny.yaml"),
        f"finetune.base={base['run_dir']}",
        f"run.dir={tmp_path / 'new'}",
        override,
    ]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_a_lora_run_generates_merged(tuned, capsys):
    """`python -m inference lm` on a LoRA run merges the deltas into W0 (the base's cost) and
    generates what the unmerged model generates."""
    from meshwork.engine.generate import Generator
    from meshwork.engine.sampling import SamplingParams
    from meshwork.inference.cli import main as inference_main
    from meshwork.inference.runs import load_run

    run_dir = str(tuned["lora"]["run_dir"])
    prompt = [int(b) for b in b"The return statement"]
    unmerged = Generator(load_run(run_dir)[1]).generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=12))
    assert (
        inference_main(
            [
                "lm",
                "--checkpoint",
                run_dir,
                "--prompt",
                "The return statement",
                "--temperature",
                "0",
                "--max-new-tokens",
                "12",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == "The return statement" + bytes(unmerged[0]).decode(errors="replace") + "\n"
    # Serving it in another dtype would rebuild the unmerged model: refused in one line.
    with pytest.raises(ConfigError, match="--dtype bfloat16: .* is a lora fine-tuning run; .*export-hf --merge"):
        load_served(run_dir, dtype="bfloat16")


@pytest.mark.slow
def test_a_lora_run_exports_merged_and_as_a_peft_adapter(tuned, tmp_path, capsys):
    """export-hf --merge writes the base with the deltas added (the LoRA model's logits); without
    --merge a LoRA run is refused; export-peft writes the adapter."""
    from meshwork.inference.cli import main as inference_main
    from meshwork.inference.runs import load_run
    from meshwork.models.hf import load_hf_model

    run_dir = str(tuned["lora"]["run_dir"])
    assert inference_main(["export-hf", "--checkpoint", run_dir, "--out", str(tmp_path / "plain")]) == 2
    assert "pass --merge" in capsys.readouterr().err and not (tmp_path / "plain").exists()
    assert inference_main(["export-hf", "--checkpoint", run_dir, "--out", str(tmp_path / "merged"), "--merge"]) == 0
    tokens = np.arange(32, dtype=np.int32).reshape(2, 16) + 60
    want = np.asarray(load_run(run_dir)[1](tokens))
    got = np.asarray(load_hf_model(tmp_path / "merged")[1](tokens))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert inference_main(["export-peft", "--checkpoint", run_dir, "--out", str(tmp_path / "peft")]) == 0
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
