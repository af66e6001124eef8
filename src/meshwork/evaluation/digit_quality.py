"""A sample-quality number that needs no download: how often a digit classifier,
trained on the real digits, recognizes generated digits as the class asked for.

Real held-out digits set the ceiling, samples from an untrained model the floor
(about chance, 10%).

    >>> clf = DigitClassifier(16)                           # doctest: +SKIP
    >>> clf.accuracy(samples_NHWC, requested_labels)        # doctest: +SKIP
    0.93
"""

from __future__ import annotations

import numpy as np

from meshwork.data.images import digits, split


class DigitClassifier:
    """Logistic regression on the pixels of the training split of scikit-learn's digits,
    at the resolution the UNet generates (images in [-1, 1], as the model sees them)."""

    def __init__(self, image_size: int, val_fraction: float = 0.1):
        from sklearn.linear_model import LogisticRegression

        images, labels = digits(image_size)
        (train_x, train_y), (self.val_x, self.val_y) = split(images, labels, val_fraction)
        self.model = LogisticRegression(max_iter=2000).fit(train_x.reshape(len(train_x), -1), train_y)

    def accuracy(self, images_NHWC: np.ndarray, labels_N: np.ndarray) -> float:
        images = np.clip(np.asarray(images_NHWC, np.float32), -1, 1)
        return float((self.model.predict(images.reshape(len(images), -1)) == np.asarray(labels_N)).mean())

    def real_accuracy(self) -> float:
        """Accuracy on held-out real digits: what perfect samples would score."""
        return self.accuracy(self.val_x, self.val_y)
