"""A whole DeepSeek-V3 decoder exported by torch.onnx (tests/fixtures/exported/make_mla.py: transformers 5.24, q through
q_lora_rank, its rope read in pairs, its cache MLA's latent: the compressed kv and the rope key) through `attnx audit`:
each block's multi-head latent attention read (attnx.export.cores._latent_block) and proven against the float64
formula; a block turned otherwise than it is read fails its proof; one the latent term cannot state is named."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from attnx.cli import main
from attnx.workflows.audit.audit import audit_model

HERE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "exported", "torch-dynamo", "deepseek_v3")
MODEL, CHECKPOINT = os.path.join(HERE, "sdpa", "model.onnx"), os.path.join(HERE, "checkpoint")


@pytest.fixture(scope="module")
def report():
    return audit_model(MODEL)


def test_every_mla_block_is_read_as_latent_attention_and_proven(report):
    assert report.passed and not report.unread
    assert [b.index for b in report.blocks] == [0, 1]
    for block in report.blocks:
        assert "latent" in block.terms and "rope" in block.terms
        names = [c.name for c in block.checks]
        assert any(n.startswith("full sequence") for n in names) and any(n.startswith("prefill") for n in names)
        assert all(block.checks) and not block.findings and not block.not_checked


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in model.graph.node for o in n.output}


def test_a_rope_key_turned_with_its_halves_swapped_fails_the_proof(tmp_path):
    model = onnx.load(MODEL)
    made = _producers(model)
    turned = made[made["present.0.value"].input[1]]  # Concat(x1 cos - x2 sin, x2 cos + x1 sin): the turned key
    assert turned.op_type == "Concat"
    turned.input[0], turned.input[1] = turned.input[1], turned.input[0]
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    faulty = audit_model(str(path), layers=[0])
    assert not faulty.passed
    assert faulty.blocks[0].findings and not all(faulty.blocks[0].checks)
    assert any("against the reference fails" in f for f in faulty.blocks[0].findings)


def test_a_block_whose_two_norms_differ_in_eps_is_named_not_read(tmp_path):
    model = onnx.load(MODEL)
    made = _producers(model)
    weight = "model.layers.0.self_attn.q_a_layernorm.weight"  # both layers' (ones: one initializer)
    norm = [n for n in model.graph.node if weight in n.input][1]  # block 1's q_a_layernorm
    value = next(i for i in norm.input if i != weight)
    while made[value].op_type != "Add":  # back through the Muls, Reciprocal and Sqrt to the Add of eps
        value = next(i for i in made[value].input if i in made and made[i].op_type in ("Mul", "Reciprocal",
                                                                                         "Sqrt", "Add"))  # fmt: skip
    add = made[value]
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1e-3, np.float32), "q_a_eps"))
    add.input[1] = "q_a_eps"
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    found = audit_model(str(path))
    assert [b.index for b in found.blocks] == [0] and found.blocks[0].passed
    assert len(found.unread) == 1 and not found.passed
    assert "q_a_layernorm's eps" in found.unread[0] and "latent term has one" in found.unread[0]


def test_each_block_pairs_with_its_checkpoint_layer_and_states_what_it_imports(capsys):
    # the layers sampled by o_proj alone (a latent layer has no q, k, v projections); the terms and weights read
    # from the graph are the ones `attnx import` reads from the checkpoint: no finding
    assert main(["audit", MODEL, "--checkpoint", CHECKPOINT]) == 0
    out = capsys.readouterr().out
    assert "block 0 = checkpoint layer 0: pass" in out and "block 1 = checkpoint layer 1: pass" in out


def test_a_plain_q_half_split_eager_export_is_read_and_pairs_with_its_checkpoint(capsys):
    """The other variant of make_mla.py: q from a plain q_proj, half-split pairs (rotate_half: a Concat before the
    Mul by sin), v heads of 12, eager attention. k's path ends at the rope key's projection there, not kv_b_proj's:
    the block is told by v's widening projection; before, it was "a cross attention", not read."""
    model, checkpoint = os.path.join(HERE, "eager-plain-q", "model.onnx"), os.path.join(HERE, "checkpoint-plain-q")
    assert main(["audit", model, "--checkpoint", checkpoint]) == 0
    out = capsys.readouterr().out
    assert "block 0 = checkpoint layer 0: pass" in out and "block 1 = checkpoint layer 1: pass" in out
    assert "latent,rope" in out


def test_optimize_keeps_each_mla_block_naming_the_latent_no_fused_core_expresses(tmp_path, capsys):
    out = tmp_path / "out.onnx"
    assert main(["optimize", MODEL, "--out", str(out)]) == 1
    said = capsys.readouterr()
    kept = [line for line in (said.out + said.err).splitlines() if line.startswith("block ") and " kept: " in line]
    assert len(kept) == 2 and all("does not express latent" in line for line in kept)
    # no advice of a flag a whole model does not take (core_for's what=None: the reasons alone)
    assert not any("--attention" in line for line in kept)
    assert not out.exists()  # nothing written
