"""attnx optimize of whole models other tools exported (issue 40's first slice, attnx.workflows.optimize_model): the
committed fixtures' blocks rewritten into the ort-fused lowering's cores, spliced into the graph, the interface kept,
proven (each new block against the float64 reference and its checkpoint, the whole model's greedy tokens through its
own cache) before anything is written; a block no core takes, or one not read, kept and named."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from attnx.cli import main
from attnx.workflows import optimize_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DYNAMO = FIXTURES / "exported" / "torch-dynamo"


def _io(path) -> list:
    graph = onnx.load(str(path), load_external_data=False).graph
    return [(v.name, v.type.tensor_type.elem_type, [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim])
            for v in [*graph.input, *graph.output]]  # fmt: skip


@pytest.mark.parametrize(("export", "checkpoint"), [
    ("llama/sdpa-opset20", FIXTURES / "genai" / "llama" / "checkpoint"),
    ("gemma2/eager-opset20", FIXTURES / "genai" / "gemma2" / "checkpoint"),  # softcap, a window: GQA's attributes
    ("qwen3/sdpa-opset23", FIXTURES / "genai" / "qwen3" / "checkpoint"),  # ONNX's Attention, q/k norms
    ("llama4/eager-opset20", DYNAMO / "llama4" / "checkpoint"),  # chunks, the norm after rope, the temperature
])  # fmt: skip
def test_every_block_is_rewritten_into_a_fused_core_and_proven(export, checkpoint, tmp_path):
    source = DYNAMO / export / "model.onnx"
    out = tmp_path / "out.onnx"
    report = optimize_model(str(source), str(out), checkpoint=str(checkpoint))
    assert report.passed and report.written and out.exists(), report.lines()
    assert [b.written for b in report.blocks] == ["gqa"] * len(report.blocks) and report.blocks
    assert [b.layer for b in report.blocks] == list(range(len(report.blocks)))
    assert _io(out) == _io(source)  # whatever fed the model feeds its rewrite
    ops = {(n.domain, n.op_type) for n in onnx.load(str(out)).graph.node}
    assert ("com.microsoft", "GroupQueryAttention") in ops and ("", "Softmax") not in ops
    assert sum(line.startswith("pass: the whole model") for line in report.proofs) == 2


def test_an_encoder_whose_output_bias_is_added_after_its_block(tmp_path):
    """BERT as ONNX Runtime's optimizer fuses it: com.microsoft Attention reading each row's length (right padding),
    its output projection's bias added by the SkipLayerNormalization after it. Rewritten into MultiHeadAttention, the
    new block ends before that bias (added once), and the whole model runs a right-padded batch."""
    bert = FIXTURES / "exported" / "ort-optimizer" / "bert"
    report = optimize_model(str(bert / "model.onnx"), str(tmp_path / "out.onnx"), checkpoint=str(bert / "checkpoint"))
    assert report.passed and [b.written for b in report.blocks] == ["mha", "mha"], report.lines()
    assert any("full sequence of a right-padded batch: the same greedy tokens" in line for line in report.proofs)
    ops = [n.op_type for n in onnx.load(str(tmp_path / "out.onnx")).graph.node]
    assert ops.count("SkipLayerNormalization") == 4 and "Attention" not in ops


def test_a_model_of_other_shapes_with_its_batch_fixed_at_one(tmp_path):
    """The unseen set's llama (head_dim 32, 3 layers, a llama3 rope) exported with its batch fixed at 1: every
    block rewritten, the whole model run on one row."""
    unseen = FIXTURES / "unseen"
    source = unseen / "exported" / "torch-dynamo" / "llama" / "sdpa-opset20-b1" / "model.onnx"
    report = optimize_model(str(source), str(tmp_path / "out.onnx"), checkpoint=str(unseen / "genai" / "llama" / "checkpoint"))
    assert report.passed and [b.written for b in report.blocks] == ["gqa"] * 3, report.lines()
    assert _io(tmp_path / "out.onnx") == _io(source)
    assert sum("of one row (the model's batch is fixed at 1)" in line for line in report.proofs) == 2


def test_without_a_checkpoint_a_block_not_read_is_kept_and_named(tmp_path, capsys):
    """Llama 4's rotating layers use a llama3-scaled rope that no theta fits: without its checkpoint the block is
    not read, so it is kept as it is and said; the NoPE layer is rewritten; through the CLI, with its JSON."""
    out, report_path = tmp_path / "out.onnx", tmp_path / "r.json"
    code = main(["optimize", str(DYNAMO / "llama4" / "eager-opset20" / "model.onnx"), "--out", str(out),
                 "--json", str(report_path)])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads(report_path.read_text())
    assert [b["written"] for b in report["blocks"]] == [None, None, None, "gqa"]
    assert all("a scaled rope" in b["kept"] for b in report["blocks"][:3])
    assert "block 3: decomposed -> gqa" in text and "optimize PASSED: 1 of 4 block(s) rewritten" in text


def test_a_model_with_no_block_to_rewrite_writes_nothing(tmp_path, capsys):
    """The builder's int4 model: its projections are MatMulNBits, kept in this version; with nothing rewritten
    nothing is written (exit 1), and the reason of each block is said."""
    source = FIXTURES / "genai" / "llama" / "int4" / "model.onnx"
    out = tmp_path / "out.onnx"
    assert main(["optimize", str(source), "--out", str(out)]) == 1
    text = capsys.readouterr().out
    assert "MatMulNBits 4-bit: kept in this version" in text and "nothing written" in text
    assert not out.exists()


def test_the_flags_of_an_attnx_model_are_refused_for_a_whole_model_and_the_other_way(tmp_path, capsys):
    source = str(DYNAMO / "llama" / "sdpa-opset20" / "model.onnx")
    assert main(["optimize", source, "--out", str(tmp_path / "o.onnx"), "--dtype", "fp16"]) == 2
    assert "--dtype is for a model attnx wrote" in capsys.readouterr().err
    assert main(["optimize", source, "--out", source]) == 2
    assert not (tmp_path / "o.onnx").exists()
