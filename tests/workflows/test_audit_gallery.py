"""The planted-fault gallery (tests/workflows/_gallery.py): on every clean model another tool exported (both fixture
sets), each fault that applies is planted in one layer and `attnx audit --checkpoint` finds it in that layer and in no other: the
other blocks pass, and nothing is said of the whole model. A fault no term of the formula explains leaves its layer
unread instead, named with the reason, and never a pass."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import onnx
import pytest

from attnx.workflows.audit import audit_model
from tests.workflows import _gallery

# the slow tier: the 222-fault gallery (test_audit.py's planted faults stay in the fast tier); each fault is audited
# with the model's other layers, and so its rotary tables, as they were (tests/conftest.py: rope_tables_named_once)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("rope_tables_named_once")]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GENAI = FIXTURES / "genai"
EXPORTED = FIXTURES / "exported"


def _exported(fixture: str) -> tuple[str, str]:
    folder = EXPORTED / fixture
    return str(folder / "model.onnx"), str((folder / json.loads((folder / "fixture.json").read_text())["checkpoint"]).resolve())


# (model, its checkpoint): the clean models of both fixture sets
MODELS = {
    **{m: (str(GENAI / m / "model.onnx"), str(GENAI / m.split("/")[0] / "checkpoint"))
       for m in ["llama/fp32", "qwen2/fp32", "qwen3/fp32", "phi3/fp32", "gemma2/fp32", "gpt-oss/fp32", "llama/int4",
                 "qwen3/int4-acc1", "llama/fp16"]},
    **{f: _exported(f) for f in ["torch-dynamo/llama/sdpa-opset20", "torch-dynamo/llama/eager-opset20",
                                 "torch-dynamo/llama/sdpa-opset23", "torch-dynamo/qwen3/sdpa-opset20",
                                 "torch-dynamo/gemma2/eager-opset20", "optimum/llama"]},
}  # fmt: skip
UNSEEN = FIXTURES / "unseen"  # the second set: other shapes in every source (tests/fixtures/unseen/models.json)
MODELS.update({f"unseen/{m['path'].removesuffix('/model.onnx')}": (str(UNSEEN / m["path"]), str(UNSEEN / m["checkpoint"]))
               for m in json.loads((UNSEEN / "models.json").read_text()) if m["agrees"]})  # fmt: skip


def _cases():
    for name, (path, checkpoint) in MODELS.items():
        model = _gallery.Model.read(path, checkpoint)
        for fault in _gallery.FAULTS:
            if _gallery.applies(fault, model):
                yield pytest.param(name, fault, id=f"{name}:{fault}")


@functools.cache
def _layers(checkpoint: str) -> list:
    return _gallery.checkpoint_layers(checkpoint)


@functools.cache
def _clean(model: str) -> tuple[str, ...]:
    """What the audit says of the clean model as a whole (the builder's fp16 model fails its first decoding step)."""
    path, checkpoint = MODELS[model]
    return tuple(audit_model(path, checkpoint=checkpoint).findings)


@pytest.mark.parametrize(("model", "fault"), list(_cases()))
def test_a_planted_fault_is_found_in_its_own_layer_and_no_other(tmp_path, model, fault):
    path, checkpoint = MODELS[model]
    layers = _layers(checkpoint)
    layer = len(layers) // 2
    proto = onnx.load(path)
    finding = _gallery.FAULTS[fault](proto, layer, layers)
    assert finding is not None, f"{fault} could not be planted in {model}"
    out = tmp_path / "model.onnx"
    external = (Path(path).parent / "model.onnx.data").exists()  # as the tool wrote it: one file, or with its data
    onnx.save(proto, str(out), save_as_external_data=external, location="model.onnx.data")
    report = audit_model(str(out), checkpoint=checkpoint)
    [block] = [b for b in report.blocks if b.layer == layer]
    assert any(f.startswith(finding) for f in block.findings), block.findings
    elsewhere = {b.index: b.findings + b.not_checked for b in report.blocks if b is not block and not b.passed}
    whole = [f for f in report.findings if f not in _clean(model)]
    assert not elsewhere and not whole and not report.unread, (elsewhere, whole, report.unread)
    assert not report.passed


def _unread_cases():
    for name, (path, checkpoint) in MODELS.items():
        if _gallery.applies_unread(_gallery.Model.read(path, checkpoint)):
            yield from (pytest.param(name, fault, id=f"{name}:{fault}") for fault in _gallery.UNREAD_FAULTS)


@pytest.mark.parametrize(("model", "fault"), list(_unread_cases()))
def test_a_planted_fault_no_term_explains_leaves_its_own_layer_unread_and_fails(tmp_path, model, fault):
    """A scaling of a decomposed softcap's capped scores (c * tanh(s / c) * 1.25, however written) is no softcap
    c' * tanh(scale * s / c'): read as the scale inside the cap, the block would be checked against a formula the
    graph does not compute and pass. It is not read: that layer's node is named with the reason, its checkpoint layer
    pairs with no block, the other blocks pass, and the audit does not."""
    path, checkpoint = MODELS[model]
    layers = _layers(checkpoint)
    layer = len(layers) // 2
    proto = onnx.load(path)
    node = _gallery.attention_nodes(proto)[layer].name
    reason = _gallery.UNREAD_FAULTS[fault](proto, layer, layers)
    assert reason is not None, f"{fault} could not be planted in {model}"
    out = tmp_path / "model.onnx"
    onnx.save(proto, str(out))
    report = audit_model(str(out), checkpoint=checkpoint)
    assert len(report.unread) == 1 and report.unread[0].startswith(f"node {node}: not read as attention: {reason}"), (
        report.unread)
    whole = [f for f in report.findings if f not in _clean(model)]
    assert whole == [f"checkpoint layer(s) {layer}: no block of the graph pairs with them"], whole
    assert layer not in [b.layer for b in report.blocks] and all(b.passed for b in report.blocks), (
        [b.findings + b.not_checked for b in report.blocks])
    assert len(report.blocks) == len(layers) - 1 and not report.passed
