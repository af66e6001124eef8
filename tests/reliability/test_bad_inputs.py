"""Input hardening: every user-facing entry point answers bad input with one
line on stderr that names the culprit (dotted key, file or flag) and the fix, exit
status 2, no traceback, and leaves existing run directories exactly as they were.

Most cases call the `main(argv)` functions in-process (fast: jax is imported once);
a few run as real subprocesses to prove the process's exit status and stderr.
Every train-CLI case points `run.dir` at one real trained run (or a copy of it), whose
bytes are hashed before and after.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Callable

import pytest
from bad_input_builders import (
    FIXTURE_STEPS,
    LM,
    Ctx,
    checkpoint_all_corrupt,
    checkpoint_without_checkpoints,
    diffusion_on_lm_run,
    export_out_not_empty,
    finetune_base_missing,
    hf_config_wrong_shape,
    hf_garbage_safetensors,
    hf_malformed_config_json,
    hf_truncated_safetensors,
    hf_unsupported_architecture,
    image_dir_missing,
    image_folder_without_images,
    image_not_an_image,
    image_too_few_for_a_split,
    include_cycle,
    lm_argv,
    malformed_yaml,
    missing_include,
    run_dir_all_checkpoints_corrupt,
    run_dir_of_another_config,
    run_dir_unrelated_files,
    text_argv,
    text_field_missing,
    text_glob_matches_nothing,
    text_jsonl_malformed_line,
    text_token_id_beyond_vocab,
    text_tokenizer_missing,
    text_too_little_validation,
    tokens_empty,
    tokens_missing,
    tokens_odd_bytes,
    tokens_out_of_vocab,
    tokens_out_of_vocab_at_the_end,
    tokens_val_too_short_for_eval,
    top_level_list,
    train_argv,
)

# tests/conftest.py, which pytest loads with tests/ on sys.path (so no conftest.py in this folder: it would shadow it)
from conftest import tiny_overrides
from harness import tree_digest

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


def _entry(name: str) -> Callable[[list[str]], int]:
    if name == "train":
        from meshwork.train.cli import main
    elif name == "plan":
        from meshwork.train.plan import main
    else:
        from meshwork.inference.cli import main
    return main


# ---------------------------------------------------------------- the cases

P = pytest.param
CASES = [
    # --- config files
    P("train", malformed_yaml, r"bad\.yaml: not valid YAML", id="config-malformed-yaml"),
    P(
        "train",
        lambda c: ["--config", str(c.tmp / "nope.yaml"), f"run.dir={c.run}"],
        r"nope\.yaml: config file not found",
        id="config-file-missing",
    ),
    P("train", top_level_list, r"list\.yaml: expected a mapping", id="config-top-level-not-mapping"),
    P("train", include_cycle, r"a\.yaml: include cycle", id="config-include-cycle"),
    P("train", missing_include, r"no_such_base\.yaml: config file not found", id="config-include-missing"),
    P(
        "train",
        lambda c: ["--config", str(c.write("binary.yaml", bytes(range(256)) * 4)), f"run.dir={c.run}"],
        r"binary\.yaml: not a text file",
        id="config-binary-file",
    ),
    P(
        "train",
        lambda c: ["--config", str(c.write("inc.yaml", "include: 5\n")), f"run.dir={c.run}"],
        r"inc\.yaml: include: expected a file path",
        id="config-include-not-a-path",
    ),
    P(
        "train",
        lambda c: ["--config", str(c.write("inc.yaml", "include: [null]\n")), f"run.dir={c.run}"],
        r"inc\.yaml: include: expected a file path",
        id="config-include-null",
    ),
    P(
        "train",
        lambda c: ["--config", str(c.write("dup.yaml", "train:\n  steps: 3\n  steps: 4\n")), f"run.dir={c.run}"],
        r"dup\.yaml: line 3: key 'steps' appears twice",
        id="config-duplicate-key",
    ),
    P(
        "train",
        lambda c: [
            "--config",
            str(c.write("dup.yaml", "model: {d_model: 64}\nmodel: {d_model: 32}\n")),
            f"run.dir={c.run}",
        ],
        r"dup\.yaml: line 2: key 'model' appears twice",
        id="config-duplicate-section",
    ),
    # --- overrides and values
    P("train", train_argv("trian.steps=3"), r"trian: unknown key; did you mean train\b", id="unknown-section"),
    P(
        "train",
        train_argv("train.step=3"),
        r"train\.step: unknown key; did you mean train\.steps\?",
        id="misspelled-key",
    ),
    # A mesh the devices cannot fill (3 of the 8): it had its own process here; one process per
    # entry point is checked below.
    P("train", train_argv("mesh.data=3"), r"mesh", id="train-mesh-vs-devices"),
    P("train", train_argv("train.steps=abc"), r"train\.steps: .*integer", id="wrong-type"),
    P(
        "train",
        train_argv("train.steps=true"),
        r"train\.steps: expected a number, not the boolean true",
        id="bool-for-int",
    ),
    P("train", train_argv("train.steps=4294967296"), r"train\.steps: .*less than 2147483648", id="steps-overflow"),
    P("train", train_argv("optimizer.lr=.inf"), r"optimizer\.lr: .*finite", id="lr-infinite"),
    P("train", train_argv("optimizer.lr=.nan"), r"optimizer\.lr: .*finite", id="lr-nan"),
    P("train", train_argv("optimizer.b2=-1"), r"optimizer\.b2: .*greater than or equal to 0", id="beta-negative"),
    P("train", train_argv("optimizer.b1=1"), r"optimizer\.b1: .*less than 1", id="beta-one"),
    P("train", train_argv("optimizer.eps=0"), r"optimizer\.eps: .*greater than 0", id="eps-zero"),
    P("train", train_argv("model.rope_theta=0"), r"model\.rope_theta: .*greater than 0", id="rope-theta-zero"),
    P("train", train_argv("model.head_dim=-8"), r"model\.head_dim: .*greater than 0", id="head-dim-negative"),
    P("train", train_argv("model.norm_eps=0"), r"model\.norm_eps: .*greater than 0", id="norm-eps-zero"),
    P(
        "train",
        train_argv("optimizer.clip_norm=-1"),
        r"optimizer\.clip_norm: .*greater than or equal to 0",
        id="clip-norm-negative",
    ),
    P(
        "train",
        train_argv("optimizer.weight_decay=-0.1"),
        r"optimizer\.weight_decay: .*greater than or equal to 0",
        id="weight-decay-negative",
    ),
    P(
        "train",
        train_argv("train.stop_after=4294967296"),
        r"train\.stop_after: .*less than 2147483648",
        id="stop-after-overflow",
    ),
    P(
        "train",
        train_argv("log.every=true"),
        r"log\.every: expected a number, not the boolean true",
        id="bool-for-log-interval",
    ),
    P(
        "train",
        train_argv("run.allow_changes=[optimizer.nosuch]"),
        r"run\.allow_changes: 'optimizer\.nosuch' cannot change",
        id="allow-changes-unknown-key",
    ),
    P(
        "train",
        train_argv("run.allow_changes=[model.d_ff]"),
        r"run\.allow_changes: 'model\.d_ff' cannot change",
        id="allow-changes-shape-key",
    ),
    P(
        "train",
        train_argv("optimizer.lr=0.01"),
        r"optimizer\.lr: .*use run\.allow_changes=\[optimizer\.lr\]",
        id="drift-lr-not-allowed",
    ),
    P("train", train_argv("model.d_model=-64"), r"model\.d_model: .*greater than 0", id="negative-size"),
    P("train", train_argv("train.global_batch=0"), r"train\.global_batch: .*greater than 0", id="zero-size"),
    P(
        "train",
        train_argv("train.steps"),
        r"'train\.steps' is not of the form section\.key=value",
        id="override-without-equals",
    ),
    P("train", train_argv("train.steps.x=1"), r"train\.steps\.x: steps is not a section", id="override-below-a-value"),
    P(
        "train",
        train_argv("model.n_kv_heads=3"),
        r"model\.n_kv_heads: 3 does not divide model\.n_heads=4",
        id="kv-heads-not-dividing-heads",
    ),
    P(
        "train",
        train_argv("train.microbatches=3"),
        r"train\.microbatches: 3 does not divide train\.global_batch=8",
        id="microbatches-not-dividing-batch",
    ),
    P(
        "train",
        train_argv("model.kind=moe", "model.moe.n_experts=4", "model.moe.top_k=5"),
        r"model\.moe\.top_k: 5 exceeds model\.moe\.n_experts=4",
        id="moe-top-k-above-experts",
    ),
    P("train", train_argv("finetune.method=lora"), r"finetune\.base: .*set finetune\.base", id="finetune-without-base"),
    # --- layout (needs the devices)
    P(
        "train",
        train_argv("mesh.data=3"),
        r"mesh: data=3 uses 3 devices but 8 are available",
        id="mesh-not-matching-devices",
    ),
    P(
        "train",
        train_argv("mesh.data=-1", "mesh.fsdp=-1"),
        r"mesh.*at most one mesh axis may be -1",
        id="two-fill-axes",
    ),
    P("train", train_argv("rules.preset=zero9"), r"rules\.preset: unknown preset 'zero9'", id="unknown-rules-preset"),
    P(
        "train",
        train_argv("rules.overrides={embeddd: data}"),
        r"rules\.overrides: unknown logical axis 'embeddd'",
        id="unknown-logical-axis",
    ),
    P(
        "train",
        train_argv("train.global_batch=4", "mesh.data=8"),
        r"train\.global_batch: 4 sequences .* data\*fsdp=8; use a multiple of 8",
        id="batch-not-divisible-by-dp",
    ),
    P(
        "train",
        train_argv("--num-processes", "2"),
        r"--coordinator-address.*--num-processes",
        id="partial-distributed-flags",
    ),
    # --- data
    P(
        "train",
        tokens_out_of_vocab,
        r"data\.train_path: token id 299 .* model\.vocab_size=256",
        id="tokens-vocab-mismatch",
    ),
    P(
        "train",
        tokens_out_of_vocab_at_the_end,
        r"data\.train_path: token id 300 .* model\.vocab_size=256",
        id="tokens-vocab-mismatch-at-the-end",
    ),
    P("train", tokens_missing, r"data\.train_path: file not found: .*missing\.bin", id="tokens-file-missing"),
    P("train", tokens_empty, r"data\.train_path: .*empty\.bin holds fewer than 33 tokens", id="tokens-file-empty"),
    P(
        "train",
        tokens_odd_bytes,
        r"data\.train_path: .*train\.txt has an odd number of bytes",
        id="tokens-file-not-uint16",
    ),
    P(
        "train",
        tokens_val_too_short_for_eval,
        r"data\.val_path: .*val\.bin.*log\.eval_batches",
        id="tokens-val-too-short-for-eval",
    ),
    P("train", train_argv("data.source=digits"), r"data\.source: digits is image data", id="lm-on-image-data"),
    P("train", image_dir_missing, r"data\.image_dir: .*no_images.* is not a folder", id="image-dir-missing"),
    P(
        "train",
        image_folder_without_images,
        r"data\.image_dir: .*no \.png/\.jpg/\.jpeg files",
        id="image-dir-without-images",
    ),
    P("train", image_not_an_image, r"data\.image_dir: .*x\.png", id="image-file-not-an-image"),
    P("train", image_too_few_for_a_split, r"data\.val_fraction: 0\.1 of 1 images leaves", id="images-too-few-to-split"),
    P("train", text_argv(), r"data\.text_files: data\.source=text needs data\.text_files", id="text-without-files"),
    P(
        "train",
        text_glob_matches_nothing,
        r"data\.text_files: '.*corpus/\*\.txt' matches no file",
        id="text-glob-matches-nothing",
    ),
    P(
        "train",
        text_jsonl_malformed_line,
        r"data\.text_files: .*docs\.jsonl:2: not valid JSON",
        id="text-jsonl-malformed-line",
    ),
    P(
        "train",
        text_field_missing,
        r"data\.text_field: .*docs\.jsonl:1 has no field 'text' \(its fields: 'body', 'id'\)",
        id="text-field-missing",
    ),
    P(
        "train",
        text_tokenizer_missing,
        r"data\.tokenizer: no tokenizer\.json at .*no_tokenizer",
        id="text-tokenizer-missing",
    ),
    P(
        "train",
        text_token_id_beyond_vocab,
        r"data\.tokenizer: token id 195 .* model\.vocab_size=128; set "
        r"model\.vocab_size to the tokenizer's 256",
        id="text-token-id-beyond-vocab",
    ),
    P(
        "train",
        text_too_little_validation,
        r"data\.val_fraction: 0\.05 of the text .*log\.eval_batches",
        id="text-too-little-validation",
    ),
    P(
        "train",
        text_argv("data.text_files=[x.txt]", "train.pipeline=gpipe", "mesh.stage=2"),
        r"data\.source: text \(packed documents\) is not supported with train\.pipeline=gpipe",
        id="text-with-a-pipeline",
    ),
    P(
        "train",
        train_argv(
            "model.layer_types=[sliding_attention,full_attention]",
            "model.sliding_window=8",
            "train.pipeline=gpipe",
            "mesh.stage=2",
        ),
        r"model\.layer_types: layers of different kinds .* train\.pipeline=gpipe",
        id="layer-pattern-with-a-pipeline",
    ),
    # --- run directories and checkpoints
    P(
        "train",
        train_argv("model.d_ff=256"),
        r"model\.d_ff: .* model\.d_ff=128, not 256",
        id="model-shape-vs-checkpoint",
    ),
    P("train", finetune_base_missing, r"finetune\.base: .*no_base_run has no config\.yaml", id="finetune-base-missing"),
    P("train", run_dir_of_another_config, r"run\.dir.*run\.overwrite=true", id="run-dir-of-another-config"),
    P("train", run_dir_unrelated_files, r"run\.dir.*not_a_run", id="run-dir-not-a-meshwork-run"),
    P(
        "train",
        lambda c: train_argv(run=c.write("a_file", "x") / "run")(c),
        r"run\.dir: .*a_file/run cannot be created: .*a_file is a file",
        id="run-dir-under-a-file",
    ),
    P(
        "train",
        lambda c: train_argv(f"data.cache_dir={c.write('cache_file', 'x')}")(c),
        r"data\.cache_dir: the corpus cache .*cache_file.* cannot be written",
        id="cache-dir-is-a-file",
    ),
    P(
        "train",
        train_argv("rules.overrides={embed: nosuchaxis}"),
        r"rules\.overrides: embed: 'nosuchaxis' is not a mesh axis",
        id="rules-override-unknown-mesh-axis",
    ),
    P(
        "train",
        lambda c: train_argv("rules.preset=tp", "mesh.data=1", "mesh.tensor=8", run=c.tmp / "tp")(c),
        r"params\.blocks\.attn\.w\w+: dimension 2 of size \d+ cannot be split 8 ways over mesh axis tensor",
        id="heads-not-divisible-by-tensor",
    ),
    P(
        "train",
        lambda c: train_argv("data.seq_len=16384", "log.eval_batches=1", run=c.tmp / "big")(c),
        r"the compiled step needs .* GiB per device, more than",
        id="step-beyond-device-memory",
    ),
    P(
        "train",
        train_argv("train.steps=6", "comm.xla_options={nosuch_flag: 1}"),
        r"comm\.xla_options: No such compile option: 'nosuch_flag'",
        id="xla-option-unknown",
    ),
    P("train", run_dir_all_checkpoints_corrupt, r"checkpoint", id="run-dir-all-checkpoints-corrupt"),
    # --- the planner
    P(
        "plan",
        lambda c: ["--config", str(LM), "--hardware", "h1000", "--devices", "8"],
        r"--hardware.*'h1000'",
        id="plan-unknown-hardware",
    ),
    P(
        "plan",
        lambda c: ["--config", str(LM), "--hardware", "h100", "--devices", "0"],
        r"--devices 0",
        id="plan-zero-devices",
    ),
    P(
        "plan",
        lambda c: ["--config", str(LM), "--hardware", "h100", "--devices", "8", "--nodes", "3"],
        r"--nodes 3",
        id="plan-nodes-not-dividing-devices",
    ),
    P(
        "plan",
        lambda c: ["--config", str(LM), "--hardware", "h100", "--devices", "8", "--efficiency", "1.5"],
        r"--efficiency 1\.5",
        id="plan-efficiency-above-one",
    ),
    P(
        "plan",
        lambda c: ["--config", str(LM), "--hardware", "h100", "--devices", "8", "--out", "x.yaml"],
        r"--out .*--search",
        id="plan-out-without-search",
    ),
    P(
        "plan",
        lambda c: ["--config", str(LM), "--hardware", "h100", "--devices", "eight"],
        r"argument --devices: invalid int value",
        id="plan-devices-not-a-number",
    ),
    P(
        "plan",
        lambda c: ["--config", str(LM), "--hardware", "h100", "--devices", "8", "mesh.data=3"],
        r"mesh: data=3 uses 3 devices but 8 are available",
        id="plan-mesh-not-matching-devices",
    ),
    # --- inference
    P(
        "inference",
        lambda c: ["lm", "--checkpoint", str(c.tmp / "no_run"), "--prompt", "x"],
        r"--checkpoint: .*no_run has no config\.yaml",
        id="lm-checkpoint-missing",
    ),
    P(
        "inference",
        checkpoint_without_checkpoints,
        r"--checkpoint: .*config_only has config.yaml but no checkpoints/",
        id="lm-run-without-checkpoints",
    ),
    P(
        "inference",
        checkpoint_all_corrupt,
        r"--checkpoint: .*checkpoints.*(cannot be read|no complete checkpoint)",
        id="lm-all-checkpoints-corrupt",
    ),
    P(
        "inference",
        lambda c: ["lm", "--hf", str(c.tmp / "no_hf"), "--prompt-ids", "1"],
        r"--hf: .*no_hf is not a directory",
        id="lm-hf-missing",
    ),
    P(
        "inference",
        lm_argv("--prompt", "x", "--top-p", "1.5"),
        r"top_p=1\.5: use a value in \(0, 1\]",
        id="lm-top-p-above-one",
    ),
    P(
        "inference",
        lm_argv("--prompt", "x", "--temperature", "-0.5"),
        r"temperature=-0\.5",
        id="lm-negative-temperature",
    ),
    P("inference", lm_argv("--prompt", "x", "--max-new-tokens", "0"), r"max_new_tokens=0", id="lm-zero-new-tokens"),
    P("inference", lm_argv("--prompt", "x", "--stop-id", "300"), r"stop_tokens=\[300\]", id="lm-stop-id-out-of-vocab"),
    P(
        "inference",
        lm_argv("--prompt-ids", "1,2,256"),
        r"token ids \[256\] are outside the model's vocabulary of 256",
        id="lm-prompt-ids-out-of-vocab",
    ),
    P("inference", lm_argv("--prompt-ids", "1,two,3"), r"--prompt-ids '1,two,3'", id="lm-prompt-ids-not-integers"),
    P(
        "inference",
        lambda c: ["lm", "--checkpoint", str(c.run), "--prompts-file", str(c.tmp / "none.txt")],
        r"--prompts-file: .*none\.txt does not exist",
        id="lm-prompts-file-missing",
    ),
    P(
        "inference",
        lm_argv("--prompt", "x", "--top-p", "high"),
        r"argument --top-p: invalid float value",
        id="lm-top-p-not-a-number",
    ),
    P(
        "inference",
        lambda c: lm_argv("--prompts-file", str(c.write("prompts.bin", bytes(range(128, 256)))))(c),
        r"--prompts-file: .*prompts\.bin is not UTF-8 text",
        id="lm-prompts-file-binary",
    ),
    P(
        "inference",
        lm_argv("--prompt", "x", "--prompt", "y", "--slots", "0"),
        r"--slots: 0; .*at least 1",
        id="lm-zero-slots",
    ),
    P(
        "inference",
        lm_argv("--prompt", "x", "--max-new-tokens", "1000000000"),
        r"max_new_tokens=1000000000: a KV cache of .* GiB, more than",
        id="lm-cache-beyond-memory",
    ),
    P("inference", export_out_not_empty, r"--out: .*export is not empty", id="export-hf-out-not-empty"),
    P("inference", diffusion_on_lm_run, r"--checkpoint: .* trained a transformer", id="diffusion-on-an-lm-run"),
    P(
        "inference",
        hf_unsupported_architecture,
        r"--hf: .*model_type='gpt2' is not supported",
        id="hf-unsupported-architecture",
    ),
    P(
        "inference",
        hf_truncated_safetensors,
        r"--hf: .*model\.safetensors: not a readable safetensors file",
        id="hf-truncated-safetensors",
    ),
    P(
        "inference",
        hf_garbage_safetensors,
        r"--hf: .*model\.safetensors: not a readable safetensors file",
        id="hf-not-a-safetensors-file",
    ),
    P("inference", hf_malformed_config_json, r"--hf: .*config\.json: not valid JSON", id="hf-malformed-config-json"),
    P(
        "inference",
        hf_config_wrong_shape,
        r"--hf: tensor 'model\.embed_tokens\.weight' has shape",
        id="hf-config-vs-weights",
    ),
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
    return subprocess.run(
        [sys.executable, "-m", f"meshwork.{module}", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "module, args, pattern",
    [
        P(
            "train",
            lambda run: ["--config", str(LM), f"run.dir={run}", "train.step=3"],
            r"train\.step: unknown key; did you mean train\.steps",
            id="train-misspelled-key",
        ),
        P(
            "inference",
            lambda run: ["lm", "--checkpoint", str(run), "--prompt", "x", "--top-p", "1.5"],
            r"top_p=1\.5",
            id="inference-top-p",
        ),
    ],
)
def test_subprocess_exit_status_2_without_traceback(module, args, pattern, trained_run, tmp_path):
    before = tree_digest(trained_run)
    proc = _run(module, *args(trained_run), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(pattern, lines[0]), proc.stderr
    assert tree_digest(trained_run) == before
