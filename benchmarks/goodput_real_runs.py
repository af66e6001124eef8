"""Goodput under failures, measured: lm_tiny killed by kill -9 on a seeded trace, against the simulator.

Part 2, agreement with a real run (--real-modes: persistent by default; fast and elastic use
`checkpoint.fast_every` and `train.elastic`). lm_tiny with tests/conftest.py's tiny overrides trains as a subprocess
on CPU (one device, no persistent compilation cache, synchronous checkpoints every --every
steps). A seeded failure trace (its first --kills times; mean --run-mttf seconds, by default a
third of the wall time the run would take without failures, estimated from its first rows;
counted from its third metrics row, so that on a busy machine too the kills land in training
and restarts, not in the first compile) kills its process group with SIGKILL, and it is
restarted at once each time (the same command resumes from the newest checkpoint).
The costs come from that run: the mean step time and the checkpoint stall from the trainer's
own `step_time_s` rows, the first start's and each restart's time from the failure to training
again from when its metrics rows appeared (the file is polled every 5 ms), and the tail (final
eval, exit). The simulator, fed the same trace and those costs, predicts the wall time; goodput
is train.steps x step time over wall time in both, so its error is the wall time's. The trainer's
own account (the time_* columns of metrics.jsonl's last row) is printed beside it. The costs are
measured in the same run, so what the comparison tests is the timeline: where the kills land
against the checkpoints, the work lost, the restarts, and the kills that strike a restart.
Mode (b) adds `checkpoint.fast_every=--fast-every` on a local-disk fast tier (it survives the
kill). Mode (c) is one process on 8 simulated CPU devices under dp with `train.elastic`: a
failure writes devices 4-7 into the trainer's fault file, which is emptied --replacement-real
seconds later (default half the MTTF); the costs are the trainer's `elastic_lost_s` rows
(shrink, grow) and the step times on 8 and on 4 devices. On one CPU, 4 simulated devices run no
slower than 8 (the same 2 cores; often faster, a negative degraded fraction), so the degraded
throughput that matters at scale is not exercised there.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from meshwork.perf.goodput_sim import Scenario, simulate

ROOT = pathlib.Path(__file__).resolve().parents[1]
# tests/conftest.py's tiny_overrides (without run.dir), a model that compiles in seconds.
TINY = [
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=128",
    "data.seq_len=32",
    "train.global_batch=8",
    "log.progress=false",
    "log.tensorboard=false",
    "log.eval_batches=2",
]
RESTORE_LINE = re.compile(r"restoring the checkpoint of step (\d+)")
LOG_EVERY = 10
KEYS: dict[str, float] = {}  # the real runs' figures, printed as key=value by goodput_sim.py


def trainer_env(devices: int) -> dict[str, str]:
    """`devices` CPU devices and no persistent compilation cache, whatever the caller's environment
    (pytest's conftest sets 8 devices and a cache): every restart compiles, as the costs printed say."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    flags += [f"--xla_force_host_platform_device_count={devices}"] if devices > 1 else []
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))
    return env


def poll_rows(metrics: pathlib.Path, seen: set[str], t0: float, rows: list) -> None:
    """Appends the rows of `metrics` not seen before, stamped with now (rows are whole lines, flushed one by
    one; a rewrite on resume keeps the old rows, which are then not new)."""
    try:
        with metrics.open("rb") as f:
            offset = max(0, f.seek(0, 2) - 8192)
            f.seek(offset)
            lines = f.read().decode(errors="replace").split("\n")[:-1]  # the last one may be half-written
    except FileNotFoundError:
        return
    for line in lines[1:] if offset else lines:
        if line and line not in seen:
            seen.add(line)
            rows.append((time.monotonic() - t0, json.loads(line)))


def run_with_kills(
    cmd: list[str], run_dir: pathlib.Path, steps: int, unit_trace: np.ndarray, mttf: float | None, max_wall: float
) -> tuple[float, np.ndarray, float, list[dict]]:
    """Runs `cmd` to completion, killing it (SIGKILL) and relaunching it at once at the failure times.

    The failures are `unit_trace` (a Poisson trace of mean 1) times `mttf`, counted from the first
    launch's third metrics row, so that on a busy machine as on an idle one the first kill lands
    in training, not in the first compile. mttf None: a third of the wall time the run would take
    without failures, estimated at that row (its time + `steps` x the step time so far). Returns
    the wall time, the kill times (s after the first launch), the MTTF used and, per launch: its
    start and end, its fate, its stdout lines and the metrics.jsonl rows it wrote, each stamped
    with when it appeared (the file is polled every 5 ms)."""
    env = trainer_env(1)
    metrics, seen = run_dir / "metrics.jsonl", set()
    t0 = time.monotonic()
    launches, k, kills = [], 0, None

    def poll(launch):
        poll_rows(metrics, seen, t0, launch["rows"])

    while True:
        now = time.monotonic() - t0
        # A session of its own, so that the kill takes the trainer's children too, as a machine's failure would.
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        failed_at = float(kills[k - 1]) if k else 0.0  # when the failure that this launch recovers from struck
        launch = {"start": now, "failed_at": failed_at, "lines": [], "rows": [], "killed": False}
        launches.append(launch)

        def read(proc=proc, lines=launch["lines"]):
            for line in proc.stdout:
                lines.append((time.monotonic() - t0, line.rstrip("\n")))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            while proc.poll() is None and time.monotonic() - t0 < (
                deadline := min(kills[k] if kills is not None and k < len(kills) else max_wall, max_wall)
            ):
                poll(launch)
                if kills is None and len(rows := [(t, r) for t, r in launch["rows"] if "step_time_s" in r]) >= 3:
                    step_time = np.mean([r["step_time_s"] for _, r in rows[1:3]])
                    mttf = mttf or (rows[0][0] + steps * step_time) / 3
                    kills = rows[2][0] + unit_trace * mttf
                time.sleep(0.005)
        except BaseException:  # Ctrl-C or a signal: leave no trainer behind
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        if proc.poll() is None and any(line.startswith("done: ") for _, line in launch["lines"]):
            proc.wait()  # the work is done and saved: a failure now costs nothing, so none is injected
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join()
            poll(launch)  # its last rows
            if kills is None or k >= len(kills) or deadline >= max_wall:
                raise SystemExit(f"goodput_sim.py: the real run passed --max-wall={max_wall:g} s; raise it")
            launch.update(killed=True, end=float(kills[k]))
            k += 1
            continue
        launch["end"] = time.monotonic() - t0
        reader.join()
        poll(launch)
        if proc.returncode != 0:
            tail = "\n".join(line for _, line in launch["lines"][-15:])
            raise SystemExit(f"goodput_sim.py: the trainer exited with status {proc.returncode}:\n{tail}")
        return launch["end"], (kills[:k] if kills is not None else np.array([])), mttf, launches


def measure(launches: list[dict], every: int, fast_every: int | None) -> dict:
    """Costs from the launches' metrics rows: the trainer's own step_time_s (a row of step s covers the
    steps since the previous row; a checkpoint of step s is saved after its row, so it falls in the
    next row's time) and the rows' arrival times."""
    regular, saves = [], {"persistent": [], "fast": []}
    for launch in launches:
        rows = [r for _, r in launch["rows"] if "step_time_s" in r]
        for prev, row in itertools.pairwise(rows):  # the first row of a launch includes its warm-up
            s1, s2 = prev["step"], row["step"]
            # A persistent save of step x comes after x's row is flushed, so it lands in the next row's
            # time (with the fast copy of the same step, if any); a fast copy alone lands in x's own row.
            persist = any(x % every == 0 for x in range(s1, s2))
            fast = fast_every is not None and any(x % fast_every == 0 and x % every for x in range(s1 + 1, s2 + 1))
            if persist and fast:
                continue
            (saves["persistent"] if persist else saves["fast"] if fast else regular).append(
                (row["step_time_s"] * (s2 - s1), s2 - s1)
            )
    step_time = sum(dt for dt, _ in regular) / sum(ds for _, ds in regular)
    # A stall smaller than the steps' jitter can come out negative: it is then taken as none.
    cost = {
        tier: max(0.0, float(np.mean([dt - ds * step_time for dt, ds in v]))) if v else 0.0 for tier, v in saves.items()
    }
    first, restarts = None, []
    for launch in launches:
        restored = [int(m.group(1)) for _, line in launch["lines"] if (m := RESTORE_LINE.search(line))]
        back = restored[0] if restored else 0
        rows = [(t, r) for t, r in launch["rows"] if "step_time_s" in r and r["step"] > back]
        if not rows:  # killed before its first row
            continue
        t, row = rows[0]
        to_training = t - launch["failed_at"] - (row["step"] - back) * step_time
        if restored:
            restarts.append(to_training)
        elif first is None:
            first = to_training
    last = launches[-1]
    tail = last["end"] - [t for t, r in last["rows"] if "step_time_s" in r][-1] - cost["persistent"]
    return {
        "step_time": step_time,
        "checkpoint": cost["persistent"],
        "fast_checkpoint": cost["fast"],
        "initial": first,
        "restart": float(np.mean(restarts)) if restarts else None,
        "restarts": restarts,
        "tail": tail,
        "n_steady": len(regular),
        "n_saves": len(saves["persistent"]),
    }


def real_run(args, unit_trace: np.ndarray, fast_every: int | None) -> dict:
    mode = "fast" if fast_every else "persistent"
    with tempfile.TemporaryDirectory(prefix="goodput_sim_") as tmp:
        run_dir = pathlib.Path(tmp) / "run"
        cmd = [
            sys.executable,
            "-m",
            "train",
            "--config",
            "configs/lm_tiny.yaml",
            f"run.dir={run_dir}",
            *TINY,
            f"train.steps={args.steps}",
            f"checkpoint.every={args.every}",
            "checkpoint.async=false",
            f"log.every={LOG_EVERY}",
            "log.eval_every=1000000",
        ]
        if fast_every:
            cmd += [f"checkpoint.fast_every={fast_every}", f"checkpoint.fast_path={pathlib.Path(tmp) / 'fast'}"]
        wall, kills, mttf, launches = run_with_kills(cmd, run_dir, args.steps, unit_trace, args.run_mttf, args.max_wall)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        account = next((r for r in reversed(rows) if "time_wall_s" in r), {})
    if args.log:
        log = args.log.with_name(f"{args.log.stem}_{mode}{args.log.suffix}")
        log.write_text(json.dumps({"cmd": cmd, "kills": kills.tolist(), "wall": wall, "launches": launches}))
    c = measure(launches, args.every, fast_every)
    restart = c["restart"] if c["restart"] is not None else c["initial"]  # no kill hit after a checkpoint
    s = Scenario(
        mode,
        c["step_time"],
        c["checkpoint"],
        args.every,
        restart,
        fast_every=fast_every,
        fast_cost=c["fast_checkpoint"],
        fast_recovery_cost=restart,
        initial_cost=c["initial"],
    )
    sim = simulate(s, kills, total_steps=args.steps)
    sim_wall = sim.wall + c["tail"]
    productive = args.steps * c["step_time"]
    real_g, sim_g = productive / wall, productive / sim_wall
    kills_used = sum(launch["killed"] for launch in launches)
    print(
        f"\n# Part 2: real run, mode {mode!r}: lm_tiny tiny overrides, {args.steps} steps, checkpoint every "
        f"{args.every}" + (f", fast tier every {fast_every}" if fast_every else "") + ", synchronous writes"
    )
    print(
        f"kill trace (seed {args.seed}, mean {mttf or 0:.1f} s): "
        + ", ".join(f"{t:.1f}" for t in kills)
        + f" s; kills that landed: {kills_used}, simulated failures: "
        f"{sim.failures}"
    )
    print(
        "launches: "
        + "; ".join(
            f"{launch['start']:.1f}-{launch['end']:.1f} s" + (" killed" if launch["killed"] else " finished")
            for launch in launches
        )
    )
    print(
        f"measured costs: step {c['step_time'] * 1e3:.2f} ms ({c['n_steady']} rows), persistent checkpoint "
        f"{c['checkpoint']:.3f} s ({c['n_saves']} saves)"
        + (f", fast copy {c['fast_checkpoint']:.3f} s" if fast_every else "")
        + f", first start {c['initial']:.2f} s, restarts "
        + ", ".join(f"{x:.2f}" for x in c["restarts"])
        + f" s (mean {restart:.2f}), tail (final eval, exit) {c['tail']:.2f} s"
    )
    print(
        f"real wall {wall:.2f} s, simulated {sim_wall:.2f} s; goodput (steps x step time / wall): real "
        f"{real_g:.4f}, simulated {sim_g:.4f}, relative error {(sim_g - real_g) / real_g:+.2%}"
    )
    print(
        "simulated breakdown (s): "
        + ", ".join(f"{k} {v:.2f}" for k, v in sim.breakdown.items())
        + f", tail {c['tail']:.2f}"
    )
    if account:
        print(
            "trainer's account (metrics.jsonl, from its first start, python start-up not counted): goodput "
            f"{account['goodput']:.4f} of {account['time_wall_s']:.1f} s; "
            + ", ".join(
                f"{k[5:-2]} {v:.2f}" for k, v in account.items() if k.startswith("time_") and k != "time_wall_s"
            )
        )
    KEYS.update(
        {
            f"real_goodput[{mode}]": real_g,
            f"sim_goodput[{mode}]": sim_g,
            f"rel_error[{mode}]": (sim_g - real_g) / real_g,
        }
    )
    return {"real": real_g, "sim": sim_g}


LOST = "4 5 6 7"  # half of the 8 devices: one failure takes a host


def elastic_run(args, unit_trace: np.ndarray) -> dict:
    """Mode (c) for real: one process on 8 CPU devices under dp with train.elastic; a failure writes
    LOST into its fault file, the replacement (--replacement-real s later, default half the MTTF)
    empties it. Failures that strike while the devices are still out are not injected."""
    with tempfile.TemporaryDirectory(prefix="goodput_sim_") as tmp:
        run_dir, faults = pathlib.Path(tmp) / "run", pathlib.Path(tmp) / "lost_devices"
        cmd = [
            sys.executable,
            "-m",
            "train",
            "--config",
            "configs/lm_tiny.yaml",
            f"run.dir={run_dir}",
            *TINY,
            f"train.steps={args.steps}",
            f"checkpoint.every={args.every}",
            "checkpoint.async=false",
            f"log.every={LOG_EVERY}",
            "log.eval_every=1000000",
            "mesh.data=8",
            "rules.preset=dp",
            f"checkpoint.fast_every={args.fast_every}",
            f"checkpoint.fast_path={pathlib.Path(tmp) / 'fast'}",
            "train.elastic=true",
            f"train.fault_file={faults}",
        ]

        def write(text):  # whole or not at all: the trainer reads the file at every step
            faults.with_suffix(".tmp").write_text(text)
            faults.with_suffix(".tmp").replace(faults)

        write("")
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=trainer_env(8),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        lines, rows, seen, events = [], [], set(), []
        reader = threading.Thread(
            target=lambda: lines.extend((time.monotonic() - t0, x.rstrip("\n")) for x in proc.stdout), daemon=True
        )
        reader.start()
        kills, k, back_at, mttf, replacement = None, 0, None, args.run_mttf, args.replacement_real
        try:
            while proc.poll() is None:
                now = time.monotonic() - t0
                if now > args.max_wall:
                    raise SystemExit(f"goodput_sim.py: the real run passed --max-wall={args.max_wall:g} s; raise it")
                poll_rows(run_dir / "metrics.jsonl", seen, t0, rows)
                if kills is None and len(steady := [(t, r) for t, r in rows if "step_time_s" in r]) >= 3:
                    mttf = mttf or (steady[0][0] + args.steps * np.mean([r["step_time_s"] for _, r in steady[1:3]])) / 3
                    replacement = replacement or mttf / 2
                    kills = steady[2][0] + unit_trace * mttf
                if back_at is not None and now >= back_at:
                    write("")
                    back_at = None
                while kills is not None and k < len(kills) and now >= kills[k]:
                    if back_at is None and not any(x.startswith("done: ") for _, x in lines):
                        write(LOST + "\n")
                        back_at = kills[k] + replacement
                        events.append(float(kills[k]))
                    k += 1
                time.sleep(0.005)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        wall = time.monotonic() - t0
        reader.join()
        poll_rows(run_dir / "metrics.jsonl", seen, t0, rows)
        if proc.returncode != 0:
            raise SystemExit(
                f"goodput_sim.py: the trainer exited with status {proc.returncode}:\n"
                + "\n".join(x for _, x in lines[-15:])
            )
    if args.log:
        log = args.log.with_name(f"{args.log.stem}_elastic{args.log.suffix}")
        log.write_text(json.dumps({"cmd": cmd, "failures": events, "wall": wall, "lines": lines, "rows": rows}))
    # Costs. A change at step s, like a persistent save, comes after s's row: it lands in the next row.
    changes = [r for _, r in rows if "elastic_reason" in r]
    shrinks = [r["elastic_lost_s"] for r in changes if r["elastic_devices"] < 8]
    grows = [r["elastic_lost_s"] for r in changes if r["elastic_devices"] == 8]
    redone = sum(r.get("elastic_steps_redone", 0) for r in changes)
    change_steps = {r["step"]: r["elastic_devices"] for r in changes}
    devices, full, degraded, saves = 8, [], [], {"persistent": [], "fast": []}
    timed = [(t, r) for t, r in rows if "step_time_s" in r]
    for (_, prev), (_, row) in itertools.pairwise(timed):
        s1, s2 = prev["step"], row["step"]
        moved = [change_steps[x] for x in range(s1, s2) if x in change_steps]
        persist = any(x % args.every == 0 for x in range(s1, s2))
        fast = any(x % args.fast_every == 0 and x % args.every for x in range(s1 + 1, s2 + 1))
        if moved:
            devices = moved[-1]
            continue
        item = (row["step_time_s"] * (s2 - s1), s2 - s1)
        if persist or fast:
            if devices == 8 and not (persist and fast):
                saves["persistent" if persist else "fast"].append(item)
        else:
            (full if devices == 8 else degraded).append(item)
    step_time = sum(a for a, _ in full) / sum(b for _, b in full)
    step_degraded = sum(a for a, _ in degraded) / sum(b for _, b in degraded) if degraded else step_time
    cost = {
        tier: max(0.0, float(np.mean([a - b * step_time for a, b in v]))) if v else 0.0 for tier, v in saves.items()
    }
    initial = timed[0][0] - timed[0][1]["step"] * step_time
    tail = wall - timed[-1][0] - cost["persistent"]
    fraction = min(0.99, max(-0.99, 1 - step_time / step_degraded))  # negative: 4 devices ran faster than 8
    shrink = float(np.mean(shrinks)) if shrinks else 0.0
    s = Scenario(
        "elastic",
        step_time,
        cost["persistent"],
        args.every,
        recovery_cost=initial,
        fast_every=args.fast_every,
        fast_cost=cost["fast"],
        fast_recovery_cost=shrink,
        rollback=1.0 if redone else 0.0,
        degraded_fraction=fraction,
        replacement_time=replacement,
        rejoin_cost=float(np.mean(grows)) if grows else 0.0,
        initial_cost=initial,
    )
    sim = simulate(s, np.array(events), total_steps=args.steps)
    sim_wall = sim.wall + tail
    productive = args.steps * step_time
    real_g, sim_g = productive / wall, productive / sim_wall
    print(
        f"\n# Part 2: real run, mode 'elastic': lm_tiny tiny overrides on 8 CPU devices (dp), {args.steps} steps, "
        f"checkpoint every {args.every}, fast tier every {args.fast_every}, train.elastic; a failure loses devices "
        f"{LOST}, back {replacement:.1f} s later"
    )
    print(
        f"failure trace (seed {args.seed}, mean {mttf:.1f} s): injected at "
        + ", ".join(f"{t:.1f}" for t in events)
        + f" s; changes: {len(shrinks)} shrinks, {len(grows)} grows, {redone} steps redone"
    )
    print(
        f"measured costs: step {step_time * 1e3:.2f} ms on 8 ({len(full)} rows), {step_degraded * 1e3:.2f} ms on 4 "
        f"({len(degraded)} rows; degraded fraction {fraction:.3f}), persistent checkpoint {cost['persistent']:.3f} s, "
        f"fast copy {cost['fast']:.3f} s, first start {initial:.2f} s, shrinks "
        + ", ".join(f"{x:.2f}" for x in shrinks)
        + " s, grows "
        + ", ".join(f"{x:.2f}" for x in grows)
        + f" s, tail {tail:.2f} s"
    )
    print(
        f"real wall {wall:.2f} s, simulated {sim_wall:.2f} s; goodput (steps x step time / wall): real "
        f"{real_g:.4f}, simulated {sim_g:.4f}, relative error {(sim_g - real_g) / real_g:+.2%}"
    )
    print(
        "simulated breakdown (s): " + ", ".join(f"{k} {v:.2f}" for k, v in sim.breakdown.items()) + f", tail {tail:.2f}"
    )
    KEYS.update(
        {
            "real_goodput[elastic]": real_g,
            "sim_goodput[elastic]": sim_g,
            "rel_error[elastic]": (sim_g - real_g) / real_g,
        }
    )
    return {"real": real_g, "sim": sim_g}
