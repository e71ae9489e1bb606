"""Packages of step models: built with step-by-step parity, a golden decode sequence that verify
replays, and the decode API of attnx.load."""

from __future__ import annotations

import json

import numpy as np
import pytest

import attnx
from attnx.model import AttentionConfig
from attnx.runtimes.decode import make_decode_inputs
from attnx.runtimes.package import verify_package
from attnx.workflows import build_package

CONFIG = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, causal=True, key_padding_mask=True, kv_cache=True)


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    out = tmp_path_factory.mktemp("pkg") / "gqa"
    report = build_package(CONFIG, out, providers=["cpu"])
    assert report.parity.passed and report.verify.passed
    return out


def test_step_package_carries_a_golden_decode_sequence(package):
    manifest = json.loads((package / "manifest.json").read_text())
    (golden,) = manifest["golden"]
    assert golden["decode"] == {"prefill": 5, "steps": 4} and golden["outputs"] == ["y", "present_key", "present_value"]
    assert {i["name"] for i in manifest["inputs"]} == {"x", "past_key", "past_value", "key_padding_mask"}
    parity = json.loads((package / "parity.json").read_text())["cases"]
    assert {(c["backend"], c["prefill"]) for c in parity if c["status"] == "pass"} >= {
        (b, p) for b in ("reference", "torch", "ort-cpu") for p in (0, 1, 37)
    }
    report = verify_package(package)
    decode_checks = [c for c in report.checks if c.name.startswith("golden-decode-0.npz ")]
    assert report.passed and len(decode_checks) == 3 and "prefill=5 + 4 steps" in decode_checks[0].detail


def test_verify_catches_a_wrong_golden_decode(package, tmp_path):
    """A golden sequence whose y was altered after the build fails its replay (the manifest is
    re-hashed so the files check passes and the replay itself must catch it)."""
    import hashlib
    import shutil

    from attnx.workflows import write_npz

    copy = tmp_path / "copy"
    shutil.copytree(package, copy)
    with np.load(copy / "golden-decode-0.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["y"][:, -1] += 1e-3  # the last step's output
    write_npz(copy / "golden-decode-0.npz", arrays)
    manifest = json.loads((copy / "manifest.json").read_text())
    data = (copy / "golden-decode-0.npz").read_bytes()
    manifest["files"]["golden-decode-0.npz"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    (copy / "manifest.json").write_text(text)
    (copy / "manifest.sha256").write_text(f"{hashlib.sha256(text.encode()).hexdigest()}  manifest.json\n")
    report = verify_package(copy)
    failed = [c.name for c in report.checks if not c]
    assert not report.passed and failed == ["golden-decode-0.npz y"]


def test_load_prefill_step(package):
    feeds = make_decode_inputs(CONFIG, 2, 7, seed=3)
    x, kpm = feeds["x"], feeds["key_padding_mask"]
    with attnx.load(package) as runner:
        prompt = runner.prefill(x[:, :6], kpm[:, :6])
        y, state = runner.step(x[:, 6:], prompt, kpm[:, 6:])
        full = runner.prefill(x, kpm)  # the same 7 tokens at once
    assert prompt.y.shape == (2, 6, 32) and state.length == 7
    assert np.allclose(np.concatenate([prompt.y, y], axis=1), full.y, atol=1e-5)
