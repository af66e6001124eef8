#!/usr/bin/env bash
# The README's test command timed as a new contributor meets it (issue #43's measurement): for each
# commit given, a fresh clone of this repository at that commit, a fresh venv with its test extra,
# empty caches (its own MESHWORK_CACHE), then `python3 -m pytest -q` run twice under /usr/bin/time:
# cold (nothing compiled, no shared run trained) and warm (the same command again).
#
#   bash benchmarks/suite_time.sh 940ffbe HEAD          # before and after, one line each per run
#   WARM=0 bash benchmarks/suite_time.sh HEAD           # the cold run only
#
# Prints "commit  cold|warm  wall  CPU-min  tests"; logs and each run's per-test record (RUN.times.json)
# are kept in $OUT (default /tmp/suite_time).
# A commit from before the persistent caches (940ffbe and older) compiled into a fresh temporary
# folder per run, so its "warm" run is cold too.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-/tmp/suite_time}"
mkdir -p "$out"
for rev in "$@"; do
  sha="$(git -C "$repo" rev-parse --short "$rev")"
  dir="$out/$sha"
  rm -rf "$dir" && mkdir -p "$dir"
  git clone -q "$repo" "$dir/clone" && git -C "$dir/clone" checkout -q "$sha"
  python3 -m venv "$dir/venv"
  "$dir/venv/bin/python3" -m pip install -q -e "$dir/clone[test]" > "$dir/install.log" 2>&1
  runs=(cold)
  [ "${WARM:-1}" = 1 ] && runs+=(warm)
  for run in "${runs[@]}"; do
    (
      cd "$dir/clone"
      # The venv's python3 first on PATH: the tests' subprocesses (`python3 -m train`, notebooks) use it too.
      PATH="$dir/venv/bin:$PATH" MESHWORK_CACHE="$dir/cache" CI=true \
        /usr/bin/time -f "%e %U %S" -o "$dir/$run.time" python3 -m pytest -q > "$dir/$run.log" 2>&1 || true
    )
    # Every test's record of this run (tests/suite_timing.py), kept beside its log.
    cp "$dir/clone/.pytest_cache/meshwork/test_times_quick.json" "$dir/$run.times.json" 2>/dev/null || true
    read -r wall user sys < "$dir/$run.time"
    summary="$(grep -E '[0-9]+ (passed|failed)' "$dir/$run.log" | tail -1)"
    printf '%s  %s  %d min %02d s  %.1f CPU-min  %s\n' "$sha" "$run" "$((${wall%.*} / 60))" "$((${wall%.*} % 60))" \
      "$(echo "($user + $sys) / 60" | bc -l)" "$summary"
  done
done
