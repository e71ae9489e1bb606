"""Stopped commands: Ctrl-C and SIGTERM at named points of export and build leave the output
untouched and nothing beside it (at random moments and inside callbacks: test_signals.py);
SIGKILL leaves a stage that the next build removes; a second writer of the same output is
refused at once. Real processes, real signals."""

from __future__ import annotations

import os
import signal
import time

import pytest

from attnx._io import output_lock
from attnx.runtimes.package import verify_package
from tests.faults.conftest import PROFILE, SENTINEL, Outcome, assert_contract, leftovers, run_process, snapshot

# the slow tier: commands killed and stopped as processes
pytestmark = pytest.mark.slow

EXPORT = ["export", "--preset", "tiny", "--attention", "ort-fused", "--out", "m.onnx"]
BUILD = ["build", "--preset", "tiny", "--provider", "cpu", "--out", "pkg"]


def _stop_at(args: list[str], cwd, point: str, sig: int, delay: float = 0.0, timeout: float = 240) -> Outcome:
    """Run attnx, send `sig` `delay` seconds after a progress line containing `point` shows,
    collect the outcome."""
    proc = run_process(args, cwd)
    lines = []
    deadline = time.monotonic() + timeout
    sent = False
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if not sent and point in line:
            time.sleep(delay)
            proc.send_signal(sig)
            sent = True
    out, rest = proc.communicate(timeout=timeout)
    assert sent, f"never reached {point!r}: {''.join(lines)[-2000:]}"
    return Outcome(proc.returncode, out, "".join(lines) + rest)


def _complete(path: str) -> None:
    if path.endswith(".onnx"):
        from attnx.model import describe

        assert describe(path).config is not None
    else:
        assert verify_package(path).passed


# Each point once, the signals taking turns (ATTNX_FAULTS=long: both at each). Inside torch.export
# and at random moments: tests/faults/test_signals.py.
POINTS = [(EXPORT, "running torch", 0.0, signal.SIGINT),  # while torch imports
          (EXPORT, "writing the", 0.0, signal.SIGTERM), (EXPORT, "validating onnxruntime", 0.0, signal.SIGINT),
          (BUILD, "parity: reference", 0.0, signal.SIGTERM), (BUILD, "verifying the package", 0.0, signal.SIGINT)]  # fmt: skip
if PROFILE == "long":
    POINTS += [(a, p, d, signal.SIGTERM if s == signal.SIGINT else signal.SIGINT) for a, p, d, s in POINTS]


@pytest.mark.parametrize(("args", "point", "delay", "sig"), POINTS,
                         ids=[f"{a[0]}-{p.split()[0]}-{s.name}" for a, p, _, s in POINTS])  # fmt: skip
def test_a_stopped_command_leaves_the_output_untouched(tmp_path, args, point, delay, sig):
    out = tmp_path / args[-1]
    if args is EXPORT:
        out.write_bytes(SENTINEL)  # the model a user had there before
    before = {str(out): snapshot(str(out))}
    outcome = _stop_at(args, tmp_path, point, sig, delay)
    assert_contract(outcome, before, _complete)
    if outcome.rc != 0:  # the signal came before the output was published
        assert outcome.rc == (130 if sig == signal.SIGINT else 143), outcome.err[-1500:]
        assert outcome.reason_lines()[0].startswith(f"attnx {args[0]}: ")


def test_a_killed_build_leaves_a_stage_the_next_build_removes(tmp_path):
    outcome_proc = run_process(BUILD, tmp_path)
    for line in outcome_proc.stderr:
        if "parity: reference" in line:
            outcome_proc.send_signal(signal.SIGKILL)
            break
    outcome_proc.communicate(timeout=120)
    assert outcome_proc.returncode == -signal.SIGKILL
    stale = leftovers(str(tmp_path / "pkg"))
    assert stale and not (tmp_path / "pkg").exists()  # SIGKILL cannot clean up: its stage is there
    proc = run_process(BUILD, tmp_path)
    proc.communicate(timeout=300)
    assert proc.returncode == 0
    assert leftovers(str(tmp_path / "pkg")) == [] and verify_package(tmp_path / "pkg").passed
    assert not any(os.path.exists(tmp_path / s) for s in stale)


@pytest.mark.parametrize("args", [BUILD, EXPORT], ids=["build", "export"])
def test_a_second_writer_of_the_same_output_is_refused_at_once(tmp_path, args):
    """While one writer holds the output (here: this test, as a first build or export would), a
    second is refused before it does any work: no stage, no output, one line naming the holder."""
    out = tmp_path / args[-1]
    with output_lock(out):
        proc = run_process(args, tmp_path)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-1500:]
    (line,) = [ln for ln in err.splitlines() if ln.startswith("attnx ")]
    assert f"is being written by another attnx (pid {os.getpid()})" in line
    assert not any(ln.startswith("[") and "drawing" in ln for ln in err.splitlines())  # no work started
    assert not out.exists() and leftovers(str(out)) == []
