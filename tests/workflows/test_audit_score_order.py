"""The scalings between q.k and the Softmax read in the order the graph computes them (attnx.export.terms,
_recognise_softcap): before the tanh they are the scale, the multiply after it that undoes the divide is the cap, and
anything after the softcap that no term explains leaves the block unread with its reason, never read as the scale
inside the cap. Planted in layer 0 of Gemma 2 as torch.onnx's dynamo exporter writes it (Softmax(50 tanh(s / 50) +
mask)), on both fixture sets (the gallery plants them in every such model's middle layer: test_audit_gallery.py)."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest

from attnx.export._blocks import read_blocks
from attnx.workflows.audit import audit_model
from tests.workflows import _gallery

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GEMMA2 = {50.0: FIXTURES / "exported/torch-dynamo/gemma2/eager-opset20",  # by softcap: 2 layers, head_dim 32
          30.0: FIXTURES / "unseen/exported/torch-dynamo/gemma2/eager-opset20-b1"}  # 4 layers, head_dim 48  # fmt: skip


def _said(plant: tuple[str, float, str]) -> str:
    op, value, where = plant
    return f"{op} {value:g} {where}"


def _planted(softcap: float, op: str, value: float, where: str) -> onnx.ModelProto:
    proto = onnx.load(str(GEMMA2[softcap] / "model.onnx"))
    assert _gallery.plant_on_scores(proto, 0, op, value, where)
    return proto


UNREAD = {  # (op, value, where) -> the reason the block is not read, before the cap is named
    ("Mul", 1.25, "after the mask"): "a Mul by 1.25 after the softcap: no term explains it",
    ("Mul", 1.25, "before the mask"): "a Mul by 1.25 after the softcap: no term explains it",
    ("Div", 0.8, "after the mask"): "a Div by 0.8 after the softcap: no term explains it",
    ("Mul", 1.25, "after the tanh"): "a Mul by 1.25 between the tanh and the softcap's multiply by {cap:g}: no term "
                                     "explains it",
    # refused before the scalings are read, as it was (a guard: the constant is no term either)
    ("Add", 0.5, "after the mask"): "a constant added to the scores (a folded mask or a position bias): not read in "
                                    "this version",
}  # fmt: skip


@pytest.mark.parametrize("softcap", GEMMA2)
@pytest.mark.parametrize("plant", UNREAD, ids=_said)
def test_a_step_after_the_softcap_that_no_term_explains_leaves_the_block_unread(plant, softcap):
    proto = _planted(softcap, *plant)
    node = _gallery.attention_nodes(proto)[0].name
    blocks = read_blocks(ir.from_proto(proto))
    assert blocks.unread == [f"node {node}: not read as attention: {UNREAD[plant].format(cap=softcap)}"]
    assert len(blocks.blocks) == len(_gallery.attention_nodes(proto)) - 1  # the other layers, read as before
    assert all(b.config.softcap == softcap for b in blocks.blocks)


# (op, value, where) -> the scale read over the graph's own: what c * tanh(scale * s / c) computes exactly
READ = {("Mul", 1.0, "after the tanh"): 1.0, ("Mul", 1.0, "after the mask"): 1.0,
        ("Mul", 1.25, "before the tanh"): 1.25, ("Div", 0.8, "before the tanh"): 1.25}  # fmt: skip


@pytest.mark.parametrize("softcap", GEMMA2)
@pytest.mark.parametrize("plant", READ, ids=_said)
def test_a_scaling_the_formula_expresses_exactly_is_read(plant, softcap):
    """A Mul by exactly 1 anywhere changes nothing; a scaling between the divide by the cap and the tanh is inside the
    cap with the scale (the brief's order of operations: scalings before the tanh form the scale)."""
    clean = read_blocks(ir.load(str(GEMMA2[softcap] / "model.onnx"))).blocks[0]
    blocks = read_blocks(ir.from_proto(_planted(softcap, *plant)))
    assert not blocks.unread and blocks.blocks[0].config.softcap == softcap
    assert blocks.blocks[0].config.softmax_scale == pytest.approx(clean.config.softmax_scale * READ[plant], rel=1e-6)


def _audit(tmp_path: Path, proto: onnx.ModelProto):
    path = tmp_path / "model.onnx"
    onnx.save(proto, str(path))
    folder = GEMMA2[50.0]
    checkpoint = (folder / json.loads((folder / "fixture.json").read_text())["checkpoint"]).resolve()
    return audit_model(str(path), checkpoint=str(checkpoint))


def test_the_audit_names_a_layer_scaled_after_its_softcap_as_not_read_and_fails(tmp_path):
    """Read as 50 tanh(1.25 s / 50), the block would be checked against the graph's misread formula; unread, it is
    named, its checkpoint layer pairs with no block, and the audit does not pass."""
    report = _audit(tmp_path, _planted(50.0, "Mul", 1.25, "after the mask"))
    assert len(report.unread) == 1 and report.unread[0].endswith("a Mul by 1.25 after the softcap: no term explains it")
    assert report.findings == ["checkpoint layer(s) 0: no block of the graph pairs with them"]
    assert [b.layer for b in report.blocks] == [1] and report.blocks[0].passed and not report.passed


def test_the_audit_finds_a_scaling_inside_the_softcap_as_layer_0_s_scale(tmp_path):
    """Between the divide by the cap and the tanh, 1.25 is read as the scale's: the fault is found in layer 0 as its
    scale; a Mul by exactly 1 after the softcap is read and passes."""
    report = _audit(tmp_path, _planted(50.0, "Mul", 1.25, "before the tanh"))
    [block] = [b for b in report.blocks if b.layer == 0]
    assert any(f.startswith("layer 0: scale 0.220971 in the graph, 0.176777 in the checkpoint") for f in block.findings), (
        block.findings)
    assert not report.unread and not report.passed
    report = _audit(tmp_path, _planted(50.0, "Mul", 1.0, "after the mask"))
    assert report.passed, [b.findings + b.not_checked for b in report.blocks] + report.unread + report.findings
