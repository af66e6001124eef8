"""MaxText's training step time on this machine, at the tiny Llama shape that
`benchmarks/train_step.py --matched` runs (vocab 32000, d 256 x 4 layers, 4
heads of 64, mlp 1024, seq 256, global batch 8, bf16 compute / f32 weights,
full remat, scanned layers, dot_product attention, synthetic data), on 1 and on
2 simulated CPU devices (FSDP=2). Meshwork is not run here; divide its own step
time (train_step.py) by these numbers.

    python benchmarks/maxtext_side_by_side.py [--rounds 2] [--steps 12]
                                              [--maxtext-python /work/venv_mt/bin/python]

Each round runs MaxText in a subprocess on 1 device, then on 2; a run's figure
is the median of MaxText's own "completed step: N, seconds: S" lines after the
first 3 steps (compile and warm-up). MaxText measures S as wall time between
consecutive step dispatches, so in steady state it is the step time. The
"other procs' CPU" column is machine-wide busy CPU (/proc/stat) minus MaxText's
own, per second of the run: above ~0.2 cores the run was contended and its
figure is not comparable. "MaxText's cores busy" is its own CPU time (all
threads, /proc/<pid>/stat) over the wall time from step 3 to its last step:
how much of the machine its step uses, to set beside train_step.py --matched's
"cores busy" for meshwork.

The MaxText venv (MaxText 0.2.5 declares a pinned CUDA environment, so install
it without dependencies and add only what the CPU training path imports):

    ~/.pyenv/versions/3.12.1/bin/python -m venv /work/venv_mt
    P=/work/venv_mt/bin/pip
    $P install --no-deps maxtext==0.2.5     # or the downloaded wheel
    printf 'jax==0.12.0.1\\njaxlib==0.12.0.1\\nflax==0.12.12\\n' > /tmp/c.txt
    $P install -c /tmp/c.txt jax==0.12.0.1 jaxlib==0.12.0.1 flax==0.12.12 \\
        optax==0.2.8 orbax-checkpoint==0.12.8 grain==0.2.18 tensorboardX \\
        sentencepiece tiktoken omegaconf pydantic pathwaysutils jinja2 aqtp \\
        qwix tokamax huggingface_hub transformers drjax pillow sympy ml_collections

(resolved: aqtp 0.9.0, drjax 0.2.1, huggingface_hub 2.4.0, ml_collections 1.1.0,
omegaconf 2.4.0, pathwaysutils 0.1.13, pillow 13.0.0, pydantic 2.14.4, qwix
0.1.8, sentencepiece 0.2.3, sympy 1.14.0, tensorboardX 2.6.5, tiktoken 0.14.0,
tokamax 0.0.17, transformers 5.24.0; no torch, no tensorflow). Note the PyPI
package "aqt" is unrelated; MaxText needs "aqtp". Flags that differ from a
plain reading of MaxText's docs: hardware=cpu alone makes MaxText call
jax.distributed.initialize for a multi-host CPU job (needs JOB_INDEX etc.), so
skip_jax_distributed_system=true is also passed.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

SHAPE = (
    "base_emb_dim=256 base_num_decoder_layers=4 base_num_query_heads=4 base_num_kv_heads=4 "
    "head_dim=64 base_mlp_dim=1024 vocab_size=32000 max_target_length=256 dtype=bfloat16 "
    "weight_dtype=float32 remat_policy=full dataset_type=synthetic scan_layers=true "
    "attention=dot_product enable_checkpointing=false hardware=cpu "
    "skip_jax_distributed_system=true gcs_metrics=false enable_tensorboard=false log_config=false"
).split()
GLOBAL_BATCH = 8
SKIP = 3
STEP_RE = re.compile(r"completed step: (\d+), seconds: ([0-9.]+)")


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def busy_cpu_s() -> float:
    """CPU seconds spent busy machine-wide (all processes) since boot."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) of a running process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": fields 3 onward
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_maxtext(python: str, ndev: int, steps: int, out_dir: str) -> tuple[float, list[float], float, float]:
    """(median step seconds, the steps' seconds, other processes' cores, MaxText's own cores busy
    between its step SKIP and its last step: CPU seconds of all its threads over wall seconds)."""
    base_yml = subprocess.check_output(
        [
            python,
            "-c",
            "import maxtext, os; print(os.path.join(os.path.dirname(maxtext.__file__), 'configs', 'base.yml'))",
        ],
        text=True,
    ).strip()
    # Unbuffered, so each step's line arrives as MaxText prints it and its CPU time is read then.
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={ndev}",
        PYTHONUNBUFFERED="1",
    )
    cmd = [
        python,
        "-m",
        "maxtext.trainers.pre_train.train",
        base_yml,
        f"run_name=side_by_side_{ndev}dev",
        f"base_output_directory={out_dir}",
        f"jax_cache_dir={out_dir}/jax_cache",
        f"steps={steps}",
        f"per_device_batch_size={GLOBAL_BATCH // ndev}",
        f"ici_fsdp_parallelism={ndev}",
        *SHAPE,
    ]
    busy0, mine0, t0 = busy_cpu_s(), children_cpu_s(), time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, marks = [], []  # marks: (wall, MaxText's CPU seconds) as steps SKIP.. complete
    for line in proc.stdout:
        out.append(line)
        m = STEP_RE.search(line)
        if m and int(m.group(1)) >= SKIP:
            marks.append((time.monotonic(), process_cpu_s(proc.pid)))
    proc.wait()
    # Cores kept busy by *other* processes during the run (contention indicator).
    others = ((busy_cpu_s() - busy0) - (children_cpu_s() - mine0)) / (time.monotonic() - t0)
    text = "".join(out)
    times = [float(s) for n, s in STEP_RE.findall(text) if int(n) >= SKIP]
    if proc.returncode != 0 or not times:
        sys.exit(f"MaxText failed on {ndev} device(s) (rc={proc.returncode}):\n{text[-3000:]}")
    (w0, c0), (w1, c1) = marks[0], marks[-1]
    cores = (c1 - c0) / (w1 - w0) if w1 > w0 else float("nan")
    return statistics.median(times), times, max(others, 0.0), cores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--maxtext-python", default="/work/venv_mt/bin/python")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12, help="MaxText steps per run (first 3 are skipped)")
    args = ap.parse_args()
    if not (os.path.isfile(args.maxtext_python) and os.access(args.maxtext_python, os.X_OK)):
        print(
            f"{args.maxtext_python} not found: create the MaxText venv as in this script's docstring "
            "(python -m venv /work/venv_mt; pip install --no-deps maxtext==0.2.5; pip install jax==0.12.0.1 ...)",
            file=sys.stderr,
        )
        sys.exit(2)
    versions = subprocess.check_output(
        [
            args.maxtext_python,
            "-c",
            "import sys, jax, jaxlib, importlib.metadata as m; "
            "print(sys.version.split()[0], jax.__version__, jaxlib.__version__, m.version('maxtext'))",
        ],
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        text=True,
    ).split()
    print(
        f"MaxText python {versions[0]}, jax {versions[1]}, jaxlib {versions[2]}, maxtext {versions[3]}; "
        f"{os.cpu_count()} CPUs"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="mt_side_") as out_dir:
        for r in range(args.rounds):
            for ndev in (1, 2):
                before = loadavg()
                med, times, others, cores = run_maxtext(args.maxtext_python, ndev, args.steps, out_dir)
                rows.append((r + 1, ndev, med, min(times), max(times), before, loadavg(), others, cores))
                print(f"  round {r + 1}, {ndev} dev: median {med:.3f} s/step over {len(times)} steps", flush=True)
    print(
        "\n| round | devices | MaxText s/step (median) | min | max | loadavg before | loadavg after "
        "| other procs' CPU (cores) | MaxText's cores busy (steps) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r, ndev, med, lo, hi, before, after, others, cores in rows:
        print(
            f"| {r} | {ndev} | {med:.3f} | {lo:.3f} | {hi:.3f} | {before} | {after} | {others:.2f} "
            f"| {cores:.2f} of {os.cpu_count()} |"
        )
    print("\n| devices | median over rounds (s/step) | tokens/s |")
    print("|---|---|---|")
    for ndev in (1, 2):
        m = statistics.median(row[2] for row in rows if row[1] == ndev)
        print(f"| {ndev} | {m:.3f} | {GLOBAL_BATCH * 256 / m:.0f} |")


if __name__ == "__main__":
    main()
