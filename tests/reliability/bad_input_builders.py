"""The bad inputs of tests/reliability/test_bad_inputs.py: each builder makes the files a case
needs (in the case's scratch folder) and returns the command line that must be refused."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil

import numpy as np

# tests/conftest.py, which pytest loads with tests/ on sys.path (so no conftest.py in this folder: it would shadow it)
from conftest import ROOT, tiny_overrides

LM = ROOT / "configs/lm_tiny.yaml"
UNET = ROOT / "configs/unet_digits.yaml"
HF_LLAMA = ROOT / "tests/fixtures/hf/llama"
# Any train case that slipped through validation would resume the fixture run at its last step
# (no training); the hash then catches a rewritten file.
FIXTURE_STEPS = ["train.steps=4", "checkpoint.every=2"]


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
    return train_argv(
        "data.source=tokens",
        f"data.train_path={c.tokens('train.bin', ids)}",
        f"data.val_path={c.tokens('val.bin', ids % 256)}",
    )(c)


def tokens_out_of_vocab_at_the_end(c):
    ids = np.arange((1 << 20) + 4096) % 256
    ids[-1] = 300  # past the first million tokens: only a check of the whole file sees it
    return train_argv(
        "data.source=tokens",
        f"data.train_path={c.tokens('train.bin', ids)}",
        f"data.val_path={c.tokens('val.bin', ids[:4096])}",
    )(c)


def tokens_empty(c):
    return train_argv(
        "data.source=tokens",
        f"data.train_path={c.write('empty.bin', b'')}",
        f"data.val_path={c.tokens('val.bin', np.arange(4096) % 256)}",
    )(c)


def tokens_missing(c):
    return train_argv(
        "data.source=tokens",
        f"data.train_path={c.tmp / 'missing.bin'}",
        f"data.val_path={c.tokens('val.bin', np.arange(4096) % 256)}",
    )(c)


def tokens_odd_bytes(c):
    # A text file passed as tokens: 4097 bytes cannot be uint16 ids.
    return train_argv(
        "data.source=tokens",
        f"data.train_path={c.write('train.txt', 'x' * 4097)}",
        f"data.val_path={c.tokens('val.bin', np.arange(4096) % 256)}",
    )(c)


def tokens_val_too_short_for_eval(c):
    # 200 tokens: enough for one 32-token window, far from the 8 x 2 windows evaluation takes.
    return train_argv(
        "data.source=tokens",
        f"data.train_path={c.tokens('train.bin', np.arange(4096) % 256)}",
        f"data.val_path={c.tokens('val.bin', np.arange(200) % 256)}",
    )(c)


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


TEXT_TOKENIZER = ROOT / "tests/fixtures/text_tokenizer"


def text_argv(*extra: str):
    """A `data.source: text` case on the trained run (its checks come before the run dir is read)."""
    return train_argv("data.source=text", *extra)


def text_glob_matches_nothing(c):
    return text_argv(f"data.text_files=[{c.tmp / 'corpus'}/*.txt]")(c)


def text_jsonl_malformed_line(c):
    path = c.write("corpus/docs.jsonl", '{"text": "a good line"}\n{"text": "no closing brace"\n')
    return text_argv(f"data.text_files=[{path}]")(c)


def text_field_missing(c):
    path = c.write("corpus/docs.jsonl", '{"body": "the text is here", "id": 1}\n')
    return text_argv(f"data.text_files=[{path}]")(c)


def text_tokenizer_missing(c):
    path = c.write("corpus/a.txt", "some text\n")
    return text_argv(f"data.text_files=[{path}]", f"data.tokenizer={c.tmp / 'no_tokenizer'}")(c)


def text_token_id_beyond_vocab(c):
    # The byte tokenizer's ids of "é" are 195 and 169: out of range for a 128-id model.
    path = c.write("corpus/a.txt", "caf\u00e9 " * 400)
    return text_argv(f"data.text_files=[{path}]", "model.vocab_size=128")(c)


def text_too_little_validation(c):
    # 40 short documents: about one goes to validation, far from the 8 x 2 windows evaluation takes.
    path = c.write("corpus/docs.jsonl", "".join(f'{{"text": "document {i} " }}\n' for i in range(40)))
    return text_argv(f"data.text_files=[{path}]", "data.val_fraction=0.05")(c)


def finetune_base_missing(c):
    return train_argv("finetune.method=lora", f"finetune.base={c.tmp / 'no_base_run'}", run=c.tmp / "ft_run")(c)


# Refusals of train/run_dir/identity.py and meshwork/run/checkpoint.py: a run.dir of another config, one holding
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
    return [
        "lm",
        "--hf",
        str(_hf_dir(c, (HF_LLAMA / "config.json").read_text(), data[: len(data) // 2])),
        "--prompt-ids",
        "1,2,3",
    ]


def hf_garbage_safetensors(c):
    return [
        "lm",
        "--hf",
        str(_hf_dir(c, (HF_LLAMA / "config.json").read_text(), b"\xff" * 64)),
        "--prompt-ids",
        "1,2,3",
    ]


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


def checkpoint_all_corrupt(c):
    return ["lm", "--checkpoint", str(_corrupt_checkpoints(c.copy_run())), "--prompt", "x"]


def diffusion_on_lm_run(c):
    return ["diffusion", "--checkpoint", str(c.run), "--num", "4", "--steps", "2", "--out", str(c.tmp / "g.png")]
