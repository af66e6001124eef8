"""GRPO's batches: completions sampled by meshwork's own paged engine from the policy being trained.

The training loop reads batches from this source as from any data iterator, but through
`next_from(trainer, state)`: a rollout batch is made from the current weights. Making one:

1. **Sync**: the trainer's parameters go into the engine's layout on device
   (src/meshwork/engine/weight_sync.py): colocated (the engine on the trainer's devices) or split (the
   trainer on the first half of the devices, the engine on the second); with LoRA only the
   adapters move. The engine's prefix cache is dropped with the old weights.
2. **Sample**: `updates_per_rollout x global_batch / G` prompts, in a seeded order, each asked G
   times of the continuous-batching Server with prefix caching (so the G completions of a prompt
   share its full KV pages); request (r, u, j) samples with a seed of (run.seed, r, u, j), and the
   engine returns each token's log-probability under the sampling weights (`old_logp`: the
   untempered model's, as the trainer's are; see train.grpo.temperature).
3. **Score**: each completion's text goes to the rewards (train/rewards.py); advantages are
   normalized within each group of G (objectives/grpo.py `group_advantages`). With a KL term the
   reference's per-token log-probabilities are computed once here, on the trainer's mesh: the
   base with the LoRA adapters off, or a frozen copy of the base weights for full fine-tuning.
4. **Rows**: one row of data.seq_len positions per completion (prompt then completion, padded),
   `loss_mask` 1 on the completion's tokens; the batch is written to run.dir/rollouts/ and the
   next updates_per_rollout steps train on its successive slices of global_batch rows.

Off-policy (`train.grpo.off_policy`, one step of asynchrony): at the start of batch r the engine
is synced and batch r, sampled earlier, is trained on, while batch r+1 is sampled by the synced
weights once the first update is dispatched (`after_dispatch`): the host's work and the engine's
calls overlap the device's update, and each batch is `updates_per_rollout` updates stale
(`staleness`). Batch 0 is sampled on-policy.

The source's position (`get_state`: prompts used, batches started and sampled, steps taken from
the batch in hand) is saved in every checkpoint with the data position, and everything it samples depends
only on that position, the seed and the weights; so a run killed anywhere resumes bit-exact: a
checkpoint taken in the middle of a batch, or after the next was sampled ahead, reads that batch
back from run.dir/rollouts/.
Evaluation answers `eval_prompts` held-out prompts greedily and reports their mean reward.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import signal
import time

import jax
import numpy as np
from flax import nnx

from meshwork.config import Config, ConfigError
from meshwork.data.prompts import PromptSet
from meshwork.engine.sampling import SamplingParams
from meshwork.engine.serving import Request, Server
from meshwork.engine.weight_sync import WeightSync
from meshwork.models.lora import trainable
from meshwork.objectives.grpo import group_advantages
from meshwork.objectives.preference import adapters_off
from meshwork.perf.planner_engine import engine_geometry
from meshwork.run.durable import replace_file
from meshwork.sharding.mesh import make_mesh
from meshwork.sharding.rules import rules_for
from meshwork.train.rewards import Rewards
from meshwork.train.scoring import log_probs_fn, score_rows

ROW_KEYS = ("inputs", "targets", "loss_mask", "old_logp", "ref_logp")


def _fault(phase: str, index: int) -> None:
    """Fault injection for tests/reliability/test_grpo_kill.py: `MESHWORK_KILL_GRPO=phase:index` sends
    this process SIGKILL while sampling rollout batch `index` ("rollout"), at the sync before batch
    `index` ("sync": the engine just swapped to the new weights), or while update `index` runs on the
    device ("update": just after it was dispatched)."""
    if os.environ.get("MESHWORK_KILL_GRPO") == f"{phase}:{index}":
        os.kill(os.getpid(), signal.SIGKILL)


def placement_devices(cfg: Config, devices: list | None) -> list | None:
    """The trainer's devices of `split_placement`."""
    return split_placement(cfg, devices)[0]


def split_placement(cfg: Config, devices: list | None) -> tuple[list | None, list | None]:
    """(the trainer's devices, the serving engine's) of `devices` (default: all): for grpo colocated
    the same, for split the first half and the second; for other objectives (devices, None).
    ConfigError, before anything is written, for an odd count under split, an engine_tensor that
    cannot split the engine, or more than one process."""
    if cfg.train.objective != "grpo":
        return devices, None
    if jax.process_count() > 1:
        raise ConfigError(
            f"train.objective: grpo runs its serving engine in one process, and there are {jax.process_count()}; "
            "run it on one host"
        )
    devices = list(devices or jax.devices())
    engine = devices
    if cfg.train.grpo.placement == "split":
        if len(devices) < 2 or len(devices) % 2:
            raise ConfigError(
                f"train.grpo.placement: split puts the trainer and the engine on halves of the devices, and "
                f"there are {len(devices)}; use an even count, or placement colocated"
            )
        devices, engine = devices[: len(devices) // 2], devices[len(devices) // 2 :]
    engine_geometry(cfg, len(engine))  # refuses an engine_tensor that cannot split it, before anything is written
    return devices, engine


def engine_devices(cfg: Config, trainer_devices: list) -> list:
    """The engine's devices when no placement named them: the trainer's (colocated), or as many of
    the others of `jax.devices()` (split)."""
    if cfg.train.grpo.placement == "colocated":
        return trainer_devices
    others = [d for d in jax.devices() if d not in set(trainer_devices)]
    return others[: len(trainer_devices)]


def engine_plan_of(trainer):
    """The serving engine beside `trainer` (perf/planner_engine.py), or None when it samples nothing."""
    if not trainer.task.on_policy:
        return None
    from meshwork.perf.planner_engine import engine_plan

    trainable = sum(x.size for x in jax.tree.leaves(trainer.abstract.params))
    return engine_plan(trainer.cfg, trainer.mesh.size, trainable)


def rows(prompt_ids: list, completions: list, logprobs: list, seq_len: int) -> dict[str, np.ndarray]:
    """One row per completion: inputs/targets of prompt + completion, `loss_mask` 1 where the target
    is a completion token, `old_logp` the engine's log p there; zeros after the end."""
    n = len(completions)
    out = {k: np.zeros((n, seq_len), np.float32 if k.endswith("logp") else np.int32) for k in ROW_KEYS}
    for i, (prompt, tokens, logp) in enumerate(zip(prompt_ids, completions, logprobs)):
        ids = list(prompt) + list(tokens)
        m, p = len(ids) - 1, len(prompt)
        out["inputs"][i, :m], out["targets"][i, :m] = ids[:-1], ids[1:]
        out["loss_mask"][i, p - 1 : m] = 1
        out["old_logp"][i, p - 1 : m] = logp
    return out


class Rollouts:
    """The grpo data source: see the module docstring. `run_dir` None keeps batches in memory only;
    `devices` are the engine's (None: the trainer's, or under split the other devices)."""

    def __init__(
        self,
        cfg: Config,
        prompts: PromptSet,
        rewards: Rewards,
        run_dir: pathlib.Path | None = None,
        devices: list | None = None,
    ):
        self.cfg, self.g, self.prompts, self.rewards = cfg, cfg.train.grpo, prompts, rewards
        self.devices = devices  # the engine's (split_placement), or None: found from the trainer's
        self.folder = None if run_dir is None else pathlib.Path(run_dir) / "rollouts"
        self.rows_per_batch = self.g.updates_per_rollout * cfg.train.global_batch
        # Prompts used, batches started, steps taken from the batch in hand, batches sampled (one
        # more than started when off-policy sampled the next ahead).
        self.position = {"next_index": 0, "rollout": 0, "within": 0, "made": 0}
        self.batch: dict[str, np.ndarray] | None = None  # the batch in hand, made as rollout - 1
        self._ahead: dict[int, tuple] = {}  # off-policy: the next batch and its measures, sampled ahead
        self._pending: int | None = None  # off-policy: the batch to sample once the step is dispatched
        self._order: tuple[int, np.ndarray | None] = (-1, None)  # (epoch, its order of the prompts)
        self.host: dict[str, float] = {}  # what the last batch's making measured, for the step's row
        self.server = self.sync = self.logp_fn = self.ref_params = None

    # -- the data iterator's protocol (train/loop.py) -------------------------------------------

    def get_state(self) -> dict[str, int]:
        return dict(self.position)

    def set_state(self, state: dict[str, int]) -> None:
        self.position, self.batch, self._ahead, self._pending = dict(state), None, {}, None

    def next_from(self, trainer, state) -> dict[str, np.ndarray]:
        """The next step's global batch: a slice of the batch in hand, or of the next one, which is
        sampled now from `state`'s weights, or (off-policy) was sampled before the last batch's updates."""
        self.bind(trainer, state)
        pos, self.host = self.position, {}
        if pos["rollout"] == 0 or pos["within"] == self.g.updates_per_rollout:  # a new batch starts
            r = pos["rollout"]
            synced = self._sync(state)
            _fault("sync", r)
            if pos["made"] > r:  # sampled ahead, by the weights before the last batch's updates
                self.batch, self.host = self._ahead.pop(r, None) or self._read(r)
                staleness = self.g.updates_per_rollout
            else:
                self.batch, self.host = self._sample_batch(trainer, state.buffers, r)
                pos["made"], staleness = r + 1, 0
            if self.g.off_policy:
                self._pending = r + 1  # sampled by these weights while this batch's first update runs
            self.host.update(staleness=staleness, sync_bytes=synced.engine_bytes, sync_seconds=synced.seconds)
            pos.update(rollout=r + 1, within=0)
        elif self.batch is None:  # resumed in the middle of a batch: the one saved when it was made
            self.batch, _ = self._read(pos["rollout"] - 1)
        B, k = self.cfg.train.global_batch, pos["within"]
        pos["within"] += 1
        return {key: v[k * B : (k + 1) * B] for key, v in self.batch.items()}

    def after_dispatch(self, trainer, state) -> None:
        """Off-policy: samples the next batch with the weights synced before the step just dispatched,
        while the device runs it (the host's sampling and scoring and the engine's calls overlap it;
        with placement split the engine's devices are others; a KL reference pass waits for it)."""
        _fault("update", (self.position["rollout"] - 1) * self.g.updates_per_rollout + self.position["within"])
        if self._pending is None:
            return
        r, self._pending = self._pending, None
        self._ahead[r] = self._sample_batch(trainer, state.buffers, r)
        self.position["made"] = r + 1

    # -- the engine ------------------------------------------------------------------------

    def bind(self, trainer, state) -> None:
        """Builds the engine (once) beside `trainer`, from host copies of `state`'s weights (the
        trainer donates its arrays each step, so the engine must not hold them), and its sync."""
        if self.server is not None:
            return
        g, cfg = self.g, self.cfg
        devices = self.devices or engine_devices(cfg, list(trainer.mesh.devices.flat))
        shape = engine_geometry(cfg, len(devices))
        mesh = make_mesh({"data": shape.replicas, "tensor": g.engine_tensor}, devices)
        model = nnx.merge(trainer.graphdef, jax.device_get(state.params), jax.device_get(state.buffers))
        self.server = Server(
            model,
            slots=shape.slots,
            page_size=g.page_size,
            max_len=shape.max_len,
            n_pages=shape.pages,
            mesh=mesh,
            rules=rules_for("tp"),
            prefix_caching=True,
        )
        # What the trainer trains is what moves: every weight, or a method's own (LoRA's adapters).
        self.sync = WeightSync(self.server, trainer.shardings.params, kind=trainable(cfg.finetune))
        self.logp_fn = log_probs_fn(trainer, per_sequence=False)
        if g.kl_coef:
            self.ref_params = self._reference(trainer, state)

    def _reference(self, trainer, state):
        """The reference's parameters: the LoRA factors zeroed (the base exactly), or for full
        fine-tuning a frozen copy of the base's weights in the trainer's layout."""
        if self.cfg.finetune.method in ("lora", "qlora"):
            return adapters_off(state.params)
        from meshwork.train.finetune import load_base_params

        return load_base_params(self.cfg, trainer.mesh, trainer.rules_by_role)

    def token_log_probs(self, trainer, params, buffers, batch: dict[str, np.ndarray]) -> np.ndarray:
        """log p of each target of `batch`'s rows under `params`, on the trainer's mesh."""
        return score_rows(trainer, self.logp_fn, params, buffers, {k: batch[k] for k in ("inputs", "targets")})

    # -- making a batch ----------------------------------------------------------------------

    def _prompts(self, start: int, n: int) -> list:
        """Prompts start..start+n-1 of the stream: epoch e visits the training prompts in a seeded order."""
        train, out = self.prompts.train, []
        for k in range(start, start + n):
            epoch, i = divmod(k, len(train))
            if self._order[0] != epoch:
                self._order = (epoch, np.random.default_rng([self.cfg.run.seed, epoch]).permutation(len(train)))
            out.append(train[self._order[1][i]])
        return out

    def sample(self, prompts: list, r: int) -> list[list[tuple]]:
        """Per prompt, G completions, each (tokens, log-probabilities), from the engine; request
        (r, u, j) samples with a seed of (run.seed, r, u, j)."""
        G = self.g.group_size
        for u, p in enumerate(prompts):
            for j in range(G):
                seed = int(np.random.SeedSequence([self.cfg.run.seed, r, u, j]).generate_state(1)[0])
                params = SamplingParams(
                    temperature=self.g.temperature,
                    max_new_tokens=self.g.max_new_tokens,
                    stop_tokens=self.prompts.stop_ids,
                    seed=seed,
                )
                self.server.submit(Request((r, u, j), list(p.ids), params))
        while self.server.busy:
            self.server.step()
            _fault("rollout", r)  # a test's kill lands with completions half sampled
        return [[_taken(self.server, (r, u, j)) for j in range(G)] for u in range(len(prompts))]

    def _sync(self, state):
        jax.block_until_ready(state.params)  # the update in flight is not the sync's time
        return self.sync(state.params)

    def _sample_batch(self, trainer, buffers, r: int) -> tuple[dict[str, np.ndarray], dict]:
        """Rollout batch `r` from the engine's current weights, scored and saved; and what making it measured."""
        start, G = time.perf_counter(), self.g.group_size
        n_prompts = self.rows_per_batch // G
        prompts = self._prompts(self.position["next_index"], n_prompts)
        self.position["next_index"] += n_prompts
        before = self.server.prefill_tokens, self.server.cached_tokens
        groups = self.sample(prompts, r)
        flat = [(p, c) for p, group in zip(prompts, groups) for c in group]
        texts = [self.prompts.decode(c[0]) for _, c in flat]
        scores = np.asarray([self.rewards(p.text, t, p.fields) for (p, _), t in zip(flat, texts)], np.float32)
        batch = rows([p.ids for p, _ in flat], [c[0] for _, c in flat], [c[1] for _, c in flat], self.cfg.data.seq_len)
        advantages = np.asarray(group_advantages(scores.reshape(n_prompts, G), scale=self.g.scale_rewards))
        batch["advantages"] = np.repeat(advantages.reshape(-1, 1), self.cfg.data.seq_len, axis=1)  # along each row
        if self.ref_params is not None:
            batch["ref_logp"] = self.token_log_probs(trainer, self.ref_params, buffers, batch)
        prefilled, cached = (
            now - was for now, was in zip((self.server.prefill_tokens, self.server.cached_tokens), before)
        )
        host = {
            "reward": float(scores.mean()),
            "reward_std": float(scores.std()),
            "completion_tokens": float(np.mean([len(c[0]) for _, c in flat])),
            "prompt_tokens_shared": cached / max(prefilled + cached, 1),
            "rollout_seconds": time.perf_counter() - start,
        }
        self._write(r, batch, host)
        return batch, host

    def _write(self, r: int, batch: dict[str, np.ndarray], host: dict) -> None:
        """Saves batch `r` and what making it measured (atomically and durably), and drops the batches
        no checkpoint kept can resume into: a checkpoint at step s needs batch (s - 1) // U, in
        whose middle it may be, and the one after it (off-policy's, sampled ahead)."""
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        data = io.BytesIO()
        np.savez(data, **batch, host=np.asarray(json.dumps(host)))
        replace_file(self.folder / f"{r:08d}.npz", data.getvalue())
        kept = [int(p.name) for p in (self.folder.parent / "checkpoints").glob("*") if p.name.isdigit()]
        if kept:
            oldest_needed = (min(kept) - 1) // self.g.updates_per_rollout
            for old in self.folder.glob("*.npz"):
                if old.stem.isdigit() and int(old.stem) < min(oldest_needed, r):
                    old.unlink(missing_ok=True)

    def _read(self, r: int) -> tuple[dict[str, np.ndarray], dict]:
        path = None if self.folder is None else self.folder / f"{r:08d}.npz"
        if path is None or not path.is_file():
            raise ConfigError(
                f"run.dir: the checkpoint resumes in the middle of rollout batch {r}, and {path} is missing; "
                "restore it, or remove the run's checkpoints newer than that batch's first step"
            )
        with np.load(path) as f:
            return {k: f[k] for k in f.files if k != "host"}, json.loads(str(f["host"]))

    # -- evaluation --------------------------------------------------------------------------

    def evaluate(self, trainer, state) -> dict[str, float]:
        """The mean reward of greedy completions of the first eval_prompts held-out prompts."""
        self.bind(trainer, state)
        self.sync(state.params)
        held_out = self.prompts.val[: self.g.eval_prompts]
        return {"val_reward": greedy_reward(self.server, held_out, self.prompts, self.rewards, self.g.max_new_tokens)}


def _taken(server: Server, rid) -> tuple[list[int], list[float]]:
    """(tokens, log-probabilities) of finished request `rid`, taken from `server`."""
    result = server.take_result(rid)
    if result.finish == "error":
        raise ConfigError(f"train.grpo: the engine refused a rollout ({result.error})")
    return result.tokens, result.logprobs


def greedy_reward(server: Server, prompts: list, prompt_set: PromptSet, rewards: Rewards, max_new_tokens: int) -> float:
    """The mean reward of `server`'s greedy completions of `prompts` (of `prompt_set`): GRPO's
    evaluation (val_reward), and benchmarks/arith_accuracy.py's for any run."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_tokens=prompt_set.stop_ids)
    for i, p in enumerate(prompts):
        server.submit(Request(("eval", i), list(p.ids), greedy))
    while server.busy:
        server.step()
    answers = [prompt_set.decode(_taken(server, ("eval", i))[0]) for i in range(len(prompts))]
    return float(np.mean([rewards(p.text, a, p.fields) for p, a in zip(prompts, answers)]))
