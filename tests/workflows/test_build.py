"""attnx build: the package it writes, reproducibility, --force, and builds that fail."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from attnx.cli import main
from attnx.errors import UsageError
from attnx.model import preset
from attnx.model.contract import IR_VERSION
from attnx.runtimes.package import MANIFEST, MANIFEST_SUM
from attnx.workflows import DEFAULT_ATTENTION, LARGE_MODEL_BYTES, build_package, check_plan, write_npz
from attnx.workflows import _build as package_mod
from tests.conftest import CONFIGS, weights_for


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def tiny_pkg(tmp_path_factory):
    out = tmp_path_factory.mktemp("build") / "pkg"
    assert main(["build", "--preset", "tiny", "--out", str(out)]) == 0
    return out


def test_build_writes_a_complete_manifest(tiny_pkg, capsys):
    m = json.loads((tiny_pkg / MANIFEST).read_text())
    assert m["format"] == "attnx-package" and m["format_version"] == 1
    assert m["config"] == preset("tiny").to_dict() and m["dtype"] == "fp32" and m["attention"] == DEFAULT_ATTENTION
    assert m["inputs"] == [{"name": "x", "dtype": "fp32", "shape": ["batch", "seq", 64]}]
    assert m["outputs"] == [{"name": "y", "dtype": "fp32", "shape": ["batch", "seq", 64]}]
    (model,) = m["models"]
    assert model["file"] == "model.onnx" and model["external_data"] == [] and model["lowering"] == "ort-fused"
    assert model["ir_version"] == IR_VERSION and model["opsets"]["ai.onnx"] == 18 and "com.microsoft" in model["opsets"]
    assert set(m["versions"]) >= {"attnx", "torch", "onnx", "onnxruntime"}
    # every file but the manifest and its checksum, with its true size and sha256
    listed = set(os.listdir(tiny_pkg)) - {MANIFEST, MANIFEST_SUM}
    assert set(m["files"]) == listed
    for name, entry in m["files"].items():
        assert entry == {"size": os.path.getsize(tiny_pkg / name), "sha256": sha256(tiny_pkg / name)}
    assert (tiny_pkg / MANIFEST_SUM).read_text() == f"{sha256(tiny_pkg / MANIFEST)}  {MANIFEST}\n"
    assert m["providers"] == ["cpu", "cuda"] and "cpu" in m["verified_on"]
    assert set(m["verified_on"]) | set(m["not_verified"]) == {"cpu", "cuda"}
    assert [(g["batch"], g["seq"]) for g in m["golden"]] == [(1, 1), (2, 7), (3, 33)]
    assert m["weights"]["source"] == "seed 0" and len(m["weights"]["sha256"]) == 64


def test_parity_report_in_the_package(tiny_pkg):
    m = json.loads((tiny_pkg / MANIFEST).read_text())
    report = json.loads((tiny_pkg / "parity.json").read_text())
    assert report["passed"] and m["parity"]["passed"]
    keys = {"backend", "reference", "dtype", "batch", "seq", "mem_seq", "status", "reason", "max_abs", "max_rel",
            "atol", "rtol"}  # fmt: skip
    assert all(keys <= set(c) for c in report["cases"])
    by_backend = {}
    for c in report["cases"]:
        by_backend.setdefault(c["backend"], set()).add(c["status"])
    assert by_backend["reference"] == by_backend["torch"] == by_backend["ort-cpu"] == {"pass"}
    assert "ort-cuda" in by_backend and "torch-cuda" in by_backend  # ran, or skipped with a reason
    assert {(c["batch"], c["seq"]) for c in report["cases"]} == {(b, s) for b in (1, 3) for s in (1, 7, 128)}
    md = (tiny_pkg / "parity.md").read_text()
    assert md.startswith("# Parity: PASSED") and "| ort-cpu | reference | 6 | 6 | 0 | 0 |" in md


def test_two_builds_are_byte_identical(tiny_pkg, tmp_path):
    """The second build also replaces an existing package (force)."""
    out = tmp_path / "again"
    shutil.copytree(tiny_pkg, out)
    (out / "golden-0.npz").write_bytes(b"stale")
    build_package(preset("tiny"), out, force=True)
    first = json.loads((tiny_pkg / MANIFEST).read_text())["files"]
    second = json.loads((out / MANIFEST).read_text())["files"]
    assert second["model.onnx"]["sha256"] == first["model.onnx"]["sha256"] == sha256(out / "model.onnx")
    for name in ("golden-0.npz", "golden-1.npz", "golden-2.npz"):
        assert second[name] == first[name]
    assert sorted(os.listdir(tmp_path)) == ["again"]  # no partial or old folder left beside it


def test_cuda_only_package(tmp_path, capsys):
    """Built where CUDA may be missing: the model still runs its golden cases on cpu here, and
    the package says whether cuda was verified, or why not."""
    out = tmp_path / "pkg"
    report = build_package(CONFIGS["causal"], out, weights_for("causal"), attention="decomposed", providers=["cuda"])
    m = report.manifest
    assert m["providers"] == ["cuda"] and m["models"][0]["providers"] == ["cuda"]
    assert m["models"][0]["lowering"] == "decomposed" and list(m["models"][0]["opsets"]) == ["ai.onnx"]
    assert report.verify.passed and any(c.name == "golden-2.npz y" for c in report.verify.checks)
    cuda_here = m["verified_on"] == ["cuda"]
    assert cuda_here or "unavailable" in m["not_verified"]["cuda"]
    assert main(["verify", str(out), "--provider", "cuda"]) == (0 if cuda_here else 2)
    assert main(["verify", str(out), "--provider", "cpu"]) == 2
    assert "no model for provider 'cpu' (built for: cuda)" in capsys.readouterr().err


def test_existing_dir_needs_force(tiny_pkg, tmp_path, capsys):
    before = sha256(tiny_pkg / MANIFEST)
    assert main(["build", "--preset", "tiny", "--out", str(tiny_pkg)]) == 2
    assert "already exists (pass --force" in capsys.readouterr().err
    assert sha256(tiny_pkg / MANIFEST) == before
    other = tmp_path / "home"
    other.mkdir()
    (other / "notes.txt").write_text("precious")
    assert main(["build", "--preset", "tiny", "--force", "--out", str(other)]) == 2
    assert "not an attnx package" in capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "precious"


def test_bad_usage_exits_2(tmp_path, capsys):
    assert main(["build", "--preset", "tiny", "--provider", "tpu", "--out", str(tmp_path / "p")]) == 2
    assert "unknown --provider 'tpu'" in capsys.readouterr().err
    assert main(["build", "--preset", "tiny", "--out", str(tmp_path / "no" / "p")]) == 2
    assert not os.path.exists(tmp_path / "p")


def test_parity_failure_writes_no_package(tmp_path, monkeypatch, capsys):
    import attnx.runtimes.reference_runner as reference_runner

    true_reference = reference_runner.reference_attention

    def off_by_1e3(*args, **kwargs):
        return true_reference(*args, **kwargs) + 1e-3

    monkeypatch.setattr(reference_runner, "reference_attention", off_by_1e3)
    config = tmp_path / "c.json"
    config.write_text(CONFIGS["self"].to_json())
    assert main(["build", "--config", str(config), "--out", str(tmp_path / "pkg")]) == 1
    err = capsys.readouterr().err
    assert "parity failed" in err and "no package written" in err
    assert sorted(os.listdir(tmp_path)) == ["c.json"]  # neither the package nor a partial folder


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    def fake_export(config, out, *args, **kwargs):
        with open(out, "wb") as f:
            f.write(b"half a model")
        raise KeyboardInterrupt

    monkeypatch.setattr(package_mod, "export_model", fake_export)
    with pytest.raises(KeyboardInterrupt):
        build_package(CONFIGS["self"], tmp_path / "pkg", weights_for("self"))
    assert os.listdir(tmp_path) == []


def test_weights_that_do_not_fit_the_config_are_refused(tmp_path):
    with pytest.raises(UsageError, match="q_proj.weight"):
        build_package(CONFIGS["self"], tmp_path / "pkg", weights_for("kpm") | {"q_proj.weight": np.zeros((3, 3))})
    assert os.listdir(tmp_path) == []


def test_large_models_are_checked_at_smaller_shapes():
    gpt3 = preset("gpt3")
    assert 4 * gpt3.n_params > LARGE_MODEL_BYTES >= 4 * preset("large").n_params
    plan = check_plan(gpt3)
    seqs = [s for _, s, _ in plan.validation_shapes]
    assert 1 in seqs and max(seqs) > 1000  # the export still runs at seq 1 and past 1000
    assert max(plan.parity_seqs) <= 8 and max(plan.parity_batches) <= 2 and not plan.check_reference
    assert max(s for _, s, _ in plan.golden_shapes) <= 8
    assert check_plan(preset("large")).check_reference


def test_write_npz_is_reproducible_and_pickle_free(tmp_path):
    arrays = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "k": np.array([True, False])}
    write_npz(tmp_path / "a.npz", arrays)
    write_npz(tmp_path / "b.npz", arrays)
    assert sha256(tmp_path / "a.npz") == sha256(tmp_path / "b.npz")
    with np.load(tmp_path / "a.npz", allow_pickle=False) as npz:
        assert npz.files == ["x", "k"]
        np.testing.assert_array_equal(npz["x"], arrays["x"])
    with pytest.raises(ValueError):
        write_npz(tmp_path / "c.npz", {"o": np.array([object()], dtype=object)})


def test_a_build_whose_parity_fails_says_where(tmp_path, monkeypatch):
    # ONNX Runtime made to compute a wrong output projection (y + 0.1): the build writes nothing, and
    # its message carries the localisation of a failing case (docs/concepts/localisation.md).
    from attnx.errors import CheckFailed
    from attnx.runtimes import create_runner

    def wrong(name, source, **options):
        runner = create_runner(name, source, **options)
        if name == "ort-cpu":
            run = runner.run_impl
            runner.run_impl = lambda feeds: {k: v + 0.1 if k == "y" else v for k, v in run(feeds).items()}
        return runner

    monkeypatch.setattr(package_mod, "create_runner", wrong)
    with pytest.raises(CheckFailed, match=r"parity failed in .* \(ort-cpu: localised: first stage beyond its bound: y"):
        build_package(CONFIGS["self"], tmp_path / "pkg", weights_for("self"), providers=["cpu"])
    assert not (tmp_path / "pkg").exists()
