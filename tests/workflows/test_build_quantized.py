"""Packages of the quantized forms (issue 12): the manifest records the quantization and each
golden case's error-model inputs; verify holds the golden outputs to that dtype's tolerance."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from attnx.export import export_onnx, save_model
from attnx.model.contract import describe
from attnx.runtimes.package import MANIFEST, MANIFEST_SUM, verify_package
from attnx.workflows import build_package, optimize_file, write_npz
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
    result = optimize_file(src, tmp_path / "q.onnx", attention="auto", dtype="int8", auto_shape=(1, 64, 64))
    assert result.passed and describe(tmp_path / "q.onnx").dtype == "int8"
    assert result.lowering.auto.status["ort-attention"].startswith("not applicable")
    assert all(result.lowering.auto.status[name] == "pass" for name in ("ort-fused", "ort-fused-packed"))
