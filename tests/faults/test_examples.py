"""The issue's examples, run as written: one line, the right exit code, the previous output untouched."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from attnx.model import init_weights, save_weights
from attnx.runtimes.package import verify_package
from tests.faults.conftest import SENTINEL, TINY_CONFIG, assert_contract, run_cli, snapshot


@pytest.mark.parametrize("d_model", [10**9, 50_000])
@pytest.mark.parametrize("command", ["export", "build", "parity", "bench"])
def test_a_model_the_machine_cannot_hold_is_refused_before_any_allocation(tmp_path, d_model, command):
    (tmp_path / "c.json").write_text(json.dumps({"d_model": d_model, "n_heads": 8}))
    out = {"export": ["--out", tmp_path / "m.onnx"], "build": ["--out", tmp_path / "pkg"],
           "parity": ["--seq", "2"], "bench": ["--seq", "8", "--backends", "ort-cpu"]}[command]  # fmt: skip
    outcome = run_cli([command, "--config", tmp_path / "c.json", *out])
    assert outcome.rc == 2, outcome.err[-1000:]
    (line,) = outcome.reason_lines()
    assert "not started: it needs about" in line and "GB available on this machine" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]
    # and --max-mem-gb below the estimate refuses a model that would fit
    small = run_cli([command, "--preset", "tiny", "--max-mem-gb", "0.0001", *out])
    assert small.rc == 2 and "GB allowed by --max-mem-gb" in small.reason_lines()[0]


def test_export_with_nan_weights_is_refused_and_the_previous_model_kept(tmp_path):
    from attnx.model import AttentionConfig

    config = AttentionConfig.from_json(TINY_CONFIG)
    (tmp_path / "c.json").write_text(TINY_CONFIG)
    w = init_weights(config, 0)
    w["v_proj.weight"][1, 2] = np.nan
    save_weights(w, tmp_path / "w.safetensors")
    (tmp_path / "m.onnx").write_bytes(SENTINEL)
    before = {str(tmp_path / "m.onnx"): SENTINEL}
    outcome = run_cli(["export", "--config", tmp_path / "c.json", "--weights", tmp_path / "w.safetensors", "--out",
                       tmp_path / "m.onnx"])  # fmt: skip
    assert_contract(outcome, before, complete=None)
    assert outcome.rc == 2 and "tensor 'v_proj.weight' holds 1 NaN" in outcome.reason_lines()[0]


def test_force_never_deletes_a_file_attnx_did_not_write(tmp_path):
    pkg = tmp_path / "pkg"
    assert run_cli(["build", "--preset", "tiny", "--provider", "cpu", "--out", pkg]).rc == 0
    (pkg / "my-notes.txt").write_text("mine")
    before = {str(pkg): snapshot(str(pkg))}
    outcome = run_cli(["build", "--preset", "tiny", "--provider", "cpu", "--out", pkg, "--force"])
    assert_contract(outcome, before, complete=None)
    assert outcome.rc == 2 and "holds 1 file(s) its manifest does not list (my-notes.txt)" in outcome.reason_lines()[0]
    (pkg / "my-notes.txt").unlink()
    assert run_cli(["build", "--preset", "tiny", "--provider", "cpu", "--seed", "4", "--out", pkg, "--force"]).rc == 0
    assert json.loads((pkg / "manifest.json").read_text())["weights"]["source"] == "seed 4"


def test_verify_holds_the_manifest_to_what_the_model_says(tmp_path, assets):
    pkg = tmp_path / "pkg"
    shutil.copytree(assets["package"], pkg)
    manifest = json.loads((pkg / "manifest.json").read_text())
    manifest["config"]["scale"] = 0.5  # the model's own metadata says null; every hash still matches
    (pkg / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    digest = hashlib.sha256((pkg / "manifest.json").read_bytes()).hexdigest()
    (pkg / "manifest.sha256").write_text(f"{digest}  manifest.json\n")
    report = verify_package(pkg)
    assert not report.passed
    (failed,) = report.failures()
    assert failed.name == "model.onnx description"
    assert 'says config {"scale": 0.5}, the model itself {"scale": null}' in failed.detail
    outcome = run_cli(["verify", pkg])
    assert outcome.rc == 1 and "verify FAILED" in outcome.out


def test_run_says_when_its_input_is_not_finite(tmp_path, assets):
    x = np.load(assets["npy"])
    x[0, 1, 2] = np.inf
    np.save(tmp_path / "x.npy", x)
    outcome = run_cli(["run", assets["model"], "--input", tmp_path / "x.npy", "--key-padding-mask", assets["mask"],
                       "--output", tmp_path / "y.npy"])  # fmt: skip
    assert outcome.rc == 0
    assert "input 'x' holds 1 NaN or infinite value(s)" in outcome.err and "output 'y' holds" in outcome.err
    assert not np.isfinite(np.load(tmp_path / "y.npy")).all()


def test_a_closed_pipe_is_one_line(assets):
    """attnx inspect pkg | head -1"""
    proc = subprocess.Popen([sys.executable, "-m", "attnx.cli", "inspect", str(assets["package"])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    proc.stdout.close()  # the reader is gone before attnx writes (head -1 after its line)
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert proc.returncode == 1 and "Traceback" not in err and "Exception ignored" not in err, err
    (line,) = [ln for ln in err.splitlines() if ln.strip()]
    assert line == "attnx inspect: error: its output was closed before it was all written (broken pipe)"
