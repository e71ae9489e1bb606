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


@pytest.mark.parametrize("core", ["gqa", "switch"])
def test_buffer_form_package(tmp_path, core):
    """--decode-form buffer: the package holds the buffer form (manifest: decode "buffer", its inputs),
    its parity is the reference's and ONNX Runtime's (the form runs there alone), its golden sequence has
    no padding, verify replays it through a BufferDecoder, and a wrong golden step fails the replay."""
    from attnx.runtimes.decode import BufferDecoder

    config = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, causal=True, kv_cache=True)
    out = tmp_path / "buffer"
    report = build_package(config, out, attention="ort-fused", providers=["cpu"], decode_form="buffer",
                           buffer_core=core)  # fmt: skip
    assert report.parity.passed and report.verify.passed
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["models"][0]["decode"] == "buffer"
    assert [i["name"] for i in manifest["inputs"]] == ["x", "past_key", "past_value", "seqlens_k",
                                                       "total_sequence_length"]  # fmt: skip
    parity = json.loads((out / "parity.json").read_text())["cases"]
    assert {c["backend"] for c in parity if c["status"] == "pass"} == {"reference", "ort-cpu"}
    with np.load(out / "golden-decode-0.npz") as npz:
        assert "key_padding_mask" not in npz.files and npz["x"].shape[:2] == (2, 9)
        x, y = npz["x"], npz["y"]
    with attnx.load(out) as runner:  # the deployment side: a BufferDecoder over the loaded runner
        dec = BufferDecoder(runner, config, 9, 2)
        got = np.concatenate([dec.step(x[:, :5])] + [dec.step(x[:, t : t + 1]) for t in range(5, 9)], axis=1)
    assert np.allclose(got, y, atol=1e-5)
    checks = [c for c in verify_package(out).checks if c.name.startswith("golden-decode-0.npz ")]
    assert len(checks) == 3 and all(checks)
    # the manifest's word on the form is checked against the model's own
    import hashlib

    manifest["models"][0]["decode"] = "growing"
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    (out / "manifest.json").write_text(text)
    (out / "manifest.sha256").write_text(f"{hashlib.sha256(text.encode()).hexdigest()}  manifest.json\n")
    bad = verify_package(out)
    assert not bad.passed and any('says decode "growing", the model itself "buffer"' in c.detail for c in bad.checks)


def test_buffer_form_package_refusals(tmp_path):
    config = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, causal=True, kv_cache=True)
    from attnx.errors import UsageError

    for kwargs, message in (
        ({"attention": "onnx", "decode_form": "buffer"}, "onnx has no buffer form"),
        ({"attention": "ort-fused", "buffer_core": "switch"}, "is the buffer form's"),
        ({"attention": "ort-fused", "decode_form": "buffer", "dtype": "fp16", "buffer_core": "switch"},
         "is not built in fp16"),
    ):
        with pytest.raises(UsageError, match=message):
            build_package(config, tmp_path / "p", providers=["cpu"], **kwargs)
    with pytest.raises(UsageError, match="does not express key_padding_mask in the buffer form"):
        build_package(CONFIG, tmp_path / "p", attention="ort-fused", providers=["cpu"], decode_form="buffer")
    assert not (tmp_path / "p").exists()
