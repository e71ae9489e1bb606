"""Packages of the quantized forms (issue 12): the manifest records the quantization and each
golden case's error-model inputs; verify holds the golden outputs to that dtype's tolerance. A package of
8-bit int8 weights is refused on a host without VNNI (issue 39)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import onnx
import pytest

import attnx
from attnx.cli import main
from attnx.errors import ModelFileError
from attnx.export import export_onnx, save_model
from attnx.model.contract import INT8_BITS_KEY, describe
from attnx.runtimes.package import MANIFEST, MANIFEST_SUM, verify_package
from attnx.workflows import build_package, optimize_model, write_npz
from attnx.workflows._package_files import MODEL_FILE
from tests.conftest import CONFIGS, weights_for


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_quantized_package_records_its_error_model_and_verifies(tmp_path, dtype):
    out = tmp_path / "pkg"
    build_package(CONFIGS["kpm"], out, weights_for("kpm"), dtype=dtype, providers=["cpu"], block_size=16)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["dtype"] == dtype
    q = manifest["quantization"]
    assert q["dtype"] == dtype and set(q["projections"]) == {"q", "k", "v", "out"}
    assert q["block_size"] == (16 if dtype == "int4" else None)
    for case in manifest["golden"]:  # what the tolerance is sized from, beside the case
        size = case["problem_size"]
        assert size["score_rms"] > 0 and set(size["activations"]) == {"x", "z"}
    report = verify_package(out)
    assert report.passed, [str(c) for c in report.checks if not c.passed]

    # A golden output moved by 20% of its RMS (2 sigma of int4's own error, 13 of int8's), with the
    # hashes rewritten to match, fails its comparison: the tolerance is the error model's.
    golden = out / manifest["golden"][0]["file"]
    with np.load(golden) as npz:
        arrays = {k: npz[k] for k in npz.files}
    y = arrays["y"]
    arrays["y"] = y + 0.2 * np.sqrt(np.mean(y * y)) * np.sign(np.random.default_rng(0).standard_normal(y.shape))
    write_npz(golden, arrays)
    manifest["files"][golden.name] = {"size": golden.stat().st_size, "sha256": _sha256(golden.read_bytes())}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    (out / MANIFEST_SUM).write_text(f"{_sha256((out / MANIFEST).read_bytes())}  {MANIFEST}\n")
    checks = {c.name: c for c in verify_package(out).checks}
    moved = checks[f"{golden.name} y"]
    assert not moved.passed and "rel_rms" in moved.detail
    assert all(c.passed for name, c in checks.items() if name.startswith("golden-") and name.endswith(" y")
               and name != moved.name)  # fmt: skip


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_optimize_quantizes_and_auto_times_the_forms_that_quantize(tmp_path):
    config = CONFIGS["causal_kpm"]
    src = str(tmp_path / "m.onnx")
    save_model(export_onnx(config, weights_for("causal_kpm")), src)
    report = optimize_model(src, str(tmp_path / "q.onnx"), lowering="measure", dtype="int8", auto_seq=64)
    assert report.passed and describe(tmp_path / "q.onnx").dtype == "int8"
    times = report.blocks[0].choice.times  # each lowering measured: its time, or why it was not timed
    assert times["ort-attention"].error.startswith("not applicable")
    assert all(times[name].error is None and times[name].prefill_ms > 0 for name in ("ort-fused", "ort-fused-packed"))


@pytest.fixture(scope="module")
def int8_package(tmp_path_factory):
    """An int8 package built with 7-bit weights (it runs on every host); int8_package(bits) is a copy whose
    model records `bits` (its hashes rewritten to match): what a build on a host with VNNI writes, as far as
    the check of the host reads it."""
    root = tmp_path_factory.mktemp("int8-pkg")
    build_package(CONFIGS["kpm"], root / "pkg", weights_for("kpm"), dtype="int8", providers=["cpu"], int8_bits=7)

    def copy(bits: str, out) -> str:
        shutil.copytree(root / "pkg", out)
        model = onnx.load(out / MODEL_FILE)
        entry = next(p for p in model.metadata_props if p.key == INT8_BITS_KEY)
        entry.value = bits
        onnx.save(model, out / MODEL_FILE)
        manifest = json.loads((out / MANIFEST).read_text())
        data = (out / MODEL_FILE).read_bytes()
        manifest["files"][MODEL_FILE] = {"size": len(data), "sha256": _sha256(data)}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        (out / MANIFEST_SUM).write_text(f"{_sha256((out / MANIFEST).read_bytes())}  {MANIFEST}\n")
        return str(out)

    return copy


def test_an_8_bit_package_is_refused_on_a_host_without_vnni(int8_package, cpu_host, tmp_path, capsys):
    """verify fails (exit 1: a check failed on this host), load and run refuse the model (exit 2), each
    with the one reason and the flag that builds the safe form; the same package verifies with VNNI."""
    pkg = int8_package("8", tmp_path / "pkg8")
    cpu_host(vnni=False)
    report = verify_package(pkg)
    failed = report.failures()
    assert [c.name for c in failed] == ["onnxruntime"] and "--int8-bits 7" in failed[0].detail
    assert main(["verify", pkg]) == 1
    out = capsys.readouterr().out
    assert "verify FAILED (cpu): onnxruntime:" in out and "8-bit int8 weights" in out and "without VNNI" in out
    with pytest.raises(ModelFileError, match=r"8-bit int8 weights .* build the model with --int8-bits 7"):
        attnx.load(pkg)
    np.save(tmp_path / "x.npy", np.ones((1, 3, CONFIGS["kpm"].d_model), np.float32))
    for target in (pkg, os.path.join(pkg, MODEL_FILE)):  # a package, and its model file alone
        assert main(["run", target, "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npy")]) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("[")]
        assert len(err) == 1 and err[0].startswith("attnx run: error: ") and "--int8-bits 7" in err[0], err
    assert main(["parity", "--model", os.path.join(pkg, MODEL_FILE), "--backends", "ort-cpu", "--seq", "3"]) == 2
    assert "--int8-bits 7" in capsys.readouterr().err
    assert not (tmp_path / "y.npy").exists()
    cpu_host(vnni=True)
    assert verify_package(pkg).passed
    assert verify_package(int8_package("7", tmp_path / "pkg7")).passed  # 7 bits: every host
