"""Image sources for the UNet: the bundled digits and a folder of the user's files."""

import numpy as np
from PIL import Image

from meshwork.config import load_config
from meshwork.evaluation.digit_quality import DigitClassifier
from meshwork.data.images import digits, image_folder, image_train_iterator
from meshwork.train.task import make_task

from conftest import ROOT


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
    cfg = load_config(ROOT / "configs/unet_digits.yaml", [
        "data.source=images", f"data.image_dir={tmp_path}", "model.unet.in_channels=3", "model.unet.out_channels=3",
        "data.val_fraction=0.3"])
    task = make_task(cfg)
    batch = next(image_train_iterator(*task.train_set, 2, seed=0))
    assert batch["images"].shape == (2, 16, 16, 3) and batch["labels"].shape == (2,)


def test_digit_classifier_separates_real_from_noise():
    clf = DigitClassifier(16)
    assert clf.real_accuracy() > 0.9
    noise = np.random.default_rng(0).uniform(-1, 1, (200, 16, 16, 1))
    assert clf.accuracy(noise, np.arange(200) % 10) < 0.3
