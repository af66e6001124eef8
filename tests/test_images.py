"""Image sources for the UNet: the bundled digits and a folder of the user's files."""

import numpy as np
from conftest import ROOT
from PIL import Image

from meshwork.config import load_config
from meshwork.data.images import digits, image_folder, image_train_iterator
from meshwork.evaluation.digit_quality import DigitClassifier
from meshwork.train.task import make_task


def test_digits_are_real_and_scaled():
    images, labels = digits(16)
    assert images.shape == (1797, 16, 16, 1) and images.min() == -1 and images.max() <= 1
    assert sorted(set(labels.tolist())) == list(range(10))


def test_image_folder_classes_from_subfolders(tmp_path):
    rng = np.random.default_rng(0)
    for cls in ("cats", "dogs"):
        (tmp_path / cls).mkdir()
        for i in range(3):
            Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(tmp_path / cls / f"{i}.png")
    images, labels = image_folder(tmp_path, 16, 3)
    assert images.shape == (6, 16, 16, 3) and labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert -1 <= images.min() and images.max() <= 1
    cfg = load_config(
        ROOT / "configs/unet_digits.yaml",
        [
            "data.source=images",
            f"data.image_dir={tmp_path}",
            "model.unet.in_channels=3",
            "model.unet.out_channels=3",
            "data.val_fraction=0.3",
        ],
    )
    task = make_task(cfg)
    batch = next(image_train_iterator(*task.train_set, 2, seed=0))
    assert batch["images"].shape == (2, 16, 16, 3) and batch["labels"].shape == (2,)


def test_digit_classifier_separates_real_from_noise():
    clf = DigitClassifier(16)
    assert clf.real_accuracy() > 0.9
    noise = np.random.default_rng(0).uniform(-1, 1, (200, 16, 16, 1))
    assert clf.accuracy(noise, np.arange(200) % 10) < 0.3


def _fake_samples(model, cfg, *, num, labels="cycle", **kw):
    """Stands in for a trained UNet: image i is one flat gray level that names its class."""
    y = np.arange(num) % 10 if labels == "cycle" else np.full(num, int(labels))
    return np.broadcast_to((y / 9 * 2 - 1)[:, None, None, None], (num, 16, 16, 1)).astype(np.float32), y


def _rows_of_classes(path, rows: int, per_row: int):
    """Asserts the PNG is `rows` x `per_row` tiles of 48 px (2 px apart), row r holding class r's gray."""
    grid = np.asarray(Image.open(path))
    assert grid.shape == (rows * 50 + 2, per_row * 50 + 2)
    for r in range(rows):
        for c in range(per_row):
            tile = grid[2 + 50 * r : 50 * (r + 1), 2 + 50 * c : 50 * (c + 1)]
            assert tile.shape == (48, 48) and (tile == round(255 * r / 9)).all(), (r, c)


def test_the_cli_grid_has_one_row_per_class_and_fills_the_rows(tmp_path, monkeypatch, capsys):
    import types

    import meshwork.evaluation.digit_quality as digit_quality
    import meshwork.inference.generate_images as generate_images
    import meshwork.inference.runs as runs
    from meshwork.inference.cli import main

    cfg = load_config(ROOT / "configs/unet_digits.yaml", [f"run.dir={tmp_path}"])
    monkeypatch.setattr(runs, "load_run", lambda run_dir, ema=True: (cfg, None, 0))
    monkeypatch.setattr(generate_images, "sample_images", _fake_samples)
    monkeypatch.setattr(
        digit_quality,
        "DigitClassifier",  # its fit takes seconds; the grid is the point here
        lambda size: types.SimpleNamespace(accuracy=lambda images, y: 1.0),
    )
    assert main(["diffusion", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "grid.png")]) == 0
    assert "classifier reads" in capsys.readouterr().out
    _rows_of_classes(tmp_path / "grid.png", rows=10, per_row=4)  # the default: 4 of each digit, 16 -> 48 px
    # One class for all: a square-ish grid, not one long row.
    assert (
        main(
            [
                "diffusion",
                "--checkpoint",
                str(tmp_path),
                "--num",
                "9",
                "--labels",
                "3",
                "--out",
                str(tmp_path / "threes.png"),
            ]
        )
        == 0
    )
    assert np.asarray(Image.open(tmp_path / "threes.png")).shape == (3 * 50 + 2, 3 * 50 + 2)


def test_training_samples_have_one_row_per_class(tmp_path, monkeypatch):
    import contextlib
    import types

    from flax import nnx

    import meshwork.diffusion.images as images_module
    from meshwork.train.state import TrainState
    from meshwork.train.trainer import Trainer

    cfg = load_config(ROOT / "configs/unet_digits.yaml", [f"run.dir={tmp_path}"])
    monkeypatch.setattr(images_module, "sample_images", _fake_samples)
    monkeypatch.setattr(nnx, "merge", lambda *a: None)
    trainer = types.SimpleNamespace(cfg=cfg, graphdef=None, context=contextlib.nullcontext)
    state = TrainState(step=None, params=None, buffers=None, opt_state=None)
    Trainer.write_samples(trainer, state, tmp_path / "samples" / "step_000010.png")
    _rows_of_classes(tmp_path / "samples" / "step_000010.png", rows=10, per_row=2)
