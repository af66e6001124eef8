"""Where training numbers go: metrics.jsonl, TensorBoard events, a progress bar."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

from meshwork.run.durable import replace_file


class MetricsWriter:
    """Appends one JSON object per logged step to `run_dir/metrics.jsonl` and
    mirrors every numeric field to TensorBoard scalars.

    On resume (`resume_step` given), lines past the restored step are dropped
    first: those steps are about to be trained again, and keeping them would
    leave two different losses for one step.
    """

    def __init__(
        self, run_dir: str | pathlib.Path, *, tensorboard: bool, resume_step: int | None = None, enabled: bool = True
    ):
        self.enabled = enabled
        self.path = pathlib.Path(run_dir) / "metrics.jsonl"
        if not enabled:
            return
        if resume_step is not None and self.path.exists():
            self._keep_until(resume_step)
        elif resume_step is None:
            self.path.write_text("")
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(pathlib.Path(run_dir) / "tensorboard"))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, int | float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def truncate(self, step: int) -> None:
        """Drops the rows past `step` (a rollback is about to train them again)."""
        if self.enabled:
            self._file.close()
            self._keep_until(step)
            self._file = self.path.open("a")

    def _keep_until(self, step: int) -> None:
        # A crash can leave a half-written last line; it is past the checkpoint, so it goes too.
        kept = []
        for ln in self.path.read_text().splitlines():
            try:
                if json.loads(ln)["step"] <= step:
                    kept.append(ln)
            except ValueError:
                break
        replace_file(self.path, "".join(ln + "\n" for ln in kept))

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self._tb is not None:
                self._tb.close()


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    return v


def read_metrics(run_dir: str | pathlib.Path) -> list[dict[str, Any]]:
    """The rows of run_dir/metrics.jsonl. A last line without its newline is a row still being
    written (read while the trainer runs) and is left out."""
    text = (pathlib.Path(run_dir) / "metrics.jsonl").read_text()
    complete = text if text.endswith("\n") else text[: text.rfind("\n") + 1]
    return [json.loads(ln) for ln in complete.splitlines() if ln]
