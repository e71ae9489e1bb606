"""attnx verify localises a failing golden case (issue 23): the failing check carries where it
diverges, the text says it in one "localised:" line, the JSON report holds it, and the verdict and
exit code are what they were without it. The fault: a weight changed in the model file after the
build, the manifest rehashed as a forger would, so that only the golden comparison can catch it."""

from __future__ import annotations

import hashlib
import json
import shutil

import onnx
import pytest
from onnx import numpy_helper

from attnx.cli import main
from attnx.model import AttentionConfig, init_weights
from attnx.runtimes import package as package_module
from attnx.runtimes.package import MANIFEST, MANIFEST_SUM, verify_package
from attnx.workflows import build_package

STEP = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, causal=True, kv_cache=True, key_padding_mask=True)
FULL = AttentionConfig(d_model=32, n_heads=4, causal=True, key_padding_mask=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify-localise")
    build_package(STEP, root / "step", providers=["cpu"], seed=3)  # seeded: verify recomputes the weights
    build_package(FULL, root / "full", providers=["cpu"], seed=5)
    build_package(FULL, root / "arrays", init_weights(FULL, 5), providers=["cpu"])  # no seed to recompute
    return root


def altered(built, tmp_path, name: str, initializer: str):
    """A copy of package `name` whose model file has `initializer` moved by 0.1 in its first entry,
    every hash made to agree."""
    pkg = tmp_path / name
    shutil.copytree(built / name, pkg)
    proto = onnx.load(str(pkg / "model.onnx"))
    tensor = next(t for t in proto.graph.initializer if t.name == initializer)
    array = numpy_helper.to_array(tensor).copy()
    array.flat[0] += 0.1
    tensor.CopyFrom(numpy_helper.from_array(array, initializer))
    onnx.save(proto, str(pkg / "model.onnx"))
    manifest = json.loads((pkg / MANIFEST).read_text())
    for file in manifest["files"]:
        data = (pkg / file).read_bytes()
        manifest["files"][file] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    text = json.dumps(manifest, indent=2, sort_keys=True).encode()
    (pkg / MANIFEST).write_bytes(text)
    (pkg / MANIFEST_SUM).write_text(f"{hashlib.sha256(text).hexdigest()}  {MANIFEST}\n")
    return pkg


def test_a_decode_package_with_a_changed_output_bias_is_localised(built, tmp_path, capsys):
    pkg = altered(built, tmp_path, "step", "out_proj.bias")
    assert main(["verify", str(pkg), "--json", str(tmp_path / "v.json")]) == 1
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("  localised:")]
    assert len(lines) == 1, out
    assert "y at step 0 (position 0, y first)" in lines[0] and "out_proj.bias differ" in lines[0]
    report = json.loads((tmp_path / "v.json").read_text())
    failing = [c for c in report["checks"] if not c["passed"]]
    assert [c["name"] for c in failing] == ["golden-decode-0.npz y"]  # the cache is right: only y
    loc = failing[0]["localisation"]
    assert (loc["step"], loc["position"], loc["output"], loc["stage"]) == (0, 0, "y", "y")
    assert loc["line"] == lines[0].strip()


def test_a_decode_package_with_a_changed_key_projection_fails_first_in_its_cache(built, tmp_path):
    pkg = altered(built, tmp_path, "step", "k_proj.weight.T")
    report = verify_package(pkg)
    loc = next(c.localisation for c in report.checks if c.localisation)
    assert not report.passed and (loc["step"], loc["position"], loc["output"]) == (0, 0, "present_key")
    assert "k_proj.weight differ" in loc["cause"]


def test_a_full_sequence_package_names_the_stage(built, tmp_path, capsys):
    pkg = altered(built, tmp_path, "full", "out_proj.bias")
    assert main(["verify", str(pkg)]) == 1
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("  localised:")]
    assert len(lines) == 3, out  # each golden case fails, each is localised once
    assert all(ln.startswith("  localised: first stage beyond its bound: y,") for ln in lines), lines
    assert all("fails with ONNX Runtime's graph optimizations off too (not the optimizer)" in ln for ln in lines)


def test_without_a_seed_the_model_files_own_weights_are_the_reference(built, tmp_path, capsys):
    """Built from arrays (no seed), ort-fused (MultiHeadAttention's biases packed in qkv_proj.bias, split
    back by their names): the reference's stages take the model file's own weights, which then agree
    with the model; the weights' sha256 against the manifest's names the cause, once per failing case."""
    pkg = altered(built, tmp_path, "arrays", "out_proj.bias")
    assert main(["verify", str(pkg)]) == 1
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "localised:" in ln]
    assert len(lines) == 3, lines
    assert all(ln.startswith("  localised: no stage beyond its bound") for ln in lines), lines
    assert all("weights are not those the package was built with" in ln for ln in lines), lines
    assert all("the model file's own weights" in ln for ln in lines), lines


def test_a_localisation_that_fails_changes_nothing(built, tmp_path, monkeypatch, capsys):
    pkg = altered(built, tmp_path, "step", "out_proj.bias")
    before = verify_package(pkg)

    def broken(*args, **kwargs):
        raise RuntimeError("cannot localise")

    monkeypatch.setattr(package_module, "_localise_golden", broken)
    after = verify_package(pkg)
    assert [(c.name, c.passed, c.detail) for c in after.checks] == [(c.name, c.passed, c.detail) for c in before.checks]
    loc = next(c.localisation for c in after.checks if c.localisation)
    assert loc == {"error": "RuntimeError: cannot localise", "line": "not localised: RuntimeError: cannot localise"}
    assert main(["verify", str(pkg)]) == 1
    assert "  not localised: RuntimeError: cannot localise" in capsys.readouterr().out.splitlines()


def test_a_passing_package_is_not_localised(built, capsys):
    assert main(["verify", str(built / "step")]) == 0
    assert "localised" not in capsys.readouterr().out
