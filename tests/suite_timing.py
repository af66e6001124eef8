"""Where the suite's time goes, per test, written by the test session itself.

For every test: wall time (setup + call + teardown), the part spent in shared session fixtures
(charged to whichever test asked first), this process's CPU, the compile time jax reports through
its monitoring events, the subprocesses the test started with their CPU (read from
`RUSAGE_CHILDREN` once they are reaped), and the programs jax compiled or loaded for it, with the
ones this process had already lowered once (`repeated`: work a shared jit would save). Under pytest-xdist each worker measures its own tests and
sends the record in the report's `user_properties`; the controlling process prints the slowest 30
with their shares at the end of the run and writes every record to
`.pytest_cache/meshwork/test_times_<tier>.json`.

The order: files start longest first (`durations.json`, seconds per file of the last recorded run,
written with `--record-durations`), so that neither pytest-xdist worker is left running a long file
alone at the end; a file not in the record counts as the median.

The budget: a quick-tier test whose own time (setup + call, less shared session fixtures) passes
`BUDGET_S` fails, unless it carries `@pytest.mark.over_budget("why", seconds=N)`, which sets its own
(wall time on 2 shared cores varies by a third from run to run: N leaves that room).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import resource
import subprocess
import time

import pytest

BUDGET_S = float(os.environ.get("MESHWORK_TEST_BUDGET_S", "20"))
SLOWEST = 30
_KEY = "meshwork_timing"


class _Meter:
    """Counters of this process, read before and after each test."""

    def __init__(self):
        self.compile_s = 0.0
        self.subprocesses = 0
        self.shared_fixture_s = 0.0
        self.shared_depth = 0
        self._jax_listening = False
        # Programs: each one jax compiles or loads has a persistent-cache key (a hash of the lowered
        # program, the compile options and the versions). A key this process has met before marks
        # work done twice: the same program traced and lowered again by a new function object (a
        # jit made per instance, a lambda per call), and loaded again from the cache.
        self.programs = 0
        self.repeated_programs = 0
        self.repeated_s = 0.0
        self._keys: set[str] = set()
        self._since_last_key = 0.0  # tracing and lowering since the last program's key
        self._last_repeated = False  # the last key was a repeat: its load counts too
        self.repeated_names: list[str] = []  # the repeated programs' names (jit_train_step, ...), in order

    def listen_to_jax(self):
        # jax reports tracing, lowering and backend compilation (a persistent-cache hit included)
        # as duration events; imported lazily, after conftest has set the XLA flags.
        if self._jax_listening:
            return
        from jax import monitoring

        def on_duration(event: str, duration: float, **_):
            if not event.startswith("/jax/core/compile/"):
                return
            self.compile_s += duration
            if event.endswith("backend_compile_duration"):
                if self._last_repeated:
                    self.repeated_s += duration
                self._last_repeated = False
            else:
                self._since_last_key += duration

        monitoring.register_event_duration_secs_listener(on_duration)
        _listen_for_cache_keys(self._on_key)
        self._jax_listening = True

    def _on_key(self, key: str, name: str) -> None:
        self.programs += 1
        self._last_repeated = key in self._keys
        if self._last_repeated:
            self.repeated_programs += 1
            self.repeated_names.append(name)
            self.repeated_s += self._since_last_key
        self._keys.add(key)
        self._since_last_key = 0.0

    def snapshot(self) -> dict:
        me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return {
            "t": time.perf_counter(),
            "cpu": me.ru_utime + me.ru_stime,
            "child_cpu": children.ru_utime + children.ru_stime,
            "compile": self.compile_s,
            "subprocesses": self.subprocesses,
            "shared": self.shared_fixture_s,
            "programs": self.programs,
            "repeated_programs": self.repeated_programs,
            "repeated_s": self.repeated_s,
            "repeated_names": len(self.repeated_names),
        }


def _listen_for_cache_keys(on_key) -> None:
    """Calls `on_key(key, module name)` for each program jax looks up in its persistent cache (hit or miss).

    jax names the key only in a debug-level line of its compiler's logger, so that logger is
    opened to debug records and a filter takes the keys out of them, passing on only the records
    its level let through before: what reaches handlers and pytest's log capture is unchanged.
    """
    import logging

    logger = logging.getLogger("jax._src.compiler")
    passed_before = logger.getEffectiveLevel()

    def take_key(record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        if msg.startswith(("Persistent compilation cache hit for", "PERSISTENT COMPILATION CACHE MISS for")):
            on_key(str(record.args[1]), str(record.args[0]))
        return record.levelno >= passed_before

    logger.addFilter(take_key)
    logger.setLevel(logging.DEBUG)


_METER = _Meter()


@contextlib.contextmanager
def shared_work():
    """Time spent here counts as shared, like a session fixture's: work made once for many tests
    (conftest's trained runs), charged to whichever test asks first, and outside its budget."""
    start = time.perf_counter()
    _METER.shared_depth += 1
    try:
        yield
    finally:
        _METER.shared_depth -= 1
        if _METER.shared_depth == 0:  # the outermost: a session fixture that trains a shared run counts once
            _METER.shared_fixture_s += time.perf_counter() - start


_original_popen_init = subprocess.Popen.__init__


def _counting_popen_init(self, *args, **kwargs):
    _METER.subprocesses += 1
    _original_popen_init(self, *args, **kwargs)


def _delta(before: dict, after: dict) -> dict:
    return {
        "wall_s": after["t"] - before["t"],
        "cpu_s": after["cpu"] - before["cpu"],
        "compile_s": after["compile"] - before["compile"],
        "child_cpu_s": after["child_cpu"] - before["child_cpu"],
        "subprocesses": after["subprocesses"] - before["subprocesses"],
        "shared_fixture_s": after["shared"] - before["shared"],
        "programs": after["programs"] - before["programs"],
        "repeated_programs": after["repeated_programs"] - before["repeated_programs"],
        "repeated_s": after["repeated_s"] - before["repeated_s"],
        "repeated": _METER.repeated_names[before["repeated_names"] : after["repeated_names"]],
        "process": os.environ.get("PYTEST_XDIST_WORKER", "main"),
    }


DURATIONS = pathlib.Path(__file__).with_name("durations.json")


def pytest_addoption(parser):
    parser.addoption(
        "--record-durations",
        action="store_true",
        help="write each file's seconds of this run into tests/durations.json (the order files start in)",
    )


def _file_seconds(tier: str) -> dict[str, float]:
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    tiers = ("quick", "slow") if tier == "all" else (tier,)
    seconds: dict[str, float] = {}
    for t in tiers:
        for path, s in recorded.get(t, {}).items():
            seconds[path] = seconds.get(path, 0.0) + s
    return seconds


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    known = _file_seconds(config.getoption("--tier"))
    if not known:
        return
    median = sorted(known.values())[len(known) // 2]
    path = {id(item): item.nodeid.split("::")[0] for item in items}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(path[id(item)], i)
    # Longest file first; a file's tests keep their order (module fixtures are made once per file).
    items.sort(key=lambda item: (-known.get(path[id(item)], median), first[path[id(item)]]))


def _record_durations(records: list[dict], tier: str) -> None:
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    files: dict[str, float] = {}
    for r in records:
        key = r["test"].split("::")[0]
        files[key] = files.get(key, 0.0) + r["wall_s"]
    recorded[tier] = {k: round(v, 1) for k, v in sorted(files.items())}
    DURATIONS.write_text(json.dumps(recorded, indent=1) + "\n")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "over_budget(reason, seconds=N): a quick-tier test allowed past the "
        f"{BUDGET_S:.0f} s budget, why, and its own (tests/suite_timing.py)",
    )
    subprocess.Popen.__init__ = _counting_popen_init


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.scope != "session":
        yield
        return
    with shared_work():
        yield


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    _METER.listen_to_jax()
    item._meshwork_start = _METER.snapshot()
    yield


def _own_seconds(measured: dict) -> float:
    return measured["wall_s"] - measured["shared_fixture_s"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    start = getattr(item, "_meshwork_start", None)
    if start is not None and call.when == "teardown":
        measured = _delta(start, _METER.snapshot())
        item.user_properties.append((_KEY, measured))
    outcome = yield
    report = outcome.get_result()
    if start is None or call.when != "call" or not report.passed or item.config.getoption("--tier") != "quick":
        return
    marker = item.get_closest_marker("over_budget")
    budget = marker.kwargs.get("seconds", float("inf")) if marker else BUDGET_S
    own = _own_seconds(_delta(start, _METER.snapshot()))
    if own > budget:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {own:.1f} s of its own (setup + call, shared session fixtures "
            f"left out), over its {budget:.0f} s budget: make it cheaper, move it to the slow "
            f'tier, or mark it @pytest.mark.over_budget("why", seconds=...)'
        )


def pytest_runtest_logreport(report):
    if report.when != "teardown":
        return
    for key, value in report.user_properties:
        if key == _KEY:
            _RECORDS.append({"test": report.nodeid, **value})


_RECORDS: list[dict] = []  # in the process that prints the summary: the controller, or the only one


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    session.config._meshwork_session_start = time.perf_counter()


def _table(records: list[dict], session_wall_s: float) -> list[str]:
    total = sum(r["wall_s"] for r in records) or 1.0
    compile_total = sum(r["compile_s"] for r in records)
    child_total = sum(r["child_cpu_s"] for r in records)
    cpu_total = sum(r["cpu_s"] for r in records) + child_total or 1.0
    per_process: dict[str, float] = {}
    for r in records:
        per_process[r["process"]] = per_process.get(r["process"], 0.0) + r["compile_s"]
    lines = [
        f"meshwork test times: {len(records)} tests, {total:.0f} s of test time in a {session_wall_s:.0f} s "
        f"session; compile {compile_total:.0f} s ({100 * compile_total / total:.0f}% of test time), "
        f"subprocess CPU {child_total:.0f} s ({100 * child_total / cpu_total:.0f}% of CPU), "
        f"{sum(r['subprocesses'] for r in records)} subprocesses; "
        f"{sum(r['programs'] for r in records)} programs compiled or loaded, "
        f"{sum(r['repeated_programs'] for r in records)} of them again in the same process "
        f"({sum(r['repeated_s'] for r in records):.0f} s)",
        # Tracing and lowering are never cached and loading a cached program is not free: with these
        # programs, no split of the tests among the processes ends before the compile path's even share
        # (cold, a split moves only which process compiles a shared program and which loads it).
        f"compile floor: {compile_total:.0f} s of jax's compile path over {len(per_process)} processes "
        f"(busiest {max(per_process.values(), default=0.0):.0f} s): no split of these tests ends in under "
        f"{compile_total / max(len(per_process), 1):.0f} s",
        f"slowest {SLOWEST}:  wall s | share | shared fixture s | compile s | subprocesses (CPU s) | test",
    ]
    for r in sorted(records, key=lambda r: -r["wall_s"])[:SLOWEST]:
        lines.append(
            f"  {r['wall_s']:7.1f} | {100 * r['wall_s'] / total:4.1f}% | {r['shared_fixture_s']:6.1f} | "
            f"{r['compile_s']:6.1f} | {r['subprocesses']:2d} ({r['child_cpu_s']:5.1f}) | {r['test']}"
        )
    return lines


def pytest_terminal_summary(terminalreporter, config):
    records = _RECORDS
    if not records or hasattr(config, "workerinput"):  # an xdist worker: the controller prints
        return
    session_wall_s = time.perf_counter() - config._meshwork_session_start
    for line in _table(records, session_wall_s):
        terminalreporter.write_line(line)
    out = config.rootpath / ".pytest_cache" / "meshwork" / f"test_times_{config.getoption('--tier')}.json"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"session_wall_s": session_wall_s, "tests": records}, indent=1))
        terminalreporter.write_line(f"every test's record: {out}")
    except OSError as e:  # a checkout this user cannot write to: the table above is all there is
        terminalreporter.write_line(f"every test's record: not written ({e.strerror}: {out})")
    if config.getoption("--record-durations"):
        _record_durations(records, config.getoption("--tier"))
        terminalreporter.write_line(f"each file's seconds: {DURATIONS}")
