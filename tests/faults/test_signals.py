"""Ctrl-C and SIGTERM at any moment end an attnx command as asked, wherever they land
(attnx._signals; docs/reference/behaviour.md, "Exit codes and errors" and "Nothing is half-written").

Every run is a real attnx process with real signals, and every run is held to the whole promise:
- exit 130 for SIGINT, 143 for SIGTERM (the first one sent); 0 only when the command had done
  its work (its output is then complete and new), never an abort or a death by the signal;
- exactly one line on stderr says why (when it is not 0); no "Traceback", no "Exception ignored";
- the output that was there before is byte for byte what it was; no stage (.NAME.partial-*) or
  lock (.NAME.lock) beside it; the command's scratch folder is gone (nothing of attnx in TMPDIR);
- no process of the run is left: every process carrying the run's tag in its environment (the
  command's children inherit it) is gone from the process table.

- The storm: signals at random moments over whole runs of export and build, both kinds, some
  runs two of them (the second while the first is being handled), until that many runs were
  signalled while running (a run that ended before its moment is checked and not counted).
  Default profile: the tiny preset, 3 exports and 3 builds; ATTNX_FAULTS=long: the large preset,
  100 and 100 (about 25 minutes on 2 cores; ATTNX_STORM=PRESET:EXPORTS:BUILDS sets them).
  Moments are drawn from the instant attnx's handlers are in place (the kernel's SigCgt shows
  SIGTERM caught; before it the interpreter is starting, about 0.06 s idle, and a signal is
  Python's own) to 10% past the command's uninterrupted time, from a seed printed in every
  failure (ATTNX_STORM_SEED=N replays it; ATTNX_STORM_REPORT=FILE writes the counts as JSON).
- Traps: the process sends itself the signal from inside a weakref callback, a __del__, and
  torch's dispatcher during torch.export's tracing (tests/faults/_signal_traps.py), and holds
  there: a handler that raised there was swallowed or aborted the process; also just after the
  output was published (the commit: exit 0), and while fd 2 points at a capture file.
- Children: bench and matrix interrupted while a worker runs leave no worker behind, and keep
  the cases they finished.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time

import pytest

from attnx.export._export import TRACE_CACHE_ENV
from attnx.model import describe
from attnx.runtimes.package import verify_package
from tests.faults.conftest import PROFILE, leftovers, snapshot

# the signal storm and its traps: real processes signalled at chosen and random moments (the fast tier leaves them)
pytestmark = pytest.mark.slow

TRAPS = os.path.dirname(os.path.abspath(__file__))
# The trap's bootstrap: the traps first, then attnx's main as the console script runs it.
TRAP_MAIN = (
    f"import sys; sys.path.insert(0, {TRAPS!r}); import _signal_traps; from attnx.cli import main; sys.exit(main())"
)
CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
STORM = {"default": ("tiny", 3, 3), "long": ("large", 100, 100)}[PROFILE]  # preset, exports, builds
if os.environ.get("ATTNX_STORM"):  # PRESET:EXPORTS:BUILDS, e.g. large:100:100
    _preset, _exports, _builds = os.environ["ATTNX_STORM"].split(":")
    STORM = (_preset, int(_exports), int(_builds))


class Run:
    """One attnx process: its own tag, TMPDIR and log files; signals sent at chosen moments."""

    def __init__(self, args: list[str], cwd, *, trap: dict[str, str] | None = None) -> None:
        self.cwd = str(cwd)
        self.tag = secrets.token_hex(8)
        self.tmp = os.path.join(self.cwd, "tmp")
        self.logs = os.path.join(self.cwd, "logs")
        os.makedirs(self.tmp, exist_ok=True)
        os.makedirs(self.logs, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": self.tmp, "ATTNX_TEST_TAG": self.tag}
        cmd = [sys.executable, "-m", "attnx.cli", *args]
        if trap is not None:
            env.update(trap, ATTNX_TRAP_LOG=os.path.join(self.logs, "trap.log"))
            cmd = [sys.executable, "-c", TRAP_MAIN, *args]
        self.out_path, self.err_path = os.path.join(self.logs, "out.txt"), os.path.join(self.logs, "err.txt")
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.start = time.monotonic()
            self.proc = subprocess.Popen(cmd, cwd=self.cwd, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        self.sent: list[tuple[float, signal.Signals]] = []

    def handlers_in_place(self, timeout: float = 60) -> float:
        """Seconds from the start until attnx's handlers are in place: the kernel's SigCgt (the
        signals the process catches) has SIGTERM, which attnx._signals.install() catches first
        thing. Before that the interpreter starts (about 0.06 s on an idle machine, more on a
        loaded one): a signal there is Python's own, as in any program."""
        bit = 1 << (signal.SIGTERM - 1)
        deadline = self.start + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as f:
                    caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
            except (OSError, StopIteration, ValueError):
                caught = 0
            if caught & bit:
                break
            time.sleep(0.002)
        return time.monotonic() - self.start

    def at(self, moment: float, sig: signal.Signals) -> None:
        """Send `sig` `moment` seconds after the start (at once if that is past)."""
        time.sleep(max(0.0, self.start + moment - time.monotonic()))
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.sent.append((round(time.monotonic() - self.start, 3), sig))

    def send(self, sig: signal.Signals) -> None:
        self.at(0.0, sig)

    def wait(self, timeout: float = 600) -> int:
        self.proc.wait(timeout=timeout)
        self.seconds = time.monotonic() - self.start
        with open(self.err_path, encoding="utf-8", errors="replace") as f:
            self.err = f.read()
        return self.proc.returncode

    def reason_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.startswith("attnx ") and ": warning: " not in line]

    def trap_log(self) -> str:
        path = os.path.join(self.logs, "trap.log")
        if not os.path.exists(path):
            return ""
        with open(path, encoding="utf-8") as f:
            return f.read()

    def alive(self) -> list[int]:
        """The processes of this run still in the process table (not zombies)."""
        return tagged(self.tag)


def tagged(tag: str) -> list[int]:
    mark = f"ATTNX_TEST_TAG={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if mark in env and state not in ("Z", "X"):
            found.append(int(entry))
    return found


def process_problems(run: Run) -> list[str]:
    """What in how the run ended breaks the promise (empty: it ended as asked)."""
    rc = run.proc.returncode
    kinds = {sig for _, sig in run.sent}
    allowed = {0} | ({CODES[kinds.pop()]} if len(kinds) == 1 else set(CODES.values()) if kinds else set())
    found = []
    if rc not in allowed:
        found.append(f"exit {rc}, not one of {sorted(allowed)}")
    for bad in ("Traceback", "Exception ignored"):
        if bad in run.err:
            found.append(f"{bad!r} on stderr")
    lines = run.reason_lines()
    if (rc != 0 and len(lines) != 1) or len(lines) > 1:
        found.append(f"{len(lines)} lines saying why: {lines}")
    ours = [e for e in os.listdir(run.tmp) if e.startswith("attnx-")]  # (onnxruntime keeps a .ses file there)
    if ours:
        found.append(f"left in TMPDIR: {ours}")
    deadline = time.monotonic() + 3.0
    while run.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if run.alive():
        found.append(f"processes of the run still running: {run.alive()}")
    return found


def output_problems(run: Run, output: str, before: object, complete) -> list[str]:
    """What is wrong with the output: changed by a run that did not end 0, unchanged or not
    complete after 0, a stage or lock beside it."""
    rc, now, found = run.proc.returncode, snapshot(output), []
    if rc != 0 and now != before:
        found.append(f"{output} changed by a run that ended {rc}")
    if rc == 0 and now == before:
        found.append(f"{output} unchanged by a run that ended 0")
    if rc == 0 and now != before:
        try:
            complete(output)
        except Exception as e:
            found.append(f"{output} incomplete after exit 0: {type(e).__name__}: {e}")
    if leftovers(output):
        found.append(f"left beside the output: {leftovers(output)}")
    return found


def describe_run(run: Run) -> str:
    return f"exit {run.proc.returncode} after {run.seconds:.2f} s, signals {run.sent}; stderr:\n{run.err[-1500:]}"


def read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _model_complete(path: str) -> None:
    assert describe(path).config is not None


def _package_complete(path: str) -> None:
    assert verify_package(path).passed


# The storm ---------------------------------------------------------------------------------------
SUITE_TRACES = os.environ.get(TRACE_CACHE_ENV)  # the suite's folder of traces (tests/conftest.py), if any


@pytest.fixture(scope="module", autouse=True)
def _every_export_traces():
    """The storm's moments and the traps fall inside torch.onnx's trace: no run here reuses one
    ($ATTNX_TRACE_CACHE, which the suite sets: tests/conftest.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(TRACE_CACHE_ENV, raising=False)
        yield


@pytest.fixture
def suite_traces(monkeypatch):
    """For a test whose signal lands after the export (the output published, a bench or matrix worker
    running): its run reuses the suite's traces, as every attnx process of the suite does; a trace (3-6 s of
    the run) is not what it checks."""
    if SUITE_TRACES:
        monkeypatch.setenv(TRACE_CACHE_ENV, SUITE_TRACES)


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """The outputs already there (seed 1), and how long an uninterrupted run takes."""
    preset = STORM[0]
    root = tmp_path_factory.mktemp("storm-originals")
    durations = {}
    for name, args in (
        ("export", ["export", "--preset", preset, "--seed", "1", "--out", "m.onnx"]),
        ("build", ["build", "--preset", preset, "--provider", "cpu", "--seed", "1", "--out", "pkg"]),
    ):
        run = Run(args, root / name)
        assert run.wait() == 0, describe_run(run)
        durations[name] = run.seconds
    return root, durations


def test_signals_at_random_moments_end_export_and_build_as_asked(originals, tmp_path):
    root, durations = originals
    preset, exports, builds = STORM
    seed = int(os.environ.get("ATTNX_STORM_SEED") or secrets.randbits(32))
    rng = random.Random(seed)
    todo = {"export": exports, "build": builds}  # signals still to deliver to a live process
    failures, counts, runs = [], {}, 0
    while any(todo.values()) and runs < 3 * (exports + builds):
        command = rng.choice(sorted(c for c, n in todo.items() if n))
        where = tmp_path / f"run{runs}"
        os.makedirs(where)
        if command == "export":
            shutil.copyfile(root / "export" / "m.onnx", where / "m.onnx")
            output, args, complete = str(where / "m.onnx"), ["export", "--preset", preset, "--out", "m.onnx"], \
                _model_complete  # fmt: skip
        else:
            shutil.copytree(root / "build" / "pkg", where / "pkg")
            output, complete = str(where / "pkg"), _package_complete
            args = ["build", "--preset", preset, "--provider", "cpu", "--force", "--out", "pkg"]
        before = snapshot(output)
        first = rng.choice([signal.SIGINT, signal.SIGTERM])
        share = rng.random()  # of the run from attnx's handlers in place to 10% past its uninterrupted end
        second = rng.choice([None, None, signal.SIGINT, signal.SIGTERM])  # a third of the runs: two signals
        run = Run(args, where)
        ready = run.handlers_in_place()
        moment = ready + share * max(0.0, 1.1 * durations[command] - ready)
        run.at(moment, first)
        if second is not None:
            run.at(moment + rng.uniform(0.0, 0.05), second)
        run.wait()
        found = process_problems(run) + output_problems(run, output, before, complete)
        key = f"{command} {run.proc.returncode}"
        if run.proc.returncode == 0:  # the signal came once the output was in place, or after the end
            key += (" (output in place)" if run.reason_lines() else " (command had ended)" if run.sent
                    else " (ended before the signal)")  # fmt: skip
        counts[key] = counts.get(key, 0) + 1
        if run.sent:
            todo[command] -= 1
        elif run.proc.returncode == 0:  # a whole run: the machine's pace now, for the next moments
            durations[command] = run.seconds
        if found:
            failures.append(f"run {runs} ({command}, {describe_run(run)}): " + "; ".join(found))
        shutil.rmtree(where, ignore_errors=True)
        runs += 1
    delivered = exports + builds - sum(todo.values())
    summary = {"seed": seed, "preset": preset, "runs": runs, "signalled_runs": delivered,
               "ended_as_asked": runs - len(failures), "exits": counts, "uninterrupted_s": durations}  # fmt: skip
    if os.environ.get("ATTNX_STORM_REPORT"):
        with open(os.environ["ATTNX_STORM_REPORT"], "w", encoding="utf-8") as f:
            json.dump({**summary, "failures": failures}, f, indent=2)
    print(f"storm: {summary}")
    assert not failures, f"storm seed {seed} (ATTNX_STORM_SEED={seed} replays it): {summary}\n" + "\n".join(failures)
    assert not any(todo.values()), f"storm seed {seed}: signals left undelivered (every run ended first): {summary}"
    assert any(k.endswith((" 130", " 143")) for k in counts), f"storm seed {seed}: no run was interrupted: {counts}"


# Traps: the signal from where a raising handler goes wrong -------------------------------------
TRAP_CASES = [
    ("weakref", "running torch at the validation shapes", signal.SIGINT),
    ("del", "validating onnxruntime against torch", signal.SIGTERM),
    ("dispatch", "exporting", signal.SIGTERM),
]
if PROFILE == "long":  # each trap with each signal
    TRAP_CASES += [(k, at, signal.SIGTERM if s == signal.SIGINT else signal.SIGINT) for k, at, s in TRAP_CASES]


# The traps set after the trace (the weakref at the torch module's validation run, the __del__ at onnxruntime's) reuse
# the suite's traces, as suite_traces; the dispatcher's trap is inside the trace, and so traces.
TRAPS_AFTER_THE_TRACE = ("weakref", "del")


@pytest.mark.parametrize(("kind", "at", "sig"), TRAP_CASES, ids=[f"{k}-{s.name}" for k, _, s in TRAP_CASES])
def test_a_signal_inside_a_callback_ends_the_export_as_asked(tmp_path, monkeypatch, kind, at, sig):
    if kind in TRAPS_AFTER_THE_TRACE and SUITE_TRACES:
        monkeypatch.setenv(TRACE_CACHE_ENV, SUITE_TRACES)
    (tmp_path / "m.onnx").write_bytes(b"the model a user had there\n")
    before = snapshot(str(tmp_path / "m.onnx"))
    run = Run(["export", "--preset", "tiny", "--out", "m.onnx"], tmp_path,
              trap={"ATTNX_TRAP": kind, "ATTNX_TRAP_AT": at, "ATTNX_TRAP_SIGNAL": sig.name})  # fmt: skip
    run.sent.append((0.0, sig))  # sent by the process itself, at the trap
    run.wait(timeout=120)
    log = run.trap_log()
    assert log.startswith(f"sending {sig.name} inside"), f"the trap never fired: {describe_run(run)}"
    assert "outlived" not in log, f"the signal was swallowed: {log}\n{describe_run(run)}"
    assert run.proc.returncode == CODES[sig], describe_run(run)
    found = process_problems(run) + output_problems(run, str(tmp_path / "m.onnx"), before, _model_complete)
    assert found == [], f"{found}: {describe_run(run)}"


def test_a_signal_once_the_output_is_in_place_ends_with_0_and_keeps_it(tmp_path, suite_traces):
    """The commit: the export published its model, then the signal came (the trap sends it right
    after the rename): the command's work is done, the status says so, the model is complete."""
    (tmp_path / "m.onnx").write_bytes(b"the model a user had there\n")
    before = snapshot(str(tmp_path / "m.onnx"))
    run = Run(["export", "--preset", "tiny", "--out", "m.onnx"], tmp_path,
              trap={"ATTNX_TRAP": "published", "ATTNX_TRAP_AT": str(tmp_path / "m.onnx"), "ATTNX_TRAP_SIGNAL": "SIGTERM"})  # fmt: skip
    run.sent.append((0.0, signal.SIGTERM))
    run.wait(timeout=120)
    assert run.trap_log().startswith("sending SIGTERM just after"), describe_run(run)
    assert "outlived" not in run.trap_log(), describe_run(run)
    assert run.proc.returncode == 0, describe_run(run)
    found = process_problems(run) + output_problems(run, str(tmp_path / "m.onnx"), before, _model_complete)
    assert found == [], f"{found}: {describe_run(run)}"
    line = f"attnx export: terminated (SIGTERM) once its output was complete: {tmp_path / 'm.onnx'} kept"
    assert run.reason_lines() == [line]


def test_a_signal_while_fd_2_is_captured_still_says_why_on_stderr(tmp_path):
    """The ort-cuda runner points fd 2 at a file while ORT creates its session (to read what
    ORT logs): the line must reach the stderr the process started with. Found by the storm (2
    builds of 200 ended right, with no line)."""
    run = Run(["build", "--preset", "tiny", "--provider", "cpu", "--out", "pkg"], tmp_path,
              trap={"ATTNX_TRAP": "captured", "ATTNX_TRAP_AT": "parity: ort-cuda", "ATTNX_TRAP_SIGNAL": "SIGINT"})  # fmt: skip
    run.sent.append((0.0, signal.SIGINT))
    run.wait(timeout=120)
    assert run.trap_log().startswith("sending SIGINT inside capture_native_stderr"), describe_run(run)
    assert run.proc.returncode == 130, describe_run(run)
    found = process_problems(run) + output_problems(run, str(tmp_path / "pkg"), None, _package_complete)
    assert found == [], f"{found}: {describe_run(run)}"


# Children: the workers end with the command -----------------------------------------------------
def _children_of(run: Run) -> list[int]:
    return [pid for pid in run.alive() if pid != run.proc.pid]


def _wait_for(what, timeout: float, run: Run) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert run.proc.poll() is None, (
            f"ended before the moment the test waits for: {run.wait() and describe_run(run)}"
        )
        assert time.monotonic() < deadline, "the moment never came"
        time.sleep(0.05)


def test_an_interrupted_bench_leaves_no_worker_and_keeps_what_it_measured(tmp_path, suite_traces):
    # Each case's worker times 4000 calls at seq 1024: seconds, so one is running when the signal comes.
    run = Run(["bench", "--preset", "tiny", "--backends", "ort-cpu", "--attention", "decomposed", "--seq", "1024,2048",
               "--threads", "1", "--repeat", "4000", "--warmup", "1", "--json", "b.json"], tmp_path)  # fmt: skip
    path = str(tmp_path / "b.json")

    def a_case_worker_runs() -> bool:  # the GEMM is in the JSON, and a case's worker has run a while
        if not (os.path.exists(path) and read_json(path)["gemm"]):
            return False
        workers = _children_of(run)
        time.sleep(0.3)
        return bool(workers) and set(workers) <= set(_children_of(run))

    _wait_for(a_case_worker_runs, 120, run)
    workers = _children_of(run)
    run.send(signal.SIGTERM)
    run.wait(timeout=60)
    assert workers and run.proc.returncode == 143, describe_run(run)
    assert process_problems(run) == [] and leftovers(path) == [], describe_run(run)
    data = read_json(path)
    assert data["interrupted"] is True and data["complete"] is False and data["gemm"][0]["status"] == "ok"
    line = f"attnx bench: terminated (SIGTERM): kept {len(data['cases'])} measured cases in b.json"
    assert run.reason_lines() == [f"{line}; nothing half-written was left"]
    assert not any(p in tagged(run.tag) for p in workers)


def test_an_interrupted_matrix_leaves_no_case_process_and_keeps_the_finished_cases(tmp_path, suite_traces):
    plan = {"presets": ["tiny"], "backends": ["ort-cpu"], "lowerings": ["decomposed"], "batches": [1],
            "seqs": [1, 2, 3, 4, 5, 6, 7, 8], "jobs": ["parity"]}  # fmt: skip
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    run = Run(["matrix", "plan.json", "--out", "m", "--jobs", "1"], tmp_path)
    report = str(tmp_path / "m" / "report.json")

    def a_case_finished_and_another_runs() -> bool:
        return os.path.exists(report) and len(read_json(report)["cases"]) >= 1 and bool(_children_of(run))

    _wait_for(a_case_finished_and_another_runs, 180, run)
    run.send(signal.SIGINT)
    run.wait(timeout=60)
    assert run.proc.returncode == 130, describe_run(run)
    assert process_problems(run) == [] and leftovers(report) == [], describe_run(run)
    data = read_json(report)
    assert data["interrupted"] and not data["complete"] and 1 <= len(data["cases"]) < len(plan["seqs"])
    assert all(c["status"] == "pass" for c in data["cases"])
    line = f"attnx matrix: interrupted: kept {len(data['cases'])} finished cases in {report} (--resume continues)"
    assert run.reason_lines() == [f"{line}; nothing half-written was left"]
    assert not [n for n in os.listdir(tmp_path / "m") if ".partial-" in n or n.endswith(".lock")]


# A library caller ---------------------------------------------------------------------------------
def test_a_program_that_calls_main_keeps_its_own_signal_handling(tmp_path):
    """main(argv) runs a command inside its caller: no watcher, no handler, no scratch folder;
    Ctrl-C stays the caller's KeyboardInterrupt (the same with-blocks unwind it)."""
    import tempfile
    import threading

    from attnx.cli import main

    handlers = {sig: signal.getsignal(sig) for sig in CODES}
    streams, tempdir = (sys.stdout, sys.stderr), tempfile.tempdir
    assert main(["inspect", str(tmp_path / "missing.onnx")]) == 2
    assert {sig: signal.getsignal(sig) for sig in CODES} == handlers
    assert (sys.stdout, sys.stderr) == streams and tempfile.tempdir == tempdir
    assert "attnx-signals" not in [t.name for t in threading.enumerate()]
