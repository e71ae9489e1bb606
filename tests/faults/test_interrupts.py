"""Stopped commands: Ctrl-C and SIGTERM at several points of export and build leave the output
untouched and nothing beside it; SIGKILL leaves a stage that the next build removes; a second
writer of the same output is refused at once. Real processes, real signals."""

from __future__ import annotations

import os
import signal
import time

import pytest

from attnx._io import output_lock
from attnx.runtimes.package import verify_package
from tests.faults.conftest import SENTINEL, Outcome, assert_contract, leftovers, run_process, snapshot

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
    err = "".join(lines) + rest
    rc = proc.returncode
    if rc == -signal.SIGINT and "interrupted: nothing half-written was left" in err:
        # attnx caught the interrupt, cleaned up, printed its line and returned 130, and the
        # process still ended by SIGINT: CPython does that at exit (Py_RunMain's exit_sigint)
        # when it has counted a KeyboardInterrupt as unhandled. Seen about 1 run in 8 with the
        # signal 3 s into torch.export, never at the other points; which path sets CPython's
        # flag there is not identified. A shell reports both endings as $? = 130 (128 + SIGINT),
        # so the user sees the same status; the rest of the contract is checked as before.
        rc = 130
    return Outcome(rc, out, err)


def _complete(path: str) -> None:
    if path.endswith(".onnx"):
        from attnx.model import describe

        assert describe(path).config is not None
    else:
        assert verify_package(path).passed


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize(
    ("args", "point", "delay"),
    [(EXPORT, "exporting", 0.0), (EXPORT, "exporting", 3.0),  # while torch imports; inside torch.export
     (EXPORT, "running graph passes", 0.0), (EXPORT, "validating onnxruntime", 0.0),
     (BUILD, "parity: reference", 0.0), (BUILD, "verifying the package", 0.0)],
)  # fmt: skip
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
