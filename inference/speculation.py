"""`--speculative DRAFT_DIR|mtp --speculative-k K` on `inference lm` and `inference serve`: the drafter
that proposes tokens for the model to verify (src/meshwork/engine/speculative.py).

    drafter = make_drafter(args, model)   # None without --speculative
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

from meshwork.config import ConfigError


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative",
        default=None,
        metavar="DRAFT_DIR|mtp",
        help="speculative decoding: a small draft model with the model's tokenizer (a meshwork run dir or a "
        "Hugging Face folder), or `mtp` (the model's own multi-token-prediction modules), proposes "
        "--speculative-k tokens that the model verifies in one forward; what is sampled keeps the model's "
        "distribution (greedy: the same tokens)",
    )
    p.add_argument(
        "--speculative-k", type=int, default=4, help="tokens the draft proposes per verification (with --speculative)"
    )


def load_draft_model(spec: str, attention: str | None) -> Any:
    """The draft model in a run dir (checkpoints/ or config.yaml) or a Hugging Face folder (config.json)."""
    from meshwork.inference.lm import load_lm

    path = pathlib.Path(spec).expanduser()
    if (path / "checkpoints").is_dir() or (path / "config.yaml").is_file():
        return load_lm(str(path), None, attention)[0]
    if (path / "config.json").is_file():
        return load_lm(None, str(path), attention)[0]
    raise ConfigError(
        f"--speculative {spec}: not a meshwork run dir (config.yaml) nor a Hugging Face folder (config.json); "
        "pass a draft model's folder, or mtp for the model's own MTP modules"
    )


def make_drafter(args: argparse.Namespace, model: Any, mesh=None, rules=None):
    """The Drafter that --speculative names for `model` (None without it); ConfigError (one line) when
    it cannot draft for it."""
    if args.speculative is None:
        return None
    if args.speculative_k < 1:
        raise ConfigError(f"--speculative-k {args.speculative_k}: propose at least 1 token per verification")
    from meshwork.engine.generate import Generator
    from meshwork.engine.speculative import DraftModelDrafter, mtp_drafter

    if args.speculative == "mtp":
        if model.cfg.mtp.depth == 0:
            raise ConfigError(
                "--speculative mtp: this model has no multi-token-prediction modules (model.mtp.depth is 0); "
                "pass a draft model's folder instead: --speculative DRAFT_DIR"
            )
        return mtp_drafter(Generator(model, mesh=mesh, rules=rules))
    draft = load_draft_model(args.speculative, getattr(args, "attention", None))
    if draft.cfg.vocab_size != model.cfg.vocab_size:
        raise ConfigError(
            f"--speculative {args.speculative}: the draft's vocabulary has {draft.cfg.vocab_size} ids but the "
            f"model's {model.cfg.vocab_size}; use a draft trained with the model's tokenizer"
        )
    return DraftModelDrafter(Generator(draft, mesh=mesh, rules=rules))
