"""A Hugging Face checkpoint directory on disk: config.json, the safetensors
index, and the tensors of its *.safetensors files read by name (memory-mapped,
numpy, no torch)."""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
from collections.abc import Iterable
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so bf16 checkpoints read as numpy)
import numpy as np
from safetensors import SafetensorError, safe_open


class TensorReader:
    """Named tensors across a checkpoint's safetensors files, opened memory-mapped;
    each read once, with its shape checked (also used by the diffusers import)."""

    def __init__(self, files: Iterable[pathlib.Path], stack: contextlib.ExitStack):
        self.where: dict[str, Any] = {}
        for f in files:
            try:
                handle = stack.enter_context(safe_open(f, framework="numpy"))
            except (SafetensorError, OSError) as e:  # a truncated or corrupt file, or one that is missing
                raise ValueError(f"{f}: not a readable safetensors file ({e}); download or convert it again") from None
            self.where.update(dict.fromkeys(handle.keys(), handle))
        self.used: set[str] = set()

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        """Raises ValueError unless the files hold `name` with `shape` (reads only the header)."""
        if name not in self.where:
            raise ValueError(
                f"checkpoint has no tensor {name!r}, which the config implies; "
                "is config.json the one that belongs to these weights?"
            )
        have = tuple(self.where[name].get_slice(name).get_shape())
        if have != shape:
            raise ValueError(f"tensor {name!r} has shape {have}, but config.json implies {shape}")

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        self.check(name, shape)
        self.used.add(name)
        # No copy needed: with framework="numpy" safetensors (0.4 to 0.8 at least) reads the
        # bytes into a buffer the array owns, not a view of the mapping (tests/test_hf_loading.py).
        return self.where[name].get_tensor(name)

    def unused(self, ignored: re.Pattern | None = None) -> list[str]:
        """Tensors never read (a mapping that dropped weights would otherwise go unnoticed)."""
        return sorted(k for k in self.where if k not in self.used and not (ignored and ignored.fullmatch(k)))


def checkpoint_files(path: pathlib.Path) -> tuple[dict[str, Any], list[pathlib.Path]]:
    if path.is_file():
        path = path.parent
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json; pass a Hugging Face checkpoint directory")
    hf_config = _read_json(path / "config.json")
    if not isinstance(hf_config, dict):
        raise ValueError(f"{path / 'config.json'}: expected a JSON object of model settings")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({path / f for f in _read_json(index)["weight_map"].values()})
        except (KeyError, TypeError, AttributeError):
            raise ValueError(f'{index}: expected {{"weight_map": {{tensor: file}}}}') from None
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files; convert .bin checkpoints to safetensors first")
    return hf_config, files


def _read_json(path: pathlib.Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:  # its message alone does not say which file
        raise ValueError(f"{path}: not valid JSON ({e}); fix or download it again") from None
