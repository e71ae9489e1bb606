"""Packages of modern-LLM layers (issue 22, item 5): the step model (decomposed, fp32) with its golden decode
fed position_ids, replayed by verify and decoded through attnx.load with positions; the full-sequence
package, whose golden cases carry position_ids; the forms not built yet refused by name; a golden
decode whose positions are off by one fails verify; longrope's switch mid-decode is what decode parity
and the golden decode expect.

Cost: the build's step parity is cut to prefills 0 and 5 + 6 steps here (STEP_PARITY, monkeypatched for
the module); the full-sequence build checks at small shapes (a CheckPlan)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil

import numpy as np
import pytest

import attnx
from attnx.errors import InputError, UsageError
from attnx.model.config import AttentionConfig
from attnx.model.weights import init_weights
from attnx.runtimes import ModelSource, create_runner
from attnx.runtimes.decode import decode_sequence, empty_cache, run_decode_parity
from attnx.runtimes.package import verify_package
from attnx.workflows import _build, _package_files, build_package, write_npz
from tests.conftest import LLM_CONFIGS, weights_for

STEP = dataclasses.replace(LLM_CONFIGS["llm"], kv_cache=True)  # every term: rope (yarn), window, softcap, norms, sinks
SMALL_STEP_PARITY = {"prefills": (0, 5), "steps": 6, "batch": 3}


@pytest.fixture(scope="module")
def step_package(tmp_path_factory):
    out = tmp_path_factory.mktemp("llm-pkg") / "step"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_build, "STEP_PARITY", SMALL_STEP_PARITY)
        report = build_package(STEP, out, weights_for("llm"), attention="decomposed", providers=["cpu"])
    assert report.parity.passed and report.verify.passed
    return out


def test_the_step_package_records_position_ids_and_verify_replays_them(step_package):
    manifest = json.loads((step_package / "manifest.json").read_text())
    assert manifest["attention"] == "decomposed" and manifest["config"]["rope"]["scaling"]["rope_type"] == "yarn"
    assert {i["name"]: i["shape"] for i in manifest["inputs"]}["position_ids"] == ["batch", "seq"]
    (golden,) = manifest["golden"]
    assert golden["decode"] == {"prefill": 5, "steps": 4} and "position_ids" in golden["inputs"]
    assert golden["problem_size"]["rope_position"] > 0  # the rope term of the tolerance, recorded
    with np.load(step_package / golden["file"]) as npz:
        positions = npz["position_ids"]
    assert positions.tolist()[1] == [1, 1, 1, 0, 1, 2, 3, 4, 5]  # row 1 left-padded by three: Hugging Face's rule
    parity = json.loads((step_package / "parity.json").read_text())["cases"]
    assert {(c["backend"], c["prefill"]) for c in parity if c["status"] == "pass"} >= {
        (b, p) for b in ("reference", "torch", "ort-cpu") for p in (0, 5)
    }
    report = verify_package(step_package)
    checks = [c for c in report.checks if c.name.startswith("golden-decode-0.npz ")]
    assert report.passed and len(checks) == 3 and "prefill=5 + 4 steps" in checks[0].detail


def test_load_decodes_with_positions(step_package):
    with np.load(step_package / "golden-decode-0.npz") as npz:
        golden = {k: npz[k] for k in npz.files}
    x, mask, pos = golden["x"], golden["key_padding_mask"], golden["position_ids"]
    with attnx.load(step_package) as runner:
        state = runner.prefill(x[:, :5], mask[:, :5], pos[:, :5])
        ys = [state.y]
        for t in range(5, x.shape[1]):
            y, state = runner.step(x[:, t : t + 1], state, mask[:, t : t + 1], pos[:, t : t + 1])
            ys.append(y)
        y = np.concatenate(ys, axis=1)
        keep = ~mask  # padding queries see no key: y = bo there, the same on both
        assert np.abs(y - golden["y"])[keep].max() < 1e-4
        with pytest.raises(InputError, match="position_ids"):
            runner.prefill(x[:, :5], mask[:, :5])


def test_verify_fails_a_golden_decode_fed_positions_off_by_one(step_package, tmp_path):
    """The golden file's step positions moved by one after the build (the manifest re-hashed, so only the
    replay can catch it). Not every position: rope's scores depend on differences of positions, so a
    shift of all of them changes the cached keys only."""
    copy = tmp_path / "copy"
    shutil.copytree(step_package, copy)
    with np.load(copy / "golden-decode-0.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["position_ids"][:, 5:] += 1  # the 4 single-token steps after the prefill of 5
    write_npz(copy / "golden-decode-0.npz", arrays)
    manifest = json.loads((copy / "manifest.json").read_text())
    data = (copy / "golden-decode-0.npz").read_bytes()
    manifest["files"]["golden-decode-0.npz"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (copy / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    digest = hashlib.sha256((copy / "manifest.json").read_bytes()).hexdigest()
    (copy / "manifest.sha256").write_text(f"{digest}  manifest.json\n")
    report = verify_package(copy)
    assert not report.passed
    assert {c.name for c in report.failures()} == {"golden-decode-0.npz y", "golden-decode-0.npz present_key"}


def test_the_full_sequence_package_carries_position_ids(tmp_path):
    plan = _build.CheckPlan(validation_shapes=((1, 1, 3), (3, 17, 5)), parity_batches=(3,), parity_seqs=(1, 9),
                            parity_mem_seqs=(5,), golden_shapes=((2, 7, 5),), check_reference=True)  # fmt: skip
    out = tmp_path / "full"
    report = build_package(LLM_CONFIGS["llama"], out, weights_for("llama"), attention="decomposed",
                           providers=["cpu"], plan=plan)  # fmt: skip
    assert report.parity.passed and report.verify.passed
    manifest = json.loads((out / "manifest.json").read_text())
    (golden,) = manifest["golden"]
    assert golden["inputs"] == ["x", "position_ids"] and golden["problem_size"]["rope_position"] > 0
    with attnx.load(out) as runner, np.load(out / golden["file"]) as npz:
        y = runner.run({"x": npz["x"], "position_ids": npz["position_ids"]})["y"]
        assert np.abs(y - npz["y"]).max() < 1e-4


def test_forms_a_core_cannot_express_are_refused_by_name(tmp_path):
    """What the registry says the lowering's core cannot express, refused before any work."""
    for attention, dtype, reason in (("onnx", "fp32", "does not express sinks"),
                                     ("decomposed", "bf16", "no attnx graph computes in bfloat16")):  # fmt: skip
        config = dataclasses.replace(STEP, sinks=True)
        with pytest.raises(UsageError, match=reason):
            build_package(config, tmp_path / "pkg", attention=attention, dtype=dtype)
        assert not (tmp_path / "pkg").exists()


def test_longrope_switching_mid_decode_is_what_parity_and_the_golden_decode_expect(tmp_path):
    """longrope with an original length of 6: a prefill of 5 uses the short factors, the steps from
    position 6 on the long ones, and the keys cached before keep their short rotation (transformers'
    rule). Decode parity and the golden decode expect exactly that, not the full forward (all long)."""
    config = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, causal=True, key_padding_mask=True, kv_cache=True,
                             rope={"theta": 10000.0, "scaling": {
                                 "rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5],
                                 "long_factor": [3.0, 5.0, 7.0, 9.0], "original_max_position_embeddings": 6,
                                 "factor": 4.0}})  # fmt: skip
    weights = init_weights(config, 1)
    report = run_decode_parity(ModelSource(config, weights), ["reference", "torch"], prefills=(0, 5), steps=4,
                               batch=2)  # fmt: skip
    assert report.passed and len(report.cases) == 4, report.summary()
    entry = _package_files.write_golden_decode(str(tmp_path), config, weights, "fp32")
    with np.load(tmp_path / entry["file"]) as npz:
        golden = {k: npz[k] for k in npz.files}
    feeds = {k: golden[k] for k in entry["inputs"]}
    with create_runner("torch", ModelSource(config, weights)) as torch_runner:
        y, _ = decode_sequence(torch_runner, feeds, entry["decode"]["prefill"], config)
    assert np.abs(y - golden["y"]).max() < 1e-4
    pk, pv = empty_cache(config, 2)
    with create_runner("reference", ModelSource(config, weights)) as reference:
        whole = reference.run({**feeds, "past_key": pk, "past_value": pv})["y"]
    assert np.abs(whole - golden["y"]).max() > 1e-2  # the switch happened: the full forward differs
