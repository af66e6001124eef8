"""Sharded, resumable checkpoints with Orbax.

One checkpoint per saved step holds three items: the train state (each host
writes its own shards), the data iterator's state, and the resolved config.
Restoring takes an abstract state whose leaves carry the target shardings, so
a checkpoint written on one mesh restores onto another.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: str | pathlib.Path, *, every: int, keep: int, use_async: bool):
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=every, max_to_keep=keep, enable_async_checkpointing=use_async, create=True)
        self.manager = ocp.CheckpointManager(pathlib.Path(directory).absolute(), options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, data_state: dict, config: dict, *, force: bool = False) -> bool:
        """Saves if `step` is on the interval (or `force`); returns whether it did.

        With async saving the device-to-host copy finishes before this returns,
        so the caller may donate `state` to the next step right away.
        """
        return self.manager.save(step, force=force, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data_iter=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(config)))

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """(state placed by `abstract_state`'s shardings, data-iterator state)."""
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data_iter=ocp.args.JsonRestore()))
        return out["state"], out["data_iter"]

    def saved_config(self, step: int) -> dict:
        """The resolved config stored with checkpoint `step`."""
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_with_shardings(abstract_state: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `abstract_state` carrying `shardings` (a tree prefix is fine)."""
    return jax.tree.map(lambda s, a: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), a), shardings, abstract_state)
