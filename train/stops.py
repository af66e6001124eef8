"""Why a training run stops before its last step, other than a user error (exit 2) or a signal (75).

Kept apart from the trainer so the command line can name these exceptions before jax is imported.
"""


class NonFiniteLoss(RuntimeError):
    """train.on_nan=stop: a step's loss or gradient norm was not finite."""

    exit_status = 3
