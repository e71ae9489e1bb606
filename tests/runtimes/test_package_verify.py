"""Packages on the deployment side: verify, load, run, inspect; damaged and hostile packages.

One package is built for the whole module (cross-attention with a key padding mask, so the
golden cases feed three inputs, and with external data forced on, so model.onnx.data is
there to damage and to point elsewhere). Each test works on its own copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest

from attnx.cli import main
from attnx.errors import CheckFailed, PackageError
from attnx.runtimes.package import MANIFEST, MANIFEST_SUM, describe_package, load, verify_package
from attnx.workflows import build_package
from tests.conftest import CONFIGS, weights_for

CONFIG = CONFIGS["cross_kpm"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    import attnx.export._export as export_impl

    root = tmp_path_factory.mktemp("pkg")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export_impl, "EXTERNAL_DATA_THRESHOLD", 0)  # every initializer in model.onnx.data
        report = build_package(CONFIG, root / "pkg", weights_for("cross_kpm"), providers=["cpu"])
    assert report.verify.passed
    return root / "pkg"


@pytest.fixture
def pkg(built, tmp_path):
    """A fresh copy of the built package, in a folder of its own (with room beside it)."""
    dst = tmp_path / "work" / "pkg"
    shutil.copytree(built, dst)
    return dst


def rehash(pkg) -> None:
    """Make the manifest agree with the files as they are now, as a forger would."""
    manifest = json.loads((pkg / MANIFEST).read_text())
    for name in manifest["files"]:
        path = pkg / name
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    write_manifest(pkg, manifest)


def write_manifest(pkg, manifest: dict) -> None:
    data = json.dumps(manifest, indent=2, sort_keys=True).encode()
    (pkg / MANIFEST).write_bytes(data)
    (pkg / MANIFEST_SUM).write_text(f"{hashlib.sha256(data).hexdigest()}  {MANIFEST}\n")


def flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# The package as built ------------------------------------------------------------------
def test_built_package_has_external_data_and_verifies(built, capsys):
    names = sorted(os.listdir(built))
    assert names == sorted([MANIFEST, MANIFEST_SUM, "model.onnx", "model.onnx.data", "golden-0.npz", "golden-1.npz",
                            "golden-2.npz", "parity.json", "parity.md"])  # fmt: skip
    manifest = json.loads((built / MANIFEST).read_text())
    assert manifest["models"][0]["external_data"] == ["model.onnx.data"]
    assert [i["name"] for i in manifest["inputs"]] == ["x", "memory", "key_padding_mask"]
    assert manifest["inputs"][2] == {"name": "key_padding_mask", "dtype": "bool", "shape": ["batch", "mem_seq"]}
    assert manifest["verified_on"] == ["cpu"] and manifest["parity"]["passed"]
    assert main(["verify", str(built)]) == 0
    out = capsys.readouterr().out
    assert "verify PASSED (cpu)" in out and "golden-1.npz y" in out and "model.onnx.data" in out


def test_golden_outputs_are_the_reference_in_float64(built):
    from attnx.model import reference_attention

    with np.load(built / "golden-1.npz", allow_pickle=False) as npz:
        feeds = {k: npz[k] for k in ("x", "memory", "key_padding_mask")}
        y = npz["y"]
    assert y.dtype == np.float64 and feeds["x"].dtype == np.float32
    assert feeds["key_padding_mask"][1].all()  # the fully masked row is among the golden cases
    np.testing.assert_array_equal(y, reference_attention(CONFIG, weights_for("cross_kpm"), **feeds))


def test_verify_json_lists_every_check(built, tmp_path):
    out = tmp_path / "v.json"
    assert main(["verify", str(built), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    names = [c["name"] for c in data["checks"]]
    assert data["passed"] and names[0] == MANIFEST and "onnxruntime" in names
    assert {f"golden-{i}.npz y" for i in range(3)} <= set(names)


# Damage: every file, one byte -------------------------------------------------------------
def test_one_changed_byte_in_any_file_fails_naming_it(built, tmp_path, capsys):
    for name in sorted(os.listdir(built)):
        copy = tmp_path / name / "pkg"
        shutil.copytree(built, copy)
        flip_byte(copy / name)
        capsys.readouterr()
        assert main(["verify", str(copy)]) == 1, name
        out = capsys.readouterr().out
        failed = out.split("verify FAILED", 1)[1]
        assert name in failed, (name, out)


def test_truncated_data_file_is_named(pkg, capsys):
    with open(pkg / "model.onnx.data", "r+b") as f:
        f.truncate(100)
    assert main(["verify", str(pkg)]) == 1
    assert "model.onnx.data: 100 bytes, expected" in capsys.readouterr().out


def test_missing_file_is_named(pkg, capsys):
    os.remove(pkg / "golden-2.npz")
    assert main(["verify", str(pkg)]) == 1
    assert "golden-2.npz: missing" in capsys.readouterr().out


def test_wrong_golden_output_fails_by_how_much(pkg, capsys):
    with np.load(pkg / "golden-1.npz", allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["y"][0, 0, 0] += 1e-3
    from attnx.workflows import write_npz

    write_npz(pkg / "golden-1.npz", arrays)
    rehash(pkg)  # hashes consistent: only the numbers can catch it
    assert main(["verify", str(pkg)]) == 1
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("golden-1.npz y"))
    assert "FAIL" in line and "max_abs=0.001" in line and "would need atol>=" in line


def test_load_refuses_a_damaged_package(pkg):
    flip_byte(pkg / "model.onnx.data")
    with pytest.raises(CheckFailed, match="model.onnx.data"):
        load(pkg)


# Not a package -------------------------------------------------------------------------
def test_not_a_package_exits_2(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 2
    assert "has no manifest.json" in capsys.readouterr().err
    (tmp_path / "f").write_text("x")
    assert main(["verify", str(tmp_path / "f")]) == 2
    assert main(["verify", str(tmp_path / "nope")]) == 2


def test_manifest_of_another_format_exits_2(pkg, capsys):
    manifest = json.loads((pkg / MANIFEST).read_text())
    manifest["format"] = "something-else"
    write_manifest(pkg, manifest)
    assert main(["verify", str(pkg)]) == 2
    assert "'format' must be 'attnx-package'" in capsys.readouterr().err


def test_newer_format_version_exits_2(pkg, capsys):
    manifest = json.loads((pkg / MANIFEST).read_text())
    manifest["format_version"] = 99
    write_manifest(pkg, manifest)
    assert main(["verify", str(pkg)]) == 2
    assert "newer attnx" in capsys.readouterr().err


# Hostile packages: refused before anything is read ------------------------------------------
@pytest.mark.parametrize("name", ["../outside.bin", "/etc/hostname", "sub/../../outside.bin", ".."])
def test_manifest_naming_a_file_outside_is_refused(pkg, name, capsys):
    manifest = json.loads((pkg / MANIFEST).read_text())
    manifest["files"][name] = {"size": 1, "sha256": "0" * 64}
    write_manifest(pkg, manifest)
    assert main(["verify", str(pkg)]) == 2
    err = capsys.readouterr().err
    assert repr(name) in err and "refused" in err


def test_symlink_leading_out_is_refused(pkg, capsys):
    outside = pkg.parent / "outside.md"
    outside.write_text("not the parity report")
    os.remove(pkg / "parity.md")
    os.symlink("../outside.md", pkg / "parity.md")
    assert main(["verify", str(pkg)]) == 2
    assert "outside the package folder" in capsys.readouterr().err


def test_manifest_symlink_leading_out_is_refused(pkg, capsys):
    shutil.move(pkg / MANIFEST, pkg.parent / MANIFEST)
    os.symlink(f"../{MANIFEST}", pkg / MANIFEST)
    assert main(["verify", str(pkg)]) == 2
    assert "outside the package folder" in capsys.readouterr().err


def point_external_data_at(pkg, location: str) -> None:
    """Rewrite model.onnx's external-data locations, then make the manifest agree."""
    proto = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    changed = 0
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
                changed += 1
    assert changed
    (pkg / "model.onnx").write_bytes(proto.SerializeToString())
    rehash(pkg)


def test_external_data_outside_is_refused_and_never_opened(pkg):
    """The data file outside is a FIFO: opening it for reading would block until a writer
    comes, so a verify that touched it would time out instead of exiting 2."""
    os.mkfifo(pkg.parent / "outside.bin")
    point_external_data_at(pkg, "../outside.bin")
    proc = subprocess.run([sys.executable, "-m", "attnx.cli", "verify", str(pkg)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "'../outside.bin'" in proc.stderr and "refused" in proc.stderr
    assert "Traceback" not in proc.stderr and "loading" not in proc.stderr  # refused before onnxruntime


def test_load_refuses_external_data_outside(pkg):
    (pkg.parent / "outside.bin").write_bytes((pkg / "model.onnx.data").read_bytes())
    point_external_data_at(pkg, "../outside.bin")
    with pytest.raises(PackageError, match="outside.bin"):
        load(pkg)


def test_external_data_not_in_manifest_is_refused(pkg):
    shutil.copy(pkg / "model.onnx.data", pkg / "other.data")
    point_external_data_at(pkg, "other.data")
    with pytest.raises(PackageError, match="does not list"):
        verify_package(pkg)


class _Marker:
    """Unpickling this creates a file: proof that something unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_golden_with_a_pickle_is_never_unpickled(pkg, capsys):
    marker = pkg.parent / "unpickled"
    with np.load(pkg / "golden-0.npz", allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    evil = np.empty(1, dtype=object)
    evil[0] = _Marker(str(marker))
    arrays["x"] = evil
    np.savez(pkg / "golden-0.npz", **arrays)  # savez pickles object arrays
    assert str(marker).encode() in (pkg / "golden-0.npz").read_bytes()  # the payload is in the file
    rehash(pkg)
    assert main(["verify", str(pkg)]) == 1
    out = capsys.readouterr().out
    assert "golden-0.npz" in out.split("verify FAILED", 1)[1] and "not a plain npz" in out
    assert not marker.exists()


# Torch-free deployment, run, inspect --------------------------------------------------------
def test_verify_load_and_run_with_torch_unimportable(built, tmp_path):
    x = tmp_path / "x.npy"
    script = textwrap.dedent(
        f"""
        import importlib.abc, sys

        class NoTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
                return None

        sys.meta_path.insert(0, NoTorch())
        import numpy as np
        from attnx.cli import main

        assert main(["verify", {str(built)!r}]) == 0
        import attnx
        with np.load({str(built / "golden-2.npz")!r}, allow_pickle=False) as npz:
            feeds = {{k: npz[k] for k in ("x", "memory", "key_padding_mask")}}
            expected = npz["y"]
        with attnx.load({str(built)!r}, provider="cpu") as runner:
            y = runner.run(feeds)["y"]
        assert np.abs(y - expected).max() < 1e-5, np.abs(y - expected).max()
        np.save({str(x)!r}, feeds["x"])
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
        print("TORCH-FREE OK")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verify PASSED" in proc.stdout and "TORCH-FREE OK" in proc.stdout


def test_run_cli_on_a_package(built, tmp_path, capsys):
    with np.load(built / "golden-1.npz", allow_pickle=False) as npz:
        for k in ("x", "memory", "key_padding_mask"):
            np.save(tmp_path / f"{k}.npy", npz[k])
        expected = npz["y"]
    npy = {k: str(tmp_path / f"{k}.npy") for k in ("x", "memory", "key_padding_mask", "y")}
    rc = main(["run", str(built), "--input", npy["x"], "--memory", npy["memory"],
               "--key-padding-mask", npy["key_padding_mask"], "--output", npy["y"]])  # fmt: skip
    assert rc == 0
    y = np.load(tmp_path / "y.npy", allow_pickle=False)
    assert y.dtype == np.float32 and y.shape == expected.shape
    assert np.abs(y - expected).max() < 1e-5
    np.testing.assert_array_equal(y[1], np.broadcast_to(y[1, :1], y[1].shape))  # fully masked: y = out bias


def test_inspect_and_describe(built, capsys):
    info = describe_package(built)
    assert info["config"] == CONFIG.to_dict() and info["verified_on"] == ["cpu"]
    assert info["models"][0]["external_data"] == ["model.onnx.data"] and info["parity"]["passed"]
    assert main(["inspect", str(built), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["files"]["model.onnx.data"] > 0


def test_verify_on_a_provider_the_package_was_not_built_for(built, capsys):
    assert main(["verify", str(built), "--provider", "cuda"]) == 2
    assert "no model for provider 'cuda' (built for: cpu)" in capsys.readouterr().err
