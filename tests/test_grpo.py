"""GRPO (`train.objective: grpo`): prompts and rewards, rollouts sampled by the serving engine from
the policy being trained, the trainer and the engine agreeing on every token's log-probability under
each placement (colocated, split, LoRA) so a fresh rollout's first ratio is 1, the G completions of
a prompt sharing its KV pages, and a run stopped in the middle of a rollout batch resuming
bit-exactly. The loss math itself is tests/test_preference_objectives.py's."""

from __future__ import annotations

import importlib.util
import json

import jax
import numpy as np
import pytest
from conftest import ROOT, tiny_overrides
from flax import nnx

from meshwork.config import ConfigError, load_config
from meshwork.data.prompts import prompt_set
from meshwork.engine.page_pool import PageAllocator
from meshwork.models.adapters import AdapterParam
from meshwork.models.lora import LoRAParam
from meshwork.run.metrics import read_metrics
from meshwork.train.cli import main
from meshwork.train.plot import plot_run
from meshwork.train.rewards import Rewards, exact_answer, exact_match, number_only
from meshwork.train.rollouts import engine_plan_of, placement_devices, split_placement
from meshwork.train.trainer import build_trainer, check_runtime

CONFIG = ROOT / "configs/grpo_arith.yaml"


def _prompts(path, n=24):
    rows = [{"prompt": f"Q: {a} plus {b}? A:", "answer": str(a + b)} for a in range(6) for b in range(4)][:n]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _overrides(run_dir, prompts, *extra, tiny_model=True):
    """The tiny test model (or, `tiny_model=False`, the config's own: a base run's), on `prompts`."""
    return [
        *(o for o in tiny_overrides(run_dir) if tiny_model or not o.startswith("model.")),
        "finetune.method=none",
        "finetune.base=null",
        f"data.text_files=[{prompts}]",
        "data.val_fraction=0.25",
        "train.global_batch=8",
        "train.grpo.group_size=4",
        "train.grpo.max_new_tokens=6",
        "train.grpo.engine_slots=8",
        "train.grpo.page_size=4",
        "train.grpo.eval_prompts=4",
        *extra,
    ]


# ---------------------------------------------------------------- rewards and prompts


def test_built_in_rewards_and_ones_of_your_own(tmp_path, monkeypatch):
    assert (
        exact_match("", " 12 ", {"answer": "12"}) == 1.0 and exact_match("", "The answer is 12.", {"answer": "12"}) == 0
    )
    assert exact_answer("", " 12\n", {"answer": "12"}) == 1.0
    assert exact_answer("", "it is 3, no, 12.0", {"answer": 12}) == 1.0  # the last number counts
    assert exact_answer("", "121", {"answer": "12"}) == 0.0 and exact_answer("", "none", {"answer": "1"}) == 0.0
    assert number_only("", " -7 ", {}) == 1.0 and number_only("", "7 apples", {}) == 0.0
    (tmp_path / "my_rewards.py").write_text("def short(prompt, completion, fields):\n    return -len(completion)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = Rewards(["exact_answer", "my_rewards:short"], [2.0, 0.5])
    assert rewards.fields == ("answer",)
    assert rewards("q", "12", {"answer": "12"}) == 2.0 - 1.0
    with pytest.raises(ConfigError, match=r"^train.grpo.rewards: cannot import 'no_such_module' \(ModuleNotFoundError"):
        Rewards(["no_such_module:f"])
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        Rewards(["my_rewards:nope"])
    with pytest.raises(ConfigError, match="neither a built-in reward"):
        Rewards(["exactanswer"])
    (tmp_path / "broken_rewards.py").write_text("def f(prompt, completion, fields):\n    return fields['x']\n")
    with pytest.raises(ConfigError, match=r"broken_rewards:f failed on the first example \(KeyError"):
        Rewards(["broken_rewards:f"]).check("p", {})


def test_prompts_render_with_the_template_and_keep_their_fields(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "1 + 2?"}], "answer": "3", "id": 7})
        + "\n\n"
        + json.dumps({"prompt": "2+2=", "answer": "4"})
        + "\n"
    )
    ps = prompt_set([str(path)], val_fraction=0.01, fields=("answer",))
    assert [p.text for p in ps.train] == ["user: 1 + 2?\nassistant:", "2+2="]
    assert ps.train[0].ids == tuple(b"user: 1 + 2?\nassistant:") and ps.train[0].fields == {"answer": "3", "id": 7}
    assert ps.stop_ids == (10,)  # the fallback template ends a turn with a newline
    assert ps.decode(list(b" 3\n")) == " 3"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}], "answr": "3"}) + "\n")
    with pytest.raises(ConfigError, match=r"p.jsonl:1: no field 'answer', which the reward reads"):
        prompt_set([str(path)], fields=("answer",))
    ended = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    path.write_text(json.dumps({"messages": ended}) + "\n")
    with pytest.raises(ConfigError, match="the messages end with the assistant's turn"):
        prompt_set([str(path)])


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "train.grpo.group_size=3",
            "train.grpo.group_size: 3 completions per prompt do not divide train.global_batch=8",
        ),
        ("train.grpo.rewards=[nowhere:f]", "train.grpo.rewards: cannot import 'nowhere'"),
        ("train.grpo.kl_coef=0.1", "train.grpo.kl_coef: 0.1: the KL's reference is the fine-tuning base"),
        ("train.grpo.max_new_tokens=40", "data.seq_len: the longest prompt"),
        ("train.grpo.group_size=1", "train.grpo.group_size"),
        ("train.grpo.engine_tensor=3", "train.grpo.engine_tensor: 3 must divide the engine's 8 devices"),
        # A KV pool of 4M slots: ~9 GB per device beside the step, refused once the step is compiled.
        ("train.grpo.engine_slots=4000000", "and the serving engine beside it"),
    ],
)
def test_a_bad_grpo_config_is_one_line_and_writes_nothing(tmp_path, capsys, override, message):
    run = tmp_path / "run"
    assert main(["--config", str(CONFIG), *_overrides(run, _prompts(tmp_path / "p.jsonl")), override]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert message in line and not run.exists(), line


def test_split_placement_halves_the_devices_it_is_given(tmp_path):
    cfg = load_config(
        CONFIG, _overrides(tmp_path / "run", _prompts(tmp_path / "p.jsonl"), "train.grpo.placement=split")
    )
    devices = jax.devices()
    assert split_placement(cfg, devices[4:8]) == (devices[4:6], devices[6:8])
    colocated = load_config(CONFIG, _overrides(tmp_path / "run", _prompts(tmp_path / "p.jsonl")))
    assert split_placement(colocated, devices[:4]) == (devices[:4], devices[:4])


def test_dropping_the_prefix_cache_frees_its_pages_in_their_first_order():
    pages = PageAllocator(8)
    a = pages.allocate("a", 3)
    pages.register(a[0], b"d0")
    pages.register(a[1], b"d1")
    pages.release("a", a)
    assert pages.lookup([b"d0", b"d1"]) == a[:2] and pages.lru == a[:2]
    held = pages.allocate("b", 1)
    pages.register(held[0], b"held")
    assert pages.forget_cached() == 3
    assert pages.lookup([b"d0"]) == [] and pages.lookup([b"held"]) == [] and pages.lru == []
    assert pages.free == [p for p in range(1, 8) if p not in held]  # as a fresh pool hands them out
    pages.release("b", held)  # no longer cached: freed
    assert sorted(pages.free) == list(range(1, 8)) and pages.lru == []


# ---------------------------------------------------------------- the trainer and the engine


def _trainer(cfg):
    devices = placement_devices(cfg, jax.devices())
    task = check_runtime(cfg, devices)
    trainer = build_trainer(cfg, task, devices).compile()
    return task, trainer, trainer.init_state()


PLACEMENTS = {
    # the trainer's layout -> the engine's (data replicas x tensor)
    "colocated": ["mesh.data=1", "mesh.fsdp=8", "rules.preset=fsdp", "train.grpo.engine_tensor=2"],
    "split": [
        "mesh.data=1",
        "mesh.fsdp=4",
        "rules.preset=fsdp",
        "train.grpo.placement=split",
        "train.grpo.engine_tensor=2",
    ],
}


@pytest.mark.parametrize(
    "placement", [p if p == "colocated" else pytest.param(p, marks=pytest.mark.slow) for p in sorted(PLACEMENTS)]
)
def test_the_engine_samples_what_the_trainer_scores(tmp_path, placement):
    """The engine's log-probability of every sampled token equals the trainer's forward pass over
    the same rows within 1e-5 (float32), so the first step's importance ratio is 1; the G
    completions of a prompt share its full pages; after the update a sync moves the new weights."""
    cfg = load_config(CONFIG, _overrides(tmp_path / "run", _prompts(tmp_path / "p.jsonl"), *PLACEMENTS[placement]))
    task, trainer, state = _trainer(cfg)
    source = task.train_iterator()
    batch = source.next_from(trainer, state)
    assert source.sync.placement == placement
    engine = source.server.gen.mesh
    assert (engine.shape["data"], engine.shape["tensor"]) == (4 if placement == "colocated" else 2, 2)
    assert set(engine.devices.flat).isdisjoint(trainer.mesh.devices.flat) == (placement == "split")
    mask = batch["loss_mask"] > 0
    ours = source.token_log_probs(trainer, state.params, state.buffers, batch)
    diff = np.abs(ours - batch["old_logp"])[mask]
    assert mask.sum() >= 8 * 1 and diff.max() <= 1e-5, diff.max()
    # Prompts of 16 bytes in pages of 4: the later completions of a group reuse its first 3 pages.
    assert source.host["prompt_tokens_shared"] > 0.4, source.host
    # The planner's engine (perf/planner_engine.py) is the one built: its pages, KV bytes, sync bytes.
    plan, server = engine_plan_of(trainer), source.server
    assert (plan.pages, plan.slots) == (server.pages.n_pages, len(server.slots))
    assert plan.kv_bytes_per_device == 2 * server.k.addressable_shards[0].data.nbytes
    assert 0 <= source.host["sync_bytes"] - plan.sync_bytes < 0.02 * plan.sync_bytes  # replicated norms aside
    state, metrics = trainer.step_fn(state, trainer.to_device(batch))
    assert abs(float(metrics["ratio"]) - 1.0) <= 1e-5, float(metrics["ratio"])
    # The next rollout batch syncs the updated weights: the engine scores like the trainer again.
    source.position["within"] = cfg.train.grpo.updates_per_rollout
    batch = source.next_from(trainer, state)
    ours = source.token_log_probs(trainer, state.params, state.buffers, batch)
    assert np.abs(ours - batch["old_logp"])[batch["loss_mask"] > 0].max() <= 1e-5
    print(f"{placement}: max |engine - trainer| log p {diff.max():.2e}, sync {source.host['sync_bytes']:,} B")


PEFT = {
    # method: (its overrides, the variable type the sync moves, the KL's coefficient)
    "lora": (["finetune.method=lora", "finetune.rank=4"], LoRAParam, 0.05),
    "adapter": (["finetune.method=adapter", "finetune.rank=4"], AdapterParam, 0.0),
    # int4 groups of 32 cannot be split 8 ways by fsdp: data parallel over the 8 devices instead
    "qlora": (
        ["finetune.method=qlora", "finetune.rank=4", "mesh.fsdp=1", "mesh.data=8", "rules.preset=dp"],
        LoRAParam,
        0.05,
    ),
}


# LoRA in the quick tier; adapters and QLoRA repeat its claim with other variables (the slow tier).
@pytest.mark.parametrize(
    "method", [m if m == "lora" else pytest.param(m, marks=pytest.mark.slow) for m in sorted(PEFT)]
)
def test_the_engine_samples_what_the_trainer_scores_under_a_fine_tuning_method(tmp_path, lm_tiny_runs, method):
    """LoRA or adapters on a trained base: only what the method trains moves at a sync, and the
    engine and the trainer still agree on every token; with LoRA the KL's reference is the base
    (adapters off), so the first step's KL is 0."""
    extra, kind, kl = PEFT[method]
    base = lm_tiny_runs["1dev"]["run_dir"]
    overrides = _overrides(tmp_path / "run", _prompts(tmp_path / "p.jsonl"), *PLACEMENTS["colocated"], tiny_model=False)
    cfg = load_config(CONFIG, [*overrides, *extra, f"finetune.base={base}", f"train.grpo.kl_coef={kl}"])
    task, trainer, state = _trainer(cfg)
    source = task.train_iterator()
    batch = source.next_from(trainer, state)

    def engine_bytes(kind):  # summed over the engine's devices, as they hold them
        arrays = jax.tree.leaves(nnx.filter_state(source.server.gen.state, kind))
        return sum(x.addressable_shards[0].data.nbytes * len(x.sharding.device_set) for x in arrays)

    assert source.sync.treedef.num_leaves == len(jax.tree.leaves(state.params))  # the trainer's own variables
    assert source.host["sync_bytes"] == engine_bytes(kind) < engine_bytes(nnx.Param) / 10
    mask = batch["loss_mask"] > 0
    ours = source.token_log_probs(trainer, state.params, state.buffers, batch)
    assert np.abs(ours - batch["old_logp"])[mask].max() <= 1e-5
    _, metrics = trainer.step_fn(state, trainer.to_device(batch))
    assert abs(float(metrics["ratio"]) - 1) <= 1e-5
    if kl:  # B = 0: the policy is the base
        np.testing.assert_allclose(batch["ref_logp"][mask], batch["old_logp"][mask], atol=1e-5)
        assert abs(float(metrics["kl"])) <= 1e-6


# ---------------------------------------------------------------- a run


RESUMES = {
    # On-policy: step 3 is the first of the second batch's two updates, so the checkpoint at 3 is mid-batch.
    "on_policy": ([], 3, 0),
    # Off-policy: after step 1 was dispatched batch 1 was sampled ahead (by step 1's weights, before
    # its update), so the checkpoint at 2 holds a batch that no step has started: resumed, it is read back.
    "off_policy": (["train.grpo.off_policy=true"], 2, 2),
}


@pytest.mark.over_budget("three trainer invocations (straight, stopped, resumed) for the bit-exact resume", seconds=60)
@pytest.mark.parametrize(
    "mode", [m if m == "on_policy" else pytest.param(m, marks=pytest.mark.slow) for m in sorted(RESUMES)]
)
def test_a_run_stopped_between_updates_resumes_bit_exactly(tmp_path, capsys, monkeypatch, mode):
    extra, stop, staleness = RESUMES[mode]
    prompts = _prompts(tmp_path / "p.jsonl")
    # An untrained model's completions never hold the answer: a reward that varies among them.
    (tmp_path / "spread_reward.py").write_text(
        "def distinct(prompt, completion, fields):\n    return len(set(completion))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    steps = ["train.steps=4", "train.grpo.updates_per_rollout=2", f"checkpoint.every={stop}", "log.every=1"]
    steps += ["log.eval_every=4", "optimizer.warmup_steps=0", "optimizer.lr=1e-2", *extra]
    steps += ["train.grpo.rewards=[spread_reward:distinct]"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert main(["--config", str(CONFIG), *_overrides(straight, prompts, *steps)]) == 0, capsys.readouterr().err
    assert main(["--config", str(CONFIG), *_overrides(stopped, prompts, *steps, f"train.stop_after={stop}")]) == 0
    assert sorted(p.name for p in (stopped / "rollouts").iterdir()) == ["00000000.npz", "00000001.npz"]
    assert main(["--config", str(CONFIG), *_overrides(stopped, prompts, *steps)]) == 0
    keys = ("step", "loss", "ratio", "clip_fraction", "grad_norm", "reward", "staleness", "val_reward")
    logged = lambda run: [tuple(r.get(k) for k in keys) for r in read_metrics(run)]  # noqa: E731
    assert logged(stopped) == logged(straight) and len(logged(straight)) == 5
    rows = read_metrics(straight)
    assert [(r["step"], r["staleness"]) for r in rows if "reward" in r] == [(1, 0), (3, staleness)]
    assert rows[1]["ratio"] == pytest.approx(1.0, abs=1e-5) and rows[2]["ratio"] != 1.0  # step 2: the policy moved
    assert (rows[3]["ratio"] == pytest.approx(1.0, abs=1e-5)) == (staleness == 0)  # a stale batch's first ratio
    if mode == "on_policy":  # the reward curve beside the loss curves
        assert plot_run(straight).name == "loss.png" and (straight / "reward.png").stat().st_size > 0
    for a, b in zip(sorted((straight / "rollouts").iterdir()), sorted((stopped / "rollouts").iterdir())):
        with np.load(a) as x, np.load(b) as y:  # `host` holds what sampling measured: seconds differ
            assert all(np.array_equal(x[k], y[k]) for k in x.files if k != "host")


def test_the_shipped_prompts_are_what_the_generator_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_data", ROOT / "tools/make_arithmetic_data.py")
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    make_data.main(["--kind", "prompts", "--out", str(tmp_path / "x.jsonl")])
    assert (tmp_path / "x.jsonl").read_bytes() == (ROOT / "configs/data/arithmetic_prompts.jsonl").read_bytes()
