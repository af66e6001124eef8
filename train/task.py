"""What is being learned: the one place where language modelling and diffusion differ.

The training loop, checkpoints, meshes and metrics are shared; a task says
what a batch looks like, where batches come from, what its objective is (a
function of meshwork.objectives), and how throughput is counted.
`make_task(cfg)` picks one from `model.kind`; a new kind of training (a
post-training objective, say) is a new task with its own `objective`.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshwork.config import Config, ConfigError
from meshwork.data import text as data_lib
from meshwork.data import user_text
from meshwork.objectives import Objective
from meshwork.perf.flops import train_flops_per_token


@dataclass
class LMTask:
    """Next-token prediction on a token file (the stdlib corpus or the user's .bin)."""

    cfg: Config
    train: pathlib.Path
    val: pathlib.Path
    name = "lm"
    on_policy = False  # batches come from data, not from the policy being trained
    unit = "tokens"
    batch_axes = ("act_batch", "act_seq")

    def batch_shapes(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        L = self.cfg.data.seq_len
        return {"inputs": ((L,), np.int32), "targets": ((L,), np.int32)}

    def objective(self, graphdef: Any) -> Objective:
        """Next-token cross-entropy plus the model's auxiliary terms (train.loss_chunk: fused head)."""
        from meshwork.objectives.next_token import next_token_loss

        return next_token_loss(graphdef, self.cfg.train.loss_chunk)

    def train_iterator(self):
        c = self.cfg
        return data_lib.train_iterator(str(self.train), c.data.seq_len, c.train.global_batch, c.run.seed)

    def eval_batches(self) -> list[dict[str, np.ndarray]]:
        c = self.cfg
        return data_lib.eval_batches(str(self.val), c.data.seq_len, c.train.global_batch, c.log.eval_batches)

    def items_per_step(self) -> int:
        return self.cfg.train.global_batch * self.cfg.data.seq_len

    def flops_per_step(self, compiled_step: Any, n_devices: int) -> float:
        del compiled_step, n_devices  # the 6N + attention formula counts useful work only
        return train_flops_per_token(self.cfg.model, self.cfg.data.seq_len) * self.items_per_step()


@dataclass
class PackedLMTask(LMTask):
    """Next-token prediction on the user's own documents (`data.source: text`), packed into windows:
    each batch also carries every token's document, which attention and the loss respect."""

    corpus: user_text.TextCorpus | None = None

    def batch_shapes(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        L = self.cfg.data.seq_len
        return {**super().batch_shapes(), "segment_ids": ((L,), np.int32), "loss_mask": ((L,), np.int32)}

    def train_iterator(self):
        c = self.cfg
        return user_text.train_iterator(self.corpus.train, c.data.seq_len, c.train.global_batch, c.run.seed)

    def eval_batches(self) -> list[dict[str, np.ndarray]]:
        c = self.cfg
        return user_text.eval_batches(self.corpus.val, c.data.seq_len, c.train.global_batch, c.log.eval_batches)


@dataclass
class DPOTask:
    """Direct Preference Optimization on preference pairs (`train.objective: dpo`): each batch holds
    B pairs, chosen and rejected rows (data/preference_pairs.py), and the objective compares the
    policy's log-probabilities of the two replies with the reference's (objectives/preference.py)."""

    cfg: Config
    pairs: Any  # data.preference_pairs.PreferencePairs
    frozen: Any = None  # train.dpo.reference=frozen_copy: train.dpo_reference.FrozenReference, after prepare
    name = "dpo"
    on_policy = False  # batches come from data, not from the policy being trained
    eval_metrics = ("accuracy", "reward_margin")  # held out as val_accuracy, val_reward_margin
    unit = "tokens"
    batch_axes = ("act_batch", "act_seq")

    def batch_shapes(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        L = self.cfg.data.seq_len
        rows = {
            f"{s}_{k}": ((L,), np.int32) for s in ("chosen", "rejected") for k in ("inputs", "targets", "loss_mask")
        }
        if self.cfg.train.dpo.reference != "adapters_off":  # each pair's reference log p, along its row
            rows.update({f"{s}_ref_logp": ((L,), np.float32) for s in ("chosen", "rejected")})
        return rows

    def prepare(self, trainer: Any, say=print) -> None:
        """The reference of train.dpo.reference, before any batch is read (train/dpo_reference.py):
        precomputed, the base's log-probabilities of the pairs from the cache or computed once;
        frozen_copy, the base's weights held to score each batch."""
        from meshwork.train import dpo_reference

        reference = self.cfg.train.dpo.reference
        if reference == "precomputed" and "chosen_ref_logp" not in self.pairs.train.arrays:
            dpo_reference.attach_reference(self.cfg, trainer, self.pairs, say)
        elif reference == "frozen_copy" and self.frozen is None:
            self.frozen = dpo_reference.FrozenReference(trainer)

    def objective(self, graphdef: Any) -> Objective:
        """The DPO loss with train.dpo's beta and label smoothing; metrics loss, reward margin, accuracy."""
        from meshwork.objectives.preference import dpo_objective

        d = self.cfg.train.dpo
        return dpo_objective(graphdef, beta=d.beta, label_smoothing=d.label_smoothing)

    def train_iterator(self):
        from meshwork.data import preference_pairs

        c = self.cfg
        batches = preference_pairs.train_iterator(self.pairs.train, c.train.global_batch, c.run.seed)
        if self.frozen is None:
            return batches
        from meshwork.train.dpo_reference import WithReference

        return WithReference(batches, self.frozen)

    def eval_batches(self) -> list[dict[str, np.ndarray]]:
        from meshwork.data import preference_pairs

        c = self.cfg
        batches = preference_pairs.eval_batches(self.pairs.val, c.train.global_batch, c.log.eval_batches)
        return [self.frozen(b) for b in batches] if self.frozen is not None else batches

    def items_per_step(self) -> int:
        return 2 * self.cfg.train.global_batch * self.cfg.data.seq_len  # chosen and rejected rows

    def flops_per_step(self, compiled_step: Any, n_devices: int) -> float:
        del compiled_step, n_devices  # the policy's forward and backward (6N), the reference's forward (2N)
        reference = 1 if self.cfg.train.dpo.reference == "precomputed" else 4 / 3  # precomputed: once, before
        return train_flops_per_token(self.cfg.model, self.cfg.data.seq_len) * self.items_per_step() * reference


@dataclass
class GRPOTask:
    """Group Relative Policy Optimization (`train.objective: grpo`): batches are completions the
    serving engine samples from the policy itself (train/rollouts.py), scored by the config's
    rewards; the objective is the clipped policy gradient with a KL to the reference
    (objectives/grpo.py). Evaluation scores greedy answers to held-out prompts (val_reward)."""

    cfg: Config
    prompts: Any  # data.prompts.PromptSet
    rewards: Any  # train.rewards.Rewards
    engine_devices: list | None = None  # the serving engine's (train/rollouts.py split_placement)
    name = "grpo"
    unit = "tokens"
    batch_axes = ("act_batch", "act_seq")
    on_policy = True  # the loop asks the source for each batch with the current state

    def batch_shapes(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        L = self.cfg.data.seq_len
        shapes = {k: ((L,), np.int32) for k in ("inputs", "targets", "loss_mask")}
        # A completion's advantage is repeated along its row: every key shares the (batch, seq) layout.
        return {**shapes, **{k: ((L,), np.float32) for k in ("old_logp", "ref_logp", "advantages")}}

    def objective(self, graphdef: Any) -> Objective:
        from meshwork.objectives.grpo import grpo_objective

        g = self.cfg.train.grpo
        return grpo_objective(
            graphdef, clip_eps=g.clip_eps, clip_eps_high=g.clip_eps_high, kl_coef=g.kl_coef, aggregation=g.aggregation
        )

    def train_iterator(self):
        """The rollout source: batches saved under run.dir/rollouts/ (a resume mid-batch reads them)."""
        from meshwork.train.rollouts import Rollouts

        run_dir = pathlib.Path(self.cfg.run.dir)  # as the loop opens it
        return Rollouts(self.cfg, self.prompts, self.rewards, run_dir, self.engine_devices)

    def eval_batches(self) -> list[dict[str, np.ndarray]]:
        return []  # the source's `evaluate` samples and scores held-out prompts instead

    def items_per_step(self) -> int:
        return self.cfg.train.global_batch * self.cfg.data.seq_len

    def flops_per_step(self, compiled_step: Any, n_devices: int) -> float:
        del compiled_step, n_devices  # the update's forward and backward (6N); sampling is not counted
        return train_flops_per_token(self.cfg.model, self.cfg.data.seq_len) * self.items_per_step()


@dataclass
class DiffusionTask:
    """Denoising images (scikit-learn's digits, or a folder of the user's images)."""

    cfg: Config
    train_set: tuple[np.ndarray, np.ndarray]
    val_set: tuple[np.ndarray, np.ndarray]
    name = "diffusion"
    on_policy = False  # batches come from data, not from the policy being trained
    unit = "samples"
    batch_axes = ("act_batch",)

    def batch_shapes(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        u = self.cfg.model.unet
        return {"images": ((u.sample_size, u.sample_size, u.in_channels), np.float32), "labels": ((), np.int32)}

    def objective(self, graphdef: Any) -> Objective:
        """The denoising loss of model.diffusion's schedule and prediction target."""
        from meshwork.objectives.denoising import denoising_loss

        return denoising_loss(graphdef, self.cfg)

    def train_iterator(self):
        from meshwork.data.images import image_train_iterator

        return image_train_iterator(*self.train_set, self.cfg.train.global_batch, self.cfg.run.seed)

    def eval_batches(self) -> list[dict[str, np.ndarray]]:
        from meshwork.data.images import image_eval_batches

        return image_eval_batches(*self.val_set, self.cfg.train.global_batch, self.cfg.log.eval_batches)

    def items_per_step(self) -> int:
        return self.cfg.train.global_batch

    def flops_per_step(self, compiled_step: Any, n_devices: int) -> float:
        # No closed form for a UNet's convolutions: take XLA's count of the
        # compiled step (it has no scan, so nothing is counted once for many).
        cost = compiled_step.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        return float((cost or {}).get("flops", 0.0)) * n_devices  # per device, times the run's devices


def make_task(cfg: Config) -> LMTask | PackedLMTask | DPOTask | GRPOTask | DiffusionTask:
    """The task of `cfg`, with its data located and checked (raises ConfigError)."""
    if cfg.model.kind == "unet":
        return _diffusion_task(cfg)
    if cfg.train.objective == "dpo":
        return _dpo_task(cfg)
    if cfg.train.objective == "grpo":
        return _grpo_task(cfg)
    return _lm_task(cfg)


def _grpo_task(cfg: Config) -> GRPOTask:
    """train.objective grpo: the prompts of data.text_files and the rewards, loaded and checked."""
    from meshwork.data.prompts import prompt_set
    from meshwork.train.rewards import Rewards

    d, g = cfg.data, cfg.train.grpo
    rewards = Rewards(g.rewards, g.reward_weights)
    prompts = prompt_set(d.text_files, tokenizer=d.tokenizer, val_fraction=d.val_fraction, fields=rewards.fields)
    if prompts.max_id >= cfg.model.vocab_size:
        raise ConfigError(
            f"data.tokenizer: token id {prompts.max_id} of the prompts ({prompts.tokenizer.name}) is out of range "
            f"for model.vocab_size={cfg.model.vocab_size}; set model.vocab_size to the tokenizer's vocabulary"
        )
    if not prompts.train or not prompts.val:
        raise ConfigError(
            f"data.val_fraction: {d.val_fraction} of the prompts leaves {len(prompts.train)} for training and "
            f"{len(prompts.val)} held out; both need prompts: add prompts or change data.val_fraction"
        )
    longest = max(len(p.ids) for p in prompts.train + prompts.val)
    if longest + g.max_new_tokens > d.seq_len + 1:
        raise ConfigError(
            f"data.seq_len: the longest prompt ({longest} tokens) and train.grpo.max_new_tokens={g.max_new_tokens} "
            f"need {longest + g.max_new_tokens - 1} positions, more than data.seq_len={d.seq_len}; raise "
            "data.seq_len or lower max_new_tokens"
        )
    if not prompts.stop_ids:
        raise ConfigError(
            "data.tokenizer: neither the chat template nor the tokenizer names a token that ends a reply, so "
            "completions never stop; use a tokenizer with an eos_token"
        )
    rewards.check(prompts.train[0].text, prompts.train[0].fields)
    return GRPOTask(cfg, prompts, rewards)


def _dpo_task(cfg: Config) -> DPOTask:
    """train.objective dpo: the preference pairs of data.text_files, tokenized and checked."""
    from meshwork.data.preference_pairs import preference_pairs

    d = cfg.data
    pairs = preference_pairs(d.text_files, seq_len=d.seq_len, tokenizer=d.tokenizer, val_fraction=d.val_fraction)
    if pairs.max_id >= cfg.model.vocab_size:
        raise ConfigError(
            f"data.tokenizer: token id {pairs.max_id} of the pairs ({pairs.tokenizer}) is out of range for "
            f"model.vocab_size={cfg.model.vocab_size}; set model.vocab_size to the tokenizer's vocabulary"
        )
    if len(pairs.train) < cfg.train.global_batch:
        raise ConfigError(
            f"data.text_files: {len(pairs.train)} training pairs, fewer than train.global_batch="
            f"{cfg.train.global_batch}; add pairs or lower train.global_batch or data.val_fraction"
        )
    need = cfg.train.global_batch * cfg.log.eval_batches
    if len(pairs.val) < need:
        raise ConfigError(
            f"data.val_fraction: {d.val_fraction} of the pairs is {len(pairs.val)} pairs, but evaluation takes "
            f"train.global_batch x log.eval_batches = {need}; raise data.val_fraction, add pairs, "
            "or lower log.eval_batches"
        )
    return DPOTask(cfg, pairs)


def _lm_task(cfg: Config) -> LMTask:
    if cfg.data.source in ("stdlib", "stdlib_docs"):
        if cfg.model.vocab_size < data_lib.ByteTokenizer.vocab_size:
            raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is below the byte tokenizer's 256; set 256")
        corpus = data_lib.stdlib_corpus if cfg.data.source == "stdlib" else data_lib.stdlib_docs_corpus
        train, val = corpus(cfg.data.val_fraction, cfg.data.cache_dir)
        _check_eval_windows(cfg, val, "log.eval_batches")
        return LMTask(cfg, train, val)
    if cfg.data.source in ("text", "chat"):
        return _text_task(cfg)
    if cfg.data.source != "tokens":
        raise ConfigError(
            f"data.source: {cfg.data.source} is image data; a language model reads stdlib, stdlib_docs, "
            "tokens, text or chat"
        )
    files = {}
    for key in ("train_path", "val_path"):
        path = pathlib.Path(getattr(cfg.data, key)).expanduser()
        if not path.is_file():
            raise ConfigError(f"data.{key}: file not found: {path}; point it to a uint16 token file (.bin)")
        if path.stat().st_size % np.dtype(data_lib.TOKEN_DTYPE).itemsize:
            raise ConfigError(
                f"data.{key}: {path} has an odd number of bytes, so it is not a uint16 token file; "
                "write the token ids with np.asarray(ids, np.uint16).tofile(path)"
            )
        if path.stat().st_size < 2 * (cfg.data.seq_len + 1):
            raise ConfigError(
                f"data.{key}: {path} holds fewer than {cfg.data.seq_len + 1} tokens; "
                f"use a larger file or a smaller data.seq_len"
            )
        top = data_lib.max_token_id(path)  # the whole file: a bad id at its end would crash mid-run
        if top >= cfg.model.vocab_size:
            raise ConfigError(
                f"data.{key}: token id {top} in {path} is out of range for "
                f"model.vocab_size={cfg.model.vocab_size}; raise model.vocab_size"
            )
        files[key] = path
    _check_eval_windows(cfg, files["val_path"], "data.val_path")
    return LMTask(cfg, files["train_path"], files["val_path"])


def _text_task(cfg: Config) -> PackedLMTask:
    """data.source text or chat: the corpus tokenized (or read from its cache) and checked."""
    d, L = cfg.data, cfg.data.seq_len
    if d.source == "chat":  # conversations: only the assistant's tokens are targets
        from meshwork.data.chat import chat_corpus

        corpus = chat_corpus(
            d.text_files,
            tokenizer=d.tokenizer,
            messages_field=d.messages_field,
            val_fraction=d.val_fraction,
            cache_dir=d.cache_dir,
        )
    else:
        corpus = user_text.text_corpus(
            d.text_files,
            tokenizer=d.tokenizer,
            text_field=d.text_field,
            val_fraction=d.val_fraction,
            cache_dir=d.cache_dir,
        )
    if corpus.max_id >= cfg.model.vocab_size:
        raise ConfigError(
            f"data.tokenizer: token id {corpus.max_id} of the text ({corpus.tokenizer}) is out of "
            f"range for model.vocab_size={cfg.model.vocab_size}; set model.vocab_size to the "
            f"tokenizer's {corpus.vocab_size} (or more)"
        )
    if len(user_text.PackedWindows(corpus.train, L)) == 0:
        raise ConfigError(
            f"data.text_files: the training split holds {corpus.train.n_tokens} tokens, not one "
            f"window of data.seq_len+1={L + 1}; add text, or lower data.seq_len or data.val_fraction"
        )
    have, need = len(user_text.PackedWindows(corpus.val, L)), cfg.train.global_batch * cfg.log.eval_batches
    if have < need:
        raise ConfigError(
            f"data.val_fraction: {d.val_fraction} of the text is {corpus.val.n_documents} document(s), "
            f"{have} windows of data.seq_len+1={L + 1} tokens, but evaluation takes "
            f"train.global_batch x log.eval_batches = {need}; raise data.val_fraction, add text, "
            "or lower log.eval_batches or data.seq_len"
        )
    return PackedLMTask(cfg, pathlib.Path(corpus.train.tokens), pathlib.Path(corpus.val.tokens), corpus)


def _check_eval_windows(cfg: Config, val: pathlib.Path, key: str) -> None:
    """Evaluation reads train.global_batch x log.eval_batches distinct windows of the validation
    file; checked here, since `eval_batches` runs only once the run dir has been opened."""
    have = len(data_lib.TokenWindows(str(val), cfg.data.seq_len))
    need = cfg.train.global_batch * cfg.log.eval_batches
    if have < need:
        raise ConfigError(
            f"{key}: {val} holds {have} windows of data.seq_len+1={cfg.data.seq_len + 1} tokens, but "
            f"evaluation takes train.global_batch x log.eval_batches = {need}; use more validation "
            "data, or lower log.eval_batches or data.seq_len"
        )


def _diffusion_task(cfg: Config) -> DiffusionTask:
    from meshwork.data import images as images_lib

    u = cfg.model.unet
    if cfg.data.source == "digits":
        if u.in_channels != 1:
            raise ConfigError(f"model.unet.in_channels: digits are grayscale; set 1, not {u.in_channels}")
        images, labels = images_lib.digits(u.sample_size)
    elif cfg.data.source == "images":
        if not cfg.data.image_dir or not pathlib.Path(cfg.data.image_dir).expanduser().is_dir():
            raise ConfigError(f"data.image_dir: {cfg.data.image_dir!r} is not a folder; point it to your images")
        try:
            images, labels = images_lib.image_folder(cfg.data.image_dir, u.sample_size, u.in_channels)
        except FileNotFoundError as e:
            raise ConfigError(f"data.image_dir: {e}; add PNG or JPEG files") from None
        except ValueError as e:  # a file that is not an image (images_lib names it)
            raise ConfigError(f"data.image_dir: {e}") from None
    else:
        raise ConfigError(f"data.source: {cfg.data.source} is text; a UNet reads digits or images")
    if u.num_class_embeds is not None and labels.max() >= u.num_class_embeds:
        raise ConfigError(
            f"model.unet.num_class_embeds: {u.num_class_embeds} classes, but the data has label "
            f"{labels.max()}; raise it"
        )
    train_set, val_set = images_lib.split(images, labels, cfg.data.val_fraction)
    if not len(train_set[0]) or not len(val_set[0]):
        # Evaluation (or training) would index an empty array deep inside the run.
        raise ConfigError(
            f"data.val_fraction: {cfg.data.val_fraction} of {len(images)} images leaves "
            f"{len(train_set[0])} for training and {len(val_set[0])} for validation; both need "
            "images: add images to data.image_dir or change data.val_fraction"
        )
    return DiffusionTask(cfg, train_set, val_set)
