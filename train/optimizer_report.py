"""--dry-run's optimizer lines: the optimizer state one device holds and, under Muon, what the
compiled step's Newton-Schulz sends, each beside the planner's figure (perf/planner_optimizer.py).
The bytes agree exactly; the sharded variant's all-reduces may number fewer in the compiled step,
where XLA joins a matrix's norm all-reduce with another's Gram all-reduce (same bytes).

The compiled side is read from the step's HLO by scope (sharding/hlo.py `in_scope`): train/step.py
runs the update under `jax.named_scope("optimizer")`, and inside it Muon's orthogonalization runs
under `newton_schulz.SCOPE`, so "optimizer/newton_schulz" is Newton-Schulz and the rest of
"optimizer" is the update's other collectives (gradient clipping's norm, a few scalars). The names
are metadata, which jax's persistent compilation cache does not key on: an executable compiled
before a scope was renamed comes back from the cache with the old names (and nothing in the new
scope), so after renaming one, empty the cache (`$MESHWORK_CACHE`'s jax-* folder for the tests).

    python -m train --config configs/lm_tiny.yaml optimizer.name=muon mesh.data=1 mesh.fsdp=8 \\
        rules.preset=fsdp --dry-run
"""

from __future__ import annotations

from typing import Any

from meshwork.config import ConfigError
from meshwork.optimizers.newton_schulz import SCOPE
from meshwork.sharding.hlo import COLLECTIVES, collective_summary
from meshwork.sharding.report import state_bytes

OPTIMIZER_SCOPE = "optimizer"
NEWTON_SCHULZ_SCOPE = f"optimizer/{SCOPE}"


def optimizer_report(trainer) -> dict[str, Any]:
    """The compiled step's optimizer state and collectives, and the planner's, as a JSON-able dict."""
    from meshwork.perf.planner_layout import layout_from_config
    from meshwork.perf.planner_memory import state_memory
    from meshwork.perf.planner_optimizer import VARIANTS, newton_schulz_cost

    cfg, text = trainer.cfg, trainer.step_fn.as_text()
    ns = collective_summary(text, NEWTON_SCHULZ_SCOPE)
    scoped = collective_summary(text, OPTIMIZER_SCOPE)
    other = {k: {f: scoped[k][f] - ns[k][f] for f in scoped[k]} for k in COLLECTIVES}
    real = state_bytes(trainer.abstract.parts(), trainer.shardings.parts(), trainer.grad_shardings)["opt_state"]
    out: dict[str, Any] = {"name": cfg.optimizer.name, "state_bytes": real, "compiled": {"other": other}}
    try:
        if cfg.finetune.method not in ("none", "full"):  # the planner's weights are the model's, all trained
            raise ConfigError(f"the planner counts every weight trained, not finetune.method={cfg.finetune.method}")
        layout = layout_from_config(cfg, trainer.mesh.size)
        out["planner"] = {"state_bytes": state_memory(cfg, layout)["opt_state"]}
        if cfg.optimizer.name == "muon":
            out["planner"]["newton_schulz"] = {v: newton_schulz_cost(cfg, layout, v).to_dict() for v in VARIANTS}
    except ConfigError as e:  # what the planner does not model (a unet, fine-tuning): the compiled side alone
        out["planner_error"] = str(e)
    if cfg.optimizer.name == "muon":
        out["variant"] = cfg.optimizer.muon_settings.newton_schulz
        out["compiled"]["newton_schulz"] = ns
    return out


def _bytes(b: float) -> str:
    return f"{b:,.0f} B ({b / 2**20:,.3f} MiB)"


def _sent(summary: dict) -> str:
    kinds = [f"{k} {v['count']:g} x, {v['bytes']:,.0f} B sent" for k, v in summary.items() if v["count"]]
    return "; ".join(kinds) or "nothing"


def optimizer_lines(report: dict[str, Any]) -> list[str]:
    """The report as text: state, then Newton-Schulz compiled vs planned (bytes sent per device)."""
    planner = report.get("planner", {})
    state = f"optimizer {report['name']}: state {_bytes(report['state_bytes'])} per device"
    lines = [state + (f"; planner: {_bytes(planner['state_bytes'])}" if planner else "")]
    if "newton_schulz" in report["compiled"]:
        variant = report["variant"]
        lines.append(f"  newton-schulz ({variant}) per step, compiled: {_sent(report['compiled']['newton_schulz'])}")
        for v, cost in planner.get("newton_schulz", {}).items():
            mark = "planner" if v == variant else f"planner, if newton_schulz={v}"
            lines.append(
                f"  newton-schulz ({v}) per step, {mark}: {_sent(cost['collectives'])}, {cost['flops']:.3e} FLOPs"
            )
    if any(v["count"] for v in report["compiled"]["other"].values()):
        lines.append(
            f"  other collectives of the update (e.g. gradient clipping's norm): {_sent(report['compiled']['other'])}"
        )
    if "planner_error" in report:
        lines.append(f"  (no planner figures: {report['planner_error']})")
    return lines
