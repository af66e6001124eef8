"""LoRA on a Hugging Face checkpoint with its own tokenizer and the user's own text: the Llama
fixture (tests/fixtures/hf/llama) with a tokenizer.json (tests/fixtures/text_tokenizer), on a
folder of .jsonl documents. The base is loaded exactly, the loss falls, a resumed run equals an
uninterrupted one bit for bit, and a model key that disagrees with the checkpoint is one line.
(peft loading the exported adapter is checked by tests/fixtures/check_hf_lora_text.py.)"""

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
from conftest import ROOT, optimized_override
from flax import nnx

from meshwork.config import load_config
from meshwork.evaluation.lm_loss import validation_loss
from meshwork.models.hf import load_hf_checkpoint, model_from_hf
from meshwork.train.cli import main as train_main
from meshwork.train.finetune import with_base_model
from meshwork.train.loop import train
from meshwork.train.task import make_task
from meshwork.train.trainer import build_trainer, check_runtime

STEPS = 40


def hf_base_with_tokenizer(folder: pathlib.Path) -> pathlib.Path:
    """A Hugging Face checkpoint folder as people download one: config.json, safetensors, tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(ROOT / "tests/fixtures/hf/llama" / name, folder / name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "tests/fixtures/text_tokenizer" / name, folder / name)
    return folder


def jsonl_corpus(folder: pathlib.Path) -> pathlib.Path:
    """The reference-manual topics pydoc ships (real English prose), one document per line,
    spread over three .jsonl files."""
    from pydoc_data.topics import topics

    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(topics)
    for part in range(3):
        with open(folder / f"part{part}.jsonl", "w") as f:
            for name in names[part::3]:
                f.write(json.dumps({"title": name, "text": topics[name]}) + "\n")
    return folder


def lora_overrides(base: pathlib.Path, corpus: pathlib.Path, run_dir: pathlib.Path, steps: int) -> list[str]:
    return [
        f"run.dir={run_dir}",
        f"finetune.base={base}",
        "finetune.method=lora",
        "finetune.targets=[q,k,v,o]",
        "finetune.rank=8",
        "data.source=text",
        f"data.text_files=[{corpus}/*.jsonl]",
        "data.text_field=text",
        "data.tokenizer=null",
        "data.seq_len=64",
        "data.val_fraction=0.1",
        "train.global_batch=8",
        f"train.steps={steps}",
        "optimizer.lr=1e-2",
        "optimizer.warmup_steps=5",
        "optimizer.weight_decay=0.0",
        "log.eval_every=20",
        "log.eval_batches=2",
        "log.progress=false",
        "log.tensorboard=false",
        "checkpoint.every=20",
        "mesh.data=1",
        optimized_override(),
    ]


def lora_config(tmp: pathlib.Path, run_dir: pathlib.Path, steps: int = STEPS, *extra: str):
    cfg = load_config(
        ROOT / "configs/lora_hf_text.yaml", [*lora_overrides(tmp / "base", tmp / "corpus", run_dir, steps), *extra]
    )
    return with_base_model(cfg)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_text")
    hf_base_with_tokenizer(tmp / "base")
    jsonl_corpus(tmp / "corpus")
    return tmp


@pytest.fixture(scope="module")
def straight(setup):
    return train(lora_config(setup, setup / "straight"), devices=jax.devices()[:1])


def test_the_model_and_tokenizer_come_from_the_checkpoint(setup):
    cfg = lora_config(setup, setup / "unused")
    base_cfg, _ = model_from_hf(setup / "base")
    assert cfg.model == base_cfg.model_copy(update={"attention": cfg.model.attention})
    assert pathlib.Path(cfg.data.tokenizer) == setup / "base" / "tokenizer.json"


@pytest.mark.slow  # trains 40 + 20 + 20 steps
def test_step_zero_is_the_checkpoint_exactly(setup, straight):
    """LoRA's B starts at zero: the step-0 validation loss is the Hugging Face model's own."""
    cfg = lora_config(setup, setup / "straight")
    _, model = model_from_hf(setup / "base")
    assert straight["val_loss"][0] == pytest.approx(validation_loss(model, make_task(cfg).eval_batches()), abs=1e-5)


@pytest.mark.slow  # trains 40 + 20 + 20 steps
def test_the_loss_falls_on_the_users_text(straight):
    losses = straight["val_loss"]
    print(f"validation loss {losses[0]:.4f} at step 0 -> {losses[STEPS]:.4f} at step {STEPS}")
    assert losses[STEPS] < losses[0] - 0.2, losses


@pytest.mark.slow  # trains 40 + 20 + 20 steps
def test_a_resumed_run_equals_an_uninterrupted_one(setup, straight):
    run_dir = setup / "resumed"
    train(lora_config(setup, run_dir, STEPS, f"train.stop_after={STEPS // 2}"), devices=jax.devices()[:1])
    resumed = train(lora_config(setup, run_dir), devices=jax.devices()[:1])
    assert resumed["resumed_from"] == STEPS // 2
    a, b = jax.tree.leaves(straight["state"].params), jax.tree.leaves(resumed["state"].params)
    assert len(a) == len(b) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
    assert resumed["val_loss"][STEPS] == straight["val_loss"][STEPS]


def test_a_model_key_that_disagrees_with_the_checkpoint_is_one_line(setup, capsys):
    run_dir = setup / "refused"
    argv = [
        "--config",
        str(ROOT / "configs/lora_hf_text.yaml"),
        *lora_overrides(setup / "base", setup / "corpus", run_dir, 2),
        "model.n_layers=5",
    ]
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "model.n_layers" in err and "=3" in err and "drop model.n_layers" in err
    assert not run_dir.exists()


def test_full_fine_tuning_from_the_folder_starts_from_its_weights(setup):
    """method full (continued pre-training): the trained parameters start as the file's tensors."""
    cfg = lora_config(setup, setup / "full", 2, "finetune.method=full")
    devices = jax.devices()[:1]
    state = build_trainer(cfg, check_runtime(cfg, devices), devices).init_state()  # layout only: no compile
    _, want = load_hf_checkpoint(setup / "base")
    got = nnx.to_pure_dict(state.params)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
