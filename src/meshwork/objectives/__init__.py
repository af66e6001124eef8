"""What a task trains for: an objective is a pure function

    loss_fn(params, buffers, batch, noise_key=None) -> (objective, metrics)

`objective` is the scalar that is differentiated; `metrics["loss"]` is what is logged and
validated (the next-token cross-entropy without the MoE auxiliary terms, say). `noise_key` is
the step's key in training (router noise, diffusion noise, LoRA dropout) and None in evaluation,
which then runs without training noise. Each task (train/task.py) names its objective; the
trainer's gradient strategies (train/gradients.py) differentiate whatever objective they get.

- next_token.py: next-token prediction (language models), plain or with the fused head.
- denoising.py: denoising (diffusion UNets).
- preference.py: sequence log-probabilities and the DPO loss (preference pairs against a reference).
- grpo.py: group-normalized advantages and the clipped GRPO objective with a k3 KL to a reference
  (`grpo_objective`: the task of train.objective=grpo, on rollouts of the serving engine).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

Batch = dict[str, jax.Array]
Objective = Callable[..., tuple[jax.Array, dict]]
