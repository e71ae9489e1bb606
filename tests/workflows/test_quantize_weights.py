"""--weights int4|int8 of attnx optimize and build --model: an fp32 export's MatMul weights quantized with ONNX
Runtime's MatMulNBits quantizer, each block rewritten and proven with its quantized weights, what was quantized and
kept stated, the written model's distance from the fp32 input measured and recorded in the package."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from attnx.cli import main
from attnx.runtimes.package import verify_package

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LLAMA = FIXTURES / "exported" / "torch-dynamo" / "llama" / "sdpa-opset20" / "model.onnx"
CHECKPOINT = FIXTURES / "genai" / "llama" / "checkpoint"


def _ops(path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


@pytest.mark.parametrize(("weights", "bits"), [("int4", 4), ("int8", 8)])
def test_an_fp32_export_is_quantized_then_each_block_proven_and_its_distance_said(weights, bits, tmp_path, capsys):
    """torch.onnx's llama: its 15 MatMul weights (q, k, v, o, the MLP's three in each of 2 layers, the LM head)
    become MatMulNBits of `bits` bits; the embeddings' Gather becomes GatherBlockQuantized at 4 bits (int4 blocks
    along the hidden size, as the GenAI builder writes it) and keeps its float32 table at 8, said; each block's core is
    rewritten alone at the quantized projections and proven against float64 (the whole model on float32-compute
    twins, its kernels multiplying in int8); the distance from the fp32 input is said and in the JSON, int8's far
    below int4's."""
    out, report_path = tmp_path / "out.onnx", tmp_path / "r.json"
    code = main(["optimize", str(LLAMA), "--out", str(out), "--weights", weights, "--json", str(report_path),
                 "--core", "gqa"])  # a core named: written wherever it computes the block, whatever the times  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads(report_path.read_text())
    record = report["weights"]
    assert (record["bits"], record["block_size"], record["accuracy_level"]) == (bits, 32, 4)
    assert len(record["quantized"]) == 15 and record["lm_head"] is not None
    if bits == 4:
        assert record["kept"] == record["embeddings_kept"] == [] and record["embeddings"] == "model.embed_tokens.weight"
        assert "the embeddings quantized (4 bits, blocks of 32 along the hidden size: GatherBlockQuantized)" in text
    else:
        assert record["kept"] == ["model.embed_tokens.weight: a Gather's table (the embeddings)"]
        assert record["embeddings_kept"] == ["model.embed_tokens.weight"]  # typed: said() never parses `kept`
        assert record["embeddings"] is None and "the embeddings kept float32 (a Gather)" in text
    assert f"said: {weights}: 15 MatMul weight(s) quantized by ONNX Runtime's MatMulNBits quantizer ({bits} bits" in text
    assert all(b["written"] and b["splice"] == "the core alone, at the graph's projections" for b in report["blocks"])
    assert text.count("against the float64 reference") == 2 and "FAIL" not in text and report["model"] == str(LLAMA)
    distance = report["weights"]["distance"]
    assert 0 < distance["rel_rms"] < (0.1 if bits == 8 else 1.0) and 0 < distance["top1"] <= 1
    assert f"said: the {weights} model against the fp32 input, 4 prompts of 16, 48, 96, 128 tokens" in text
    # the kernels multiply in int8: the whole-model proofs ran on both models' float32-compute twins, then left
    assert text.count("pass: the whole model (each with its MatMulNBits computing in float32 (accuracy_level 1; "
                      "served at 4))") == 2, text
    assert {p.name for p in tmp_path.iterdir()} <= {"out.onnx", "out.onnx.data", "r.json"}
    ops = _ops(out)
    assert ops["MatMulNBits"] == 15 and ops.get("MatMul", 0) == 0
    assert ops.get("GatherBlockQuantized", 0) == (1 if bits == 4 else 0)


def test_a_package_records_its_weights_and_verifies(tmp_path, capsys):
    """build --model --weights int4: the package's manifest records what was quantized and the distance from the
    fp32 input; it verifies where it moves."""
    pkg = tmp_path / "pkg"
    assert main(["build", "--model", str(LLAMA), "--checkpoint", str(CHECKPOINT), "--weights", "int4",
                 "--out", str(pkg)]) == 0  # fmt: skip
    capsys.readouterr()
    manifest = json.loads((pkg / "manifest.json").read_text())
    weights = manifest["optimize"]["weights"]
    assert weights["weights"] == "int4" and weights["distance"]["rel_rms"] > 0
    assert verify_package(str(pkg)).passed


@pytest.mark.parametrize(("argv", "says"), [
    (["optimize", str(FIXTURES / "genai" / "llama" / "int4" / "model.onnx"), "--weights", "int4"],
     "has no MatMul of a constant 2-D float32 weight to quantize"),
    (["build", "--model", str(LLAMA), "--weights", "w.safetensors"],
     "a whole model (--model) takes --weights int4 or int8"),
])  # fmt: skip
def test_weights_it_cannot_quantize_are_one_error(argv, says, tmp_path, capsys):
    out = tmp_path / ("out.onnx" if argv[0] == "optimize" else "pkg")
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and not list(tmp_path.iterdir())  # nothing left, no scratch


def test_a_tied_lm_head_read_through_its_transpose_is_quantized():
    """torch.onnx writes a tied LM head as MatMul(x, Transpose(W)): W's transpose is the weight quantized, and the
    node computes what ONNX Runtime's quantizer makes of x @ W.T (within int8's rounding of W)."""
    import numpy as np
    import onnx_ir as ir
    import onnxruntime as ort

    from attnx.export.passes.quantize_weights import QuantizeWeights

    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 64)).astype(np.float32)  # [vocab, hidden], as an embedding table is
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 64])
    y = onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [2, 96])
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]), onnx.helper.make_node("MatMul", ["x", "Wt"],
                                                                                                ["logits"])],
        "lm_head", [x], [y], [onnx.numpy_helper.from_array(w, "W")])  # fmt: skip
    model = ir.serde.deserialize_model(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 20)],
                                                              ir_version=10))
    quantize = QuantizeWeights("int8")
    assert quantize(model).modified and quantize.record.lm_head is not None
    proto = ir.serde.serialize_model(model)
    assert [n.op_type for n in proto.graph.node] == ["MatMulNBits"] and not proto.graph.initializer[0].name == "W"
    feed = rng.standard_normal((2, 64)).astype(np.float32)
    got = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": feed})[0]
    want = feed @ w.T
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()


def test_int4_embeddings_are_gathered_from_their_blocks_within_half_a_step():
    """At 4 bits a Gather of a float32 table [V, H] becomes GatherBlockQuantized of its int4 blocks along H: each
    row gathered is the table's row to within half of its block's step (scale = the block's largest magnitude / 8),
    a row of zeros (a padding token's) exactly zero; the float32 table leaves the model."""
    import numpy as np
    import onnx_ir as ir
    import onnxruntime as ort

    from attnx.export.passes.quantize_weights import QuantizeWeights

    rng = np.random.default_rng(0)
    table = rng.standard_normal((50, 64)).astype(np.float32)
    table[0] = 0.0  # a padding row
    ids = onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1, 5])
    out = onnx.helper.make_tensor_value_info("h", onnx.TensorProto.FLOAT, [1, 5, 64])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Gather", ["E", "ids"], ["h"])], "embed", [ids], [out],
                                   [onnx.numpy_helper.from_array(table, "E")])  # fmt: skip
    model = ir.serde.deserialize_model(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 20)],
                                                              ir_version=10))  # fmt: skip
    quantize = QuantizeWeights("int4")
    assert quantize(model).modified and quantize.record.embeddings == "E" and quantize.record.kept == []
    proto = ir.serde.serialize_model(model)
    assert [n.op_type for n in proto.graph.node] == ["GatherBlockQuantized"]
    assert "E" not in {t.name for t in proto.graph.initializer}
    feed = np.array([[0, 3, 7, 49, 3]], np.int64)
    got = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"ids": feed})[0]
    want = table[feed]
    step = np.abs(want.reshape(1, 5, 2, 32)).max(-1, keepdims=True) / 8  # each block's scale
    assert np.all(np.abs(got - want).reshape(1, 5, 2, 32) <= step / 2 * (1 + 1e-6))
    assert np.all(got[0, 0] == 0) and np.abs(got - want).max() > 0  # rounded, not copied
