"""Input hardening (issue #10): every user-facing entry point answers bad input with one
line on stderr that names the culprit (dotted key, file or flag) and the fix, exit
status 2, no traceback, and leaves existing run directories exactly as they were.

Most cases call the `main(argv)` functions in-process (fast: jax is imported once);
a few run as real subprocesses to prove the process's exit status and stderr.
Every train-CLI case points `run.dir` at one real trained run (or a copy of it), whose
bytes are hashed before and after.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest

# tests/conftest.py, which pytest loads with tests/ on sys.path (so no conftest.py in this folder: it would shadow it)
from conftest import ROOT, tiny_overrides

LM = ROOT / "configs/lm_tiny.yaml"
UNET = ROOT / "configs/unet_digits.yaml"
HF_LLAMA = ROOT / "tests/fixtures/hf/llama"
# Any train case that slipped through validation would resume the fixture run at its last step
# (no training); the hash then catches a rewritten file.
FIXTURE_STEPS = ["train.steps=4", "checkpoint.every=2"]


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> pathlib.Path:
    """One tiny LM trained 4 steps: config.yaml, metrics.jsonl and checkpoints 2 and 4."""
    from meshwork.config import load_config
    from meshwork.train.loop import train

    run = tmp_path_factory.mktemp("bad_inputs") / "run"
    train(load_config(LM, [*tiny_overrides(run), *FIXTURE_STEPS]))
    assert (run / "config.yaml").is_file() and (run / "metrics.jsonl").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
    return run


def tree_digest(root: pathlib.Path) -> str:
    """sha256 over the sorted relative paths (directories too) and the bytes of every file."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


@dataclasses.dataclass
class Ctx:
    """What a case builds its argv from: the trained run, a scratch folder, and the
    folders whose bytes must not change (the run, plus any a case registers)."""

    run: pathlib.Path
    tmp: pathlib.Path
    guarded: list[pathlib.Path]

    def guard(self, path: pathlib.Path) -> pathlib.Path:
        self.guarded.append(path)
        return path

    def copy_run(self) -> pathlib.Path:
        return self.guard(pathlib.Path(shutil.copytree(self.run, self.tmp / "run_copy")))

    def write(self, name: str, content: str | bytes) -> pathlib.Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path

    def tokens(self, name: str, ids) -> pathlib.Path:
        return self.write(name, np.asarray(ids, np.uint16).tobytes())


def train_argv(*extra: str, config: pathlib.Path | str = LM, run: pathlib.Path | None = None):
    """A `python -m train` case: the tiny fixture config on run.dir (default: the trained run)."""
    return lambda c: ["--config", str(config), *tiny_overrides(run or c.run), *FIXTURE_STEPS, *extra]


def lm_argv(*extra: str):
    """A `python -m inference lm` case on the trained run."""
    return lambda c: ["lm", "--checkpoint", str(c.run), *extra]


def _entry(name: str) -> Callable[[list[str]], int]:
    if name == "train":
        from meshwork.train.cli import main
    elif name == "plan":
        from meshwork.train.plan import main
    else:
        from meshwork.inference.cli import main
    return main


# ---------------------------------------------------------------- case builders (files)


def malformed_yaml(c):
    return ["--config", str(c.write("bad.yaml", "model: {d_model: 64\ntrain: [steps: 3\n")), f"run.dir={c.run}"]


def top_level_list(c):
    return ["--config", str(c.write("list.yaml", "- model\n- train\n")), f"run.dir={c.run}"]


def include_cycle(c):
    c.write("a.yaml", "include: b.yaml\ntrain: {steps: 3}\n")
    c.write("b.yaml", "include: a.yaml\n")
    return ["--config", str(c.tmp / "a.yaml"), f"run.dir={c.run}"]


def missing_include(c):
    return ["--config", str(c.write("child.yaml", "include: no_such_base.yaml\n")), f"run.dir={c.run}"]


def tokens_out_of_vocab(c):
    ids = np.arange(4096) % 300  # ids up to 299, model.vocab_size=256
    return train_argv("data.source=tokens", f"data.train_path={c.tokens('train.bin', ids)}",
                      f"data.val_path={c.tokens('val.bin', ids % 256)}")(c)


def tokens_empty(c):
    return train_argv("data.source=tokens", f"data.train_path={c.write('empty.bin', b'')}",
                      f"data.val_path={c.tokens('val.bin', np.arange(4096) % 256)}")(c)


def tokens_missing(c):
    return train_argv("data.source=tokens", f"data.train_path={c.tmp / 'missing.bin'}",
                      f"data.val_path={c.tokens('val.bin', np.arange(4096) % 256)}")(c)


def tokens_odd_bytes(c):
    # A text file passed as tokens: 4097 bytes cannot be uint16 ids.
    return train_argv("data.source=tokens", f"data.train_path={c.write('train.txt', 'x' * 4097)}",
                      f"data.val_path={c.tokens('val.bin', np.arange(4096) % 256)}")(c)


def tokens_val_too_short_for_eval(c):
    # 200 tokens: enough for one 32-token window, far from the 8 x 2 windows evaluation takes.
    return train_argv("data.source=tokens", f"data.train_path={c.tokens('train.bin', np.arange(4096) % 256)}",
                      f"data.val_path={c.tokens('val.bin', np.arange(200) % 256)}")(c)


def image_dir_missing(c):
    return train_argv("data.source=images", f"data.image_dir={c.tmp / 'no_images'}", config=UNET)(c)


def _png(path: pathlib.Path, value: int) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8), value, np.uint8)).save(path)


def image_not_an_image(c):
    for i in range(40):
        _png(c.tmp / "imgs" / f"{i}.png", i)
    c.write("imgs/x.png", "this is a text file, not a PNG\n")
    return train_argv("data.source=images", f"data.image_dir={c.tmp / 'imgs'}", config=UNET)(c)


def image_folder_without_images(c):
    c.write("imgs/readme.txt", "no images here\n")
    return train_argv("data.source=images", f"data.image_dir={c.tmp / 'imgs'}", config=UNET)(c)


def image_too_few_for_a_split(c):
    _png(c.tmp / "imgs" / "only.png", 7)  # one image: the validation split is empty
    return train_argv("data.source=images", f"data.image_dir={c.tmp / 'imgs'}", config=UNET)(c)


def finetune_base_missing(c):
    return train_argv("finetune.method=lora", f"finetune.base={c.tmp / 'no_base_run'}",
                      run=c.tmp / "ft_run")(c)


# Refusals of train/run_dir.py and meshwork/run/checkpoint.py: a run.dir of another config, one holding
# something else, one whose every checkpoint is damaged.
def run_dir_of_another_config(c):
    return train_argv("optimizer.lr=0.01", run=c.copy_run())(c)


def run_dir_unrelated_files(c):
    d = c.guard(c.tmp / "not_a_run")
    (d / "notes").mkdir(parents=True)
    (d / "notes" / "todo.txt").write_text("my own files\n")
    return train_argv(run=d)(c)


def _corrupt_checkpoints(run: pathlib.Path) -> pathlib.Path:
    """Truncates every non-empty file of every checkpoint (as a full disk or a killed copy would)."""
    for step in (run / "checkpoints").iterdir():
        if step.name.isdigit():
            for f in step.rglob("*"):
                if f.is_file() and f.stat().st_size > 0:
                    os.truncate(f, f.stat().st_size // 2)
    return run


def run_dir_all_checkpoints_corrupt(c):
    return train_argv(run=_corrupt_checkpoints(c.copy_run()))(c)


# ---------------------------------------------------------------- case builders (inference, HF)


def _hf_dir(c, config: dict | str, weights: bytes | None = None) -> pathlib.Path:
    d = c.tmp / "hf"
    d.mkdir()
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    shutil.copy(HF_LLAMA / "model.safetensors", d / "model.safetensors")
    if weights is not None:
        (d / "model.safetensors").write_bytes(weights)
    return d


def hf_unsupported_architecture(c):
    cfg = json.loads((HF_LLAMA / "config.json").read_text())
    cfg |= {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    return ["lm", "--hf", str(_hf_dir(c, cfg)), "--prompt-ids", "1,2,3"]


def hf_truncated_safetensors(c):
    data = (HF_LLAMA / "model.safetensors").read_bytes()
    return ["lm", "--hf", str(_hf_dir(c, (HF_LLAMA / "config.json").read_text(), data[: len(data) // 2])),
            "--prompt-ids", "1,2,3"]


def hf_garbage_safetensors(c):
    return ["lm", "--hf", str(_hf_dir(c, (HF_LLAMA / "config.json").read_text(), b"\xff" * 64)),
            "--prompt-ids", "1,2,3"]


def hf_malformed_config_json(c):
    return ["lm", "--hf", str(_hf_dir(c, '{"model_type": "llama", ')), "--prompt-ids", "1,2,3"]


def hf_config_wrong_shape(c):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    d = _hf_dir(c, (HF_LLAMA / "config.json").read_text())
    # The same names, the embedding one column short: config.json no longer describes the weights.
    with safe_open(HF_LLAMA / "model.safetensors", framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:, :-1].copy()
    save_file(tensors, d / "model.safetensors")
    return ["lm", "--hf", str(d), "--prompt-ids", "1,2,3"]


def export_out_not_empty(c):
    out = c.guard(c.tmp / "export")
    out.mkdir()
    (out / "keep.txt").write_text("mine\n")
    return ["export-hf", "--checkpoint", str(c.run), "--out", str(out)]


def checkpoint_without_checkpoints(c):
    d = c.guard(c.tmp / "config_only")
    d.mkdir()
    shutil.copy(c.run / "config.yaml", d / "config.yaml")
    return ["lm", "--checkpoint", str(d), "--prompt", "x"]


def checkpoint_config_mismatch(c):
    # A run dir whose config.yaml no longer describes its checkpoint (an edited config).
    run = c.copy_run()
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text.replace("d_ff: 128", "d_ff: 256"))
    assert "d_ff: 256" in (run / "config.yaml").read_text()
    return ["lm", "--checkpoint", str(run), "--prompt", "x"]


def checkpoint_all_corrupt(c):
    return ["lm", "--checkpoint", str(_corrupt_checkpoints(c.copy_run())), "--prompt", "x"]


def diffusion_on_lm_run(c):
    return ["diffusion", "--checkpoint", str(c.run), "--num", "4", "--steps", "2", "--out", str(c.tmp / "g.png")]


# ---------------------------------------------------------------- the cases

P = pytest.param
CASES = [
    # --- config files
    P("train", malformed_yaml, r"bad\.yaml: not valid YAML", id="config-malformed-yaml"),
    P("train", lambda c: ["--config", str(c.tmp / "nope.yaml"), f"run.dir={c.run}"],
      r"nope\.yaml: config file not found", id="config-file-missing"),
    P("train", top_level_list, r"list\.yaml: expected a mapping", id="config-top-level-not-mapping"),
    P("train", include_cycle, r"a\.yaml: include cycle", id="config-include-cycle"),
    P("train", missing_include, r"no_such_base\.yaml: config file not found", id="config-include-missing"),
    # --- overrides and values
    P("train", train_argv("trian.steps=3"), r"trian: unknown key; did you mean train\b", id="unknown-section"),
    P("train", train_argv("train.step=3"), r"train\.step: unknown key; did you mean train\.steps\?",
      id="misspelled-key"),
    P("train", train_argv("train.steps=abc"), r"train\.steps: .*integer", id="wrong-type"),
    P("train", train_argv("model.d_model=-64"), r"model\.d_model: .*greater than 0", id="negative-size"),
    P("train", train_argv("train.global_batch=0"), r"train\.global_batch: .*greater than 0", id="zero-size"),
    P("train", train_argv("train.steps"), r"'train\.steps' is not of the form section\.key=value",
      id="override-without-equals"),
    P("train", train_argv("train.steps.x=1"), r"train\.steps\.x: steps is not a section", id="override-below-a-value"),
    P("train", train_argv("model.n_kv_heads=3"), r"model\.n_kv_heads: 3 does not divide model\.n_heads=4",
      id="kv-heads-not-dividing-heads"),
    P("train", train_argv("train.microbatches=3"), r"train\.microbatches: 3 does not divide train\.global_batch=8",
      id="microbatches-not-dividing-batch"),
    P("train", train_argv("model.kind=moe", "model.moe.n_experts=4", "model.moe.top_k=5"),
      r"model\.moe\.top_k: 5 exceeds model\.moe\.n_experts=4", id="moe-top-k-above-experts"),
    P("train", train_argv("finetune.method=lora"), r"finetune\.base: .*set finetune\.base", id="finetune-without-base"),
    # --- layout (needs the devices)
    P("train", train_argv("mesh.data=3"), r"mesh: data=3 uses 3 devices but 8 are available",
      id="mesh-not-matching-devices"),
    P("train", train_argv("mesh.data=-1", "mesh.fsdp=-1"), r"mesh.*at most one mesh axis may be -1",
      id="two-fill-axes"),
    P("train", train_argv("rules.preset=zero9"), r"rules\.preset: unknown preset 'zero9'", id="unknown-rules-preset"),
    P("train", train_argv("rules.overrides={embeddd: data}"), r"rules\.overrides: unknown logical axis 'embeddd'",
      id="unknown-logical-axis"),
    P("train", train_argv("train.global_batch=4", "mesh.data=8"),
      r"train\.global_batch: 4 sequences .* data\*fsdp=8; use a multiple of 8", id="batch-not-divisible-by-dp"),
    P("train", train_argv("--num-processes", "2"), r"--coordinator-address.*--num-processes",
      id="partial-distributed-flags"),
    # --- data
    P("train", tokens_out_of_vocab, r"data\.train_path: token id 299 .* model\.vocab_size=256",
      id="tokens-vocab-mismatch"),
    P("train", tokens_missing, r"data\.train_path: file not found: .*missing\.bin", id="tokens-file-missing"),
    P("train", tokens_empty, r"data\.train_path: .*empty\.bin holds fewer than 33 tokens", id="tokens-file-empty"),
    P("train", tokens_odd_bytes, r"data\.train_path: .*train\.txt has an odd number of bytes",
      id="tokens-file-not-uint16"),
    P("train", tokens_val_too_short_for_eval, r"data\.val_path: .*val\.bin.*log\.eval_batches",
      id="tokens-val-too-short-for-eval"),
    P("train", train_argv("data.source=digits"), r"data\.source: digits is image data", id="lm-on-image-data"),
    P("train", image_dir_missing, r"data\.image_dir: .*no_images.* is not a folder", id="image-dir-missing"),
    P("train", image_folder_without_images, r"data\.image_dir: .*no \.png/\.jpg/\.jpeg files",
      id="image-dir-without-images"),
    P("train", image_not_an_image, r"data\.image_dir: .*x\.png", id="image-file-not-an-image"),
    P("train", image_too_few_for_a_split, r"data\.val_fraction: 0\.1 of 1 images leaves", id="images-too-few-to-split"),
    # --- run directories and checkpoints
    P("train", train_argv("model.d_ff=256"), r"model\.d_ff: .* model\.d_ff=128, not 256",
      id="model-shape-vs-checkpoint"),
    P("train", finetune_base_missing, r"finetune\.base: .*no_base_run has no config\.yaml", id="finetune-base-missing"),
    P("train", run_dir_of_another_config, r"run\.dir.*run\.overwrite=true", id="run-dir-of-another-config"),
    P("train", run_dir_unrelated_files, r"run\.dir.*not_a_run", id="run-dir-not-a-meshwork-run"),
    P("train", run_dir_all_checkpoints_corrupt, r"checkpoint", id="run-dir-all-checkpoints-corrupt"),
    # --- the planner
    P("plan", lambda c: ["--config", str(LM), "--hardware", "h1000", "--devices", "8"], r"--hardware.*'h1000'",
      id="plan-unknown-hardware"),
    P("plan", lambda c: ["--config", str(LM), "--hardware", "h100", "--devices", "0"], r"--devices 0",
      id="plan-zero-devices"),
    P("plan", lambda c: ["--config", str(LM), "--hardware", "h100", "--devices", "8", "--nodes", "3"],
      r"--nodes 3", id="plan-nodes-not-dividing-devices"),
    P("plan", lambda c: ["--config", str(LM), "--hardware", "h100", "--devices", "8", "--efficiency", "1.5"],
      r"--efficiency 1\.5", id="plan-efficiency-above-one"),
    P("plan", lambda c: ["--config", str(LM), "--hardware", "h100", "--devices", "8", "--out", "x.yaml"],
      r"--out .*--search", id="plan-out-without-search"),
    P("plan", lambda c: ["--config", str(LM), "--hardware", "h100", "--devices", "eight"],
      r"argument --devices: invalid int value", id="plan-devices-not-a-number"),
    P("plan", lambda c: ["--config", str(LM), "--hardware", "h100", "--devices", "8", "mesh.data=3"],
      r"mesh: data=3 uses 3 devices but 8 are available", id="plan-mesh-not-matching-devices"),
    # --- inference
    P("inference", lambda c: ["lm", "--checkpoint", str(c.tmp / "no_run"), "--prompt", "x"],
      r"--checkpoint: .*no_run has no config\.yaml", id="lm-checkpoint-missing"),
    P("inference", checkpoint_without_checkpoints,
      r"--checkpoint: .*config_only/checkpoints holds no complete checkpoint", id="lm-run-without-checkpoints"),
    P("inference", checkpoint_config_mismatch, r"model\.d_ff: .*config\.yaml has model\.d_ff=256 .* trained with 128",
      id="lm-config-vs-checkpoint"),
    P("inference", checkpoint_all_corrupt, r"--checkpoint: .*checkpoints.*(cannot be read|no complete checkpoint)",
      id="lm-all-checkpoints-corrupt"),
    P("inference", lambda c: ["lm", "--hf", str(c.tmp / "no_hf"), "--prompt-ids", "1"],
      r"--hf: .*no_hf is not a directory", id="lm-hf-missing"),
    P("inference", lm_argv("--prompt", "x", "--top-p", "1.5"), r"top_p=1\.5: use a value in \(0, 1\]",
      id="lm-top-p-above-one"),
    P("inference", lm_argv("--prompt", "x", "--temperature", "-0.5"), r"temperature=-0\.5",
      id="lm-negative-temperature"),
    P("inference", lm_argv("--prompt", "x", "--max-new-tokens", "0"), r"max_new_tokens=0", id="lm-zero-new-tokens"),
    P("inference", lm_argv("--prompt", "x", "--stop-id", "300"), r"stop_tokens=\[300\]", id="lm-stop-id-out-of-vocab"),
    P("inference", lm_argv("--prompt-ids", "1,2,256"), r"token ids \[256\] are outside the model's vocabulary of 256",
      id="lm-prompt-ids-out-of-vocab"),
    P("inference", lm_argv("--prompt-ids", "1,two,3"), r"--prompt-ids '1,two,3'", id="lm-prompt-ids-not-integers"),
    P("inference", lambda c: ["lm", "--checkpoint", str(c.run), "--prompts-file", str(c.tmp / "none.txt")],
      r"--prompts-file: .*none\.txt does not exist", id="lm-prompts-file-missing"),
    P("inference", lm_argv("--prompt", "x", "--top-p", "high"), r"argument --top-p: invalid float value",
      id="lm-top-p-not-a-number"),
    P("inference", export_out_not_empty, r"--out: .*export is not empty", id="export-hf-out-not-empty"),
    P("inference", diffusion_on_lm_run, r"--checkpoint: .* trained a transformer", id="diffusion-on-an-lm-run"),
    P("inference", hf_unsupported_architecture, r"--hf: .*model_type='gpt2' is not supported",
      id="hf-unsupported-architecture"),
    P("inference", hf_truncated_safetensors, r"--hf: .*model\.safetensors: not a readable safetensors file",
      id="hf-truncated-safetensors"),
    P("inference", hf_garbage_safetensors, r"--hf: .*model\.safetensors: not a readable safetensors file",
      id="hf-not-a-safetensors-file"),
    P("inference", hf_malformed_config_json, r"--hf: .*config\.json: not valid JSON", id="hf-malformed-config-json"),
    P("inference", hf_config_wrong_shape, r"--hf: tensor 'model\.embed_tokens\.weight' has shape",
      id="hf-config-vs-weights"),
]


@pytest.mark.parametrize("entry, build, pattern", CASES)
def test_bad_input_is_one_line_status_2_and_touches_nothing(entry, build, pattern, trained_run, tmp_path, capsys):
    ctx = Ctx(trained_run, tmp_path, [trained_run])
    argv = build(ctx)
    before = {p: tree_digest(p) for p in ctx.guarded}
    capsys.readouterr()
    try:
        code = _entry(entry)(argv)
    except SystemExit as e:  # argparse's errors: usage, then one "error:" line, status 2
        code = e.code
        usage = True
    else:
        usage = False
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and (usage or len(lines) == 1), err
    assert re.search(pattern, errors[0]), errors[0]
    for path, digest in before.items():
        assert tree_digest(path) == digest, f"{path} changed"


# ---------------------------------------------------------------- real processes


def _run(module: str, *args: str, cwd) -> subprocess.CompletedProcess:
    """`python3 -m meshwork.<module>` from `cwd` (a folder outside the checkout): the installed form."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", f"meshwork.{module}", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("module, args, pattern", [
    P("train", lambda run: ["--config", str(LM), f"run.dir={run}", "train.step=3"],
      r"train\.step: unknown key; did you mean train\.steps", id="train-misspelled-key"),
    P("train", lambda run: ["--config", str(LM), f"run.dir={run}", "mesh.data=3"], r"mesh", id="train-mesh-vs-devices"),
    P("inference", lambda run: ["lm", "--checkpoint", str(run), "--prompt", "x", "--top-p", "1.5"], r"top_p=1\.5",
      id="inference-top-p"),
])
def test_subprocess_exit_status_2_without_traceback(module, args, pattern, trained_run, tmp_path):
    before = tree_digest(trained_run)
    proc = _run(module, *args(trained_run), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(pattern, lines[0]), proc.stderr
    assert tree_digest(trained_run) == before
