"""attnx optimize of whole models other tools exported (issue 40, attnx.workflows.optimize_model): the committed
fixtures' blocks rewritten into the ort-fused lowering's cores, spliced into the graph (the whole block, or the core
alone at MatMulNBits or fp16 projections kept as they are), the interface kept, proven (each new block against the
float64 reference and its checkpoint, the whole model's greedy tokens through its own cache) before anything is
written; repaired from the checkpoint where it states other terms, the graph's own formula kept and said without it;
a block no core takes, one not read, or one that would be rewritten into itself, kept and named."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import onnx
import pytest

from attnx.cli import main
from attnx.workflows import optimize_model
from attnx.workflows.rewrite.choose import Timing, candidates, pick
from tests.workflows import _gallery

# the same fixture models read again and again: each rotary table's named scaling searched once (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("rope_tables_named_once")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DYNAMO = FIXTURES / "exported" / "torch-dynamo"


def _proofs(report) -> list[str]:
    """Each proof of an optimize report as its line, as printed."""
    return [str(p) for p in report.proofs]


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
    report = optimize_model(str(source), str(out), checkpoint=str(checkpoint), core="gqa")
    assert report.passed and report.written and out.exists(), report.lines()
    assert report.blocks and all(b.written == "gqa" == b.choice.core for b in report.blocks)
    assert all(set(b.choice.times) == {"gqa"} and b.choice.before.cost() is not None for b in report.blocks)
    assert [b.layer for b in report.blocks] == list(range(len(report.blocks)))
    assert _io(out) == _io(source)  # whatever fed the model feeds its rewrite
    ops = {(n.domain, n.op_type) for n in onnx.load(str(out)).graph.node}
    assert ("com.microsoft", "GroupQueryAttention") in ops and ("", "Softmax") not in ops
    assert sum(line.startswith("pass: the whole model") for line in _proofs(report)) == 2
    assert set(report.model_times) == {"before", "after"} and all(t.error is None for t in report.model_times.values())


def test_each_core_is_the_one_its_measured_times_choose(tmp_path):
    """The default, --core measure: every core that computes a block is timed on the provider (MultiHeadAttention does
    not take a softcap: Gemma 2's blocks have GroupQueryAttention alone), and the graph's own block too; each block
    is what pick() makes of those times: the cheapest core, or kept where the graph's own is cheaper. Which one wins
    is the machine's (the times are not asserted here). Either way the model passes: a block kept is kept as the
    fastest, and OUT is written."""
    for export, checkpoint, cores in (("llama/sdpa-opset20", "llama", {"gqa", "grouped-mha", "switch"}),
                                      ("gemma2/eager-opset20", "gemma2", {"gqa"})):  # fmt: skip
        out = tmp_path / f"{checkpoint}.onnx"
        report = optimize_model(str(DYNAMO / export / "model.onnx"), str(out),
                                checkpoint=str(FIXTURES / "genai" / checkpoint / "checkpoint"))  # fmt: skip
        for b in report.blocks:
            assert set(b.choice.times) == cores and b.choice.before is not None
            assert (b.written, b.kept or b.choice.reason) == pick(b.choice.before, b.choice.times)
            # the report heads the times with the rule's own words, not the reason's text cut at a colon
            assert b.choice.head in ("the fastest", "none is faster") and b.choice.reason.startswith(b.choice.head)
            assert b.choice.fastest == (b.written is None), report.lines()
        assert report.passed and report.written and out.exists(), report.lines()


def test_an_encoder_whose_output_bias_is_added_after_its_block(tmp_path):
    """BERT as ONNX Runtime's optimizer fuses it: com.microsoft Attention reading each row's length (right padding),
    its output projection's bias added by the SkipLayerNormalization after it. Rewritten into MultiHeadAttention, the
    new block ends before that bias (added once), and the whole model runs a right-padded batch."""
    bert = FIXTURES / "exported" / "ort-optimizer" / "bert"
    report = optimize_model(str(bert / "model.onnx"), str(tmp_path / "out.onnx"), checkpoint=str(bert / "checkpoint"),
                            core="mha")  # fmt: skip
    assert report.passed and [b.written for b in report.blocks] == ["mha", "mha"], report.lines()
    assert any("full sequence of a right-padded batch: the same greedy tokens" in line for line in _proofs(report))
    ops = [n.op_type for n in onnx.load(str(tmp_path / "out.onnx")).graph.node]
    assert ops.count("SkipLayerNormalization") == 4 and "Attention" not in ops


def test_gpt2_s_packed_addmm_projections_are_rewritten_and_still_agree_with_transformers(tmp_path):
    """GPT-2 as torch.onnx exports it: q|k|v one Conv1D (torch's addmm: a Gemm on flattened tokens, shaped back, split
    three ways), learned absolute positions before the first layer. Every block is rewritten (into MultiHeadAttention,
    named: which core is fastest is the machine's, tested by pick()), the interface kept, and the rewrite agrees with transformers: the full sequence, a batch of 2,
    prefill + steps through its own cache, and a left-padded batch (fixturelib's checks, the fixtures' bound)."""
    from tests.fixtures import fixturelib

    home = DYNAMO / "gpt2"
    source, out = home / "sdpa-opset20" / "model.onnx", tmp_path / "out.onnx"
    report = optimize_model(str(source), str(out), checkpoint=str(home / "checkpoint"), core="mha")
    assert report.passed and report.written, report.lines()
    assert [b.layer for b in report.blocks] == [0, 1] and all(b.written for b in report.blocks), report.lines()
    assert not any(b.repairs for b in report.blocks) and _io(out) == _io(source)
    assert "Softmax" not in {n.op_type for n in onnx.load(str(out)).graph.node}
    model = fixturelib.load_eager(home / "checkpoint")
    agreement = fixturelib.check_decoder(out, model, [1, 23, 57, 101, 7, 200, 33, 145, 99, 250, 12, 64], 8)
    assert fixturelib.verdict("fp32", agreement), agreement
    padded = fixturelib.check_left_padded(out, model, [1, 23, 57, 101, 7, 200, 33, 145, 99, 250, 12, 64], 8, 3)
    assert not padded["errors"], padded
    assert max(padded["full"], padded["prefill"], *padded["steps"]) <= fixturelib.TOLERANCE["fp32"], padded


@pytest.mark.parametrize(("family", "export", "scaling"), [
    ("phi3", "eager-opset20", "table"),  # longrope: two tables, switched past 64 tokens
    pytest.param("llama", "sdpa-opset20", "llama3", marks=pytest.mark.slow),  # llama3, original 32 (the slow tier)
])  # fmt: skip
def test_a_scaled_rope_is_rewritten_without_a_checkpoint_and_agrees_with_transformers(family, export, scaling,
                                                                                      tmp_path):  # fmt: skip
    """The unseen set's scaled ropes, with no --checkpoint: the table the graph computes is read (Phi-3's longrope
    as the graph's own two tables and the length it switches at, found by running the graph; Llama's as llama3 with
    its parameters), every block rewritten and proven, and the model agrees with transformers on either side of the
    switch: 40 tokens (the short table) and 80 (the long one), full sequence and prefill + steps."""
    from tests.fixtures import fixturelib

    unseen = FIXTURES / "unseen"
    source, out = unseen / "exported" / "torch-dynamo" / family / export / "model.onnx", tmp_path / "out.onnx"
    report = optimize_model(str(source), str(out), core="grouped-mha")  # named: written whatever the times
    assert report.passed and all(b.written for b in report.blocks), report.lines()
    ropes = [b.config["rope"]["scaling"] for b in report.blocks]
    assert all(r["rope_type"] == scaling for r in ropes), ropes
    if scaling == "table":
        assert all(r["original_max_position_embeddings"] == 64 and len(r["long_inv_freq"]) == 8 for r in ropes)
    model = fixturelib.load_eager(unseen / "genai" / family / "checkpoint")
    for tokens in (40, 80):
        ids = [int(t) for t in np.random.default_rng(tokens).integers(1, 200, tokens)]
        agreement = fixturelib.check_decoder(out, model, ids, tokens - 3)
        assert fixturelib.verdict("fp32", agreement), (tokens, agreement)


def test_a_model_of_other_shapes_with_its_batch_fixed_at_one(tmp_path):
    """The unseen set's llama (head_dim 32, 3 layers, a llama3 rope) exported with its batch fixed at 1: every
    block rewritten, the whole model run on one row."""
    unseen = FIXTURES / "unseen"
    source = unseen / "exported" / "torch-dynamo" / "llama" / "sdpa-opset20-b1" / "model.onnx"
    report = optimize_model(str(source), str(tmp_path / "out.onnx"), checkpoint=str(unseen / "genai" / "llama" / "checkpoint"),
                            core="grouped-mha")  # fmt: skip
    assert report.passed and [b.written for b in report.blocks] == ["grouped-mha"] * 3, report.lines()
    assert _io(tmp_path / "out.onnx") == _io(source)
    assert sum("of one row (the model's batch is fixed at 1)" in line for line in _proofs(report)) == 2


def test_without_a_checkpoint_a_scaled_rope_is_read_as_the_graph_computes_it(tmp_path, capsys):
    """Llama 4's rotating layers use a llama3-scaled rope that no theta fits: without its checkpoint the table the
    graph computes is read and named (llama3, its factor and original length, found from the table alone), so every
    block is rewritten and proven against float64; through the CLI, with its JSON."""
    out, report_path = tmp_path / "out.onnx", tmp_path / "r.json"
    code = main(["optimize", str(DYNAMO / "llama4" / "eager-opset20" / "model.onnx"), "--out", str(out),
                 "--json", str(report_path), "--core", "gqa"])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads(report_path.read_text())
    assert [b["written"] for b in report["blocks"]] == ["gqa"] * 4
    assert all(b["config"]["rope"]["scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
               for b in report["blocks"][:3])  # fmt: skip
    assert text.count("rope llama3, theta 500000, factor 8, low_freq_factor 1, high_freq_factor 4, original 64, "
                      "interleaved;") == 3, text
    assert text.count("against the float64 reference") == 4 and "FAIL" not in text
    assert re.search(r"\n +3 +- +decomposed +gqa +[0-9.]+ -> [0-9.]+ +[0-9.]+ -> [0-9.]+\n", text), text
    assert "block 3: asked (--core gqa); a request (ms): the graph's " in text
    assert "optimize PASSED: 4 of 4 block(s) rewritten" in text
    assert report["blocks"][3]["choice"]["core"] == "gqa" and report["blocks"][3]["choice"]["before"]["step_ms"] > 0
    assert report["model_times"]["after"]["step_ms"] > 0 and "the whole model on cpu: prefill 512 " in text


def test_a_model_already_in_its_fastest_cores_passes_and_is_written_as_it_is(tmp_path, capsys):
    """The builder's int4 model: its GroupQueryAttention reads each row's length (seqlens_k) and may be fed one buffer
    of the model's whole length, which no other core reads; rewritten into itself it would be the same block, so each
    block is timed as it is and kept as the fastest, with its own formula said. Already fast is a pass: OUT is
    written, the same graph (exit 0), so a pipeline's next step finds it. A model with no block kept as the fastest
    and none rewritten still writes nothing (exit 1)."""
    source = FIXTURES / "genai" / "llama" / "int4" / "model.onnx"
    out = tmp_path / "out.onnx"
    assert main(["optimize", str(source), "--out", str(out), "--json", str(tmp_path / "r.json")]) == 0
    text = capsys.readouterr().out
    assert text.count("kept as the fastest: its own core (gqa) is the one that computes it under its inputs: the "
                      "rewrite would be the block itself") == 2, text
    assert "block 1 formula: the graph's own, 4 heads over 2; head_dim 16; scale 0.25; rope theta 10000 (no " in text
    assert re.search(r"block 1: timed; a request \(ms\): the graph's [0-9.]+\n", text), text
    assert "pass: no block rewritten: block(s) 0, 1 already in the fastest core" in text
    assert "optimize PASSED: 0 of 2 block(s) rewritten, 2 kept as the fastest; wrote " in text
    report = json.loads((tmp_path / "r.json").read_text())
    assert [b["choice"]["fastest"] for b in report["blocks"]] == [True, True] and report["written"]
    assert all(b["choice"]["before"]["step_ms"] > 0 for b in report["blocks"])
    written, given = onnx.load(str(out)), onnx.load(str(source))
    assert [n.op_type for n in written.graph.node] == [n.op_type for n in given.graph.node] and _io(out) == _io(source)


def test_a_model_with_no_block_rewritten_nor_kept_as_the_fastest_writes_nothing(tmp_path, capsys):
    """The builder's Gemma 2 with --core grouped-mha: no block is kept as the fastest (the core asked cannot take its
    softcap nor its lengths), none is rewritten: nothing to write (exit 1)."""
    out = tmp_path / "out.onnx"
    source = FIXTURES / "genai" / "gemma2" / "fp32" / "model.onnx"
    assert main(["optimize", str(source), "--out", str(out), "--core", "grouped-mha"]) == 1
    text = capsys.readouterr().out
    assert "FAIL: no block rewritten: nothing to write" in text and "kept as the fastest" not in text, text
    assert "optimize FAILED: 0 of 2 block(s) rewritten; nothing written" in text and not out.exists()


def _logits(path, ids: np.ndarray) -> np.ndarray:
    """A whole model's logits on one row of `ids` (the full sequence, no past), through ONNX Runtime's CPU."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(ids.shape[1])[None]}
    for spec in session.get_inputs():
        if spec.name.startswith("past"):  # no past: the head size where the builder names it (kv_cache_dim)
            size = spec.shape[3] if isinstance(spec.shape[3], int) else 16
            feeds[spec.name] = np.zeros((1, spec.shape[1], 0, size), np.float16 if "16" in spec.type else np.float32)
    names = {spec.name for spec in session.get_inputs()}
    return session.run(None, {k: v for k, v in feeds.items() if k in names})[0].astype(np.float64)


def _agrees_with_transformers(path, family_dir: Path, layers: int) -> tuple[bool, float]:
    """Whether a whole model's logits are transformers' (the fixture's reference.safetensors) within the tolerance
    table's whole-model row, and how far apart they are."""
    from safetensors.numpy import load_file

    from attnx.model.tolerance import ProblemSize, whole_model_tolerance
    from attnx.runtimes.compare import compare_arrays
    from attnx.workflows.rewrite.prove import longest_reduction

    ref = load_file(str(family_dir / "reference.safetensors"))
    got = _logits(path, ref["input_ids"])
    c = compare_arrays("logits", got, ref["logits"].astype(np.float64), whole_model_tolerance("fp32", layers),
                       ProblemSize(longest_reduction(str(path))))  # fmt: skip
    return bool(c), float(np.abs(got - ref["logits"]).max())


def test_the_builders_mistral_is_repaired_from_its_checkpoint_and_agrees_with_transformers(tmp_path):
    """The GenAI builder drops Mistral's window (local_window_size -1: transformers 5 writes no layer_types). With the
    checkpoint each GroupQueryAttention is rewritten with the checkpoint's window, its lengths (seqlens_k,
    total_sequence_length), cache and cos/sin caches bound as the graph has them: the model then gives transformers'
    logits, where the input is 1.65 off. Without it the graph's own formula (no window) is kept, and said."""
    family = FIXTURES / "genai" / "mistral"
    source, out = family / "fp32" / "model.onnx", tmp_path / "out.onnx"
    report = optimize_model(str(source), str(out), checkpoint=str(family / "checkpoint"))
    assert report.passed and [b.written for b in report.blocks] == ["gqa", "gqa"], report.lines()
    assert all(b.repairs == [f"layer {b.layer}: no window in the graph (local_window_size -1), sliding_window 8 in "
                             "the checkpoint: every query past 8 sees keys it must not"] for b in report.blocks)  # fmt: skip
    assert _io(out) == _io(source) and report.padding == "right"
    nodes = [n for n in onnx.load(str(out)).graph.node if n.op_type == "GroupQueryAttention"]
    assert [onnx.helper.get_attribute_value(a) for n in nodes for a in n.attribute
            if a.name == "local_window_size"] == [8, 8]  # fmt: skip
    assert all(n.input[7:9] == ["cos_cache", "sin_cache"] for n in nodes)  # the graph's own tables, not copied
    assert _agrees_with_transformers(out, family, 2)[0]
    fine, far = _agrees_with_transformers(source, family, 2)
    assert not fine and far > 1.0
    kept = optimize_model(str(source), str(tmp_path / "kept.onnx"))
    assert kept.passed and all("the rewrite would be the block itself" in b.kept and b.choice.fastest
                               for b in kept.blocks)  # fmt: skip
    assert all("sliding_window" not in b.formula for b in kept.blocks), kept.lines()


def test_quantized_projections_are_kept_and_the_core_alone_rewritten(tmp_path):
    """torch.onnx's llama with its projections quantized by ONNX Runtime's MatMulNBits quantizer (4 bits, blocks of
    16): each block's core is rewritten alone, bound at the projections' outputs, its z handed to the graph's own
    output projection; every MatMulNBits is kept as it was, and the whole model keeps its tokens."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)  # a line a node
    quantizer = MatMulNBitsQuantizer(onnx.load(str(DYNAMO / "llama" / "sdpa-opset20" / "model.onnx")), block_size=16,
                                     is_symmetric=True, accuracy_level=1)  # fmt: skip
    quantizer.process()
    source, out = tmp_path / "int4.onnx", tmp_path / "out.onnx"
    onnx.save(quantizer.model.model, str(source))
    report = optimize_model(str(source), str(out), checkpoint=str(FIXTURES / "genai" / "llama" / "checkpoint"),
                            core="gqa")  # fmt: skip
    assert report.passed and all(b.written for b in report.blocks), report.lines()
    assert {b.splice for b in report.blocks} == {"the core alone, at the graph's projections"} and not any(
        b.repairs for b in report.blocks)  # every int4 weight within its step of the checkpoint's
    assert sum(line.startswith("pass: the whole model") for line in _proofs(report)) == 2

    def nbits(path) -> list:  # each MatMulNBits' packed weights and scales, as bytes
        graph = onnx.load(str(path)).graph
        weights = {t.name: onnx.numpy_helper.to_array(t).tobytes() for t in graph.initializer}
        return sorted((weights[n.input[1]], weights[n.input[2]]) for n in graph.node if n.op_type == "MatMulNBits")

    assert nbits(out) == nbits(source) and "Softmax" not in {n.op_type for n in onnx.load(str(out)).graph.node}


def test_the_builders_fp16_model_comes_out_decoding(tmp_path):
    """The builder's fp16 CPU model (MultiHeadAttention on k and v repeated to every head, the cache concatenated)
    fails at its first decoding step in ONNX Runtime. Its cores rewritten alone in fp16 (GroupQueryAttention over the
    kv heads, bound at its fp16 projections and position_ids), the model decodes: the written model's steps are held
    to the input's full sequence, which runs, and give its greedy tokens within fp16's bound."""
    source, out = FIXTURES / "genai" / "llama" / "fp16" / "model.onnx", tmp_path / "out.onnx"
    report = optimize_model(str(source), str(out), core="gqa")
    assert report.passed and [b.written for b in report.blocks] == ["gqa", "gqa"], report.lines()
    assert any(line.startswith("said: the input fails to decode through its own cache (node ")
               for line in _proofs(report))  # fmt: skip
    assert any(line.startswith("pass: the whole model, prefill + steps (held to the input's full sequence) of a "
                               "left-padded batch: the same greedy tokens") for line in _proofs(report))  # fmt: skip
    assert _io(out) == _io(source)
    graph = onnx.load(str(out)).graph
    assert {n.op_type for n in graph.node} >= {"GroupQueryAttention", "Cast"} and not any(
        "repeat_kv" in n.name for n in graph.node)  # fmt: skip


def test_optimums_gemma2_is_rotated_at_the_positions_its_graph_counts(tmp_path):
    """Optimum's Gemma 2 has no position_ids input: its graph counts positions from the cache's length (a Range).
    Each new core rotates at that Range, expanded to every row. With the checkpoint the softcap Optimum drops is
    repaired and the model gives transformers' logits (the input is 1.5e-4 off); without it the graph's own formula
    (no softcap) is kept, said, and the whole model keeps the input's logits."""
    family = FIXTURES / "genai" / "gemma2"
    source = FIXTURES / "exported" / "optimum" / "gemma2" / "model.onnx"
    out = tmp_path / "out.onnx"
    report = optimize_model(str(source), str(out), checkpoint=str(family / "checkpoint"), core="gqa")
    assert report.passed and [b.written for b in report.blocks] == ["gqa", "gqa"], report.lines()
    assert [b.repairs for b in report.blocks] == [[f"layer {i}: softcap None in the graph, 50.0 in the checkpoint"]
                                                  for i in (0, 1)]  # fmt: skip
    graph = onnx.load(str(out)).graph
    expand = [n for n in graph.node if n.op_type == "Expand" and n.input[0] == "/model/Range_output_0"]
    assert len(expand) == 1 and "position_ids" not in {i.name for i in graph.input}
    assert _agrees_with_transformers(out, family, 2)[0] and not _agrees_with_transformers(source, family, 2)[0]
    kept = optimize_model(str(source), str(tmp_path / "kept.onnx"), core="gqa")
    assert kept.passed and all(b.written == "gqa" and "softcap" not in b.formula for b in kept.blocks), kept.lines()
    assert sum(line.startswith("pass: the whole model") for line in _proofs(kept)) == 2


@pytest.mark.parametrize(("export", "checkpoint"), [
    ("llama4/eager-opset20", DYNAMO / "llama4" / "checkpoint"),  # chunks, the norm after rope, the temperature
    ("qwen3/sdpa-opset23", FIXTURES / "genai" / "qwen3" / "checkpoint"),  # q/k norms
])  # fmt: skip
def test_the_grouped_core_is_written_and_read_back_in_every_block(export, checkpoint, tmp_path):
    """--core grouped-mha: MultiHeadAttention with a group's query heads as rows over past/present (each key/value
    head read once a step), its masks an additive bias over a token's rows; the audit reads it back (the proof of
    each block) and the whole model keeps its tokens."""
    out = tmp_path / "out.onnx"
    report = optimize_model(str(DYNAMO / export / "model.onnx"), str(out), checkpoint=str(checkpoint), core="grouped-mha")
    assert report.passed and {b.written for b in report.blocks} == {"grouped-mha"}, report.lines()
    assert sum(line.startswith(f"pass: block {b.index} (grouped-mha)") for b in report.blocks
               for line in _proofs(report)) == len(report.blocks)  # fmt: skip
    nodes = [n for n in onnx.load(str(out)).graph.node if n.op_type == "MultiHeadAttention"]
    assert len(nodes) == len(report.blocks) and all(len(n.input) == 8 and n.input[6] for n in nodes)  # past/present


def test_a_core_the_audit_cannot_read_back_is_never_a_candidate(monkeypatch):
    """Each written block is proven by auditing the written model, so a core with no block reader is not measured."""
    import dataclasses

    from attnx.export.cores import GRAPH_CORES
    from attnx.model import AttentionConfig
    from attnx.model.rope import Rope

    c = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, causal=True, kv_cache=True, key_padding_mask=True,
                        bias=False, rope=Rope(theta=10000.0, dim=16))  # fmt: skip
    assert candidates(c, "growing", "ort-fused") == ["gqa", "grouped-mha", "switch"]
    monkeypatch.setitem(GRAPH_CORES, "switch", dataclasses.replace(GRAPH_CORES["switch"], read_block=None))
    assert candidates(c, "growing", "ort-fused") == ["gqa", "grouped-mha"]


def test_the_auto_core_is_written_read_back_and_proven_in_every_block(tmp_path, monkeypatch):
    """The growing auto core (an If: GroupQueryAttention with no bias for a prompt with no padding, the grouped core
    otherwise) spliced into a whole model: its branches read the model's own tensors, the audit reads each If back as
    one block and runs both branches against the float64 reference (the full sequence takes GroupQueryAttention, the
    padded batch and the steps the grouped core), and the whole model keeps its tokens. Measured, it is one
    candidate among the others; here it is the only one and chosen whatever the times (a tiny block's are noise), so
    that it is the one written."""
    import attnx.workflows.rewrite.choose as choose

    every = choose.candidates
    monkeypatch.setattr(choose, "candidates", lambda *a, **k: [c for c in every(*a, **k) if c == "switch"])
    monkeypatch.setattr(choose, "pick", lambda before, times, *a, **k: ("switch", "the test's choice"))
    out = tmp_path / "out.onnx"
    report = optimize_model(str(DYNAMO / "llama" / "sdpa-opset20" / "model.onnx"), str(out),
                            checkpoint=str(FIXTURES / "genai" / "llama" / "checkpoint"))  # fmt: skip
    assert report.passed and {b.written for b in report.blocks} == {"switch"}, report.lines()
    assert sum(line.startswith(f"pass: block {b.index} (switch)") for b in report.blocks
               for line in _proofs(report)) == len(report.blocks)  # fmt: skip
    graph = onnx.load(str(out)).graph
    ifs = [n for n in graph.node if n.op_type == "If"]
    assert len(ifs) == len(report.blocks)
    ops = {n.op_type for node in ifs for a in node.attribute for n in a.g.node}
    assert {"MultiHeadAttention", "GroupQueryAttention"} <= ops
    # what the blocks compute alike from the model's inputs is computed once (attnx.export.passes.share): the
    # rotary table, the If's condition and the token grid
    assert sum(n.op_type == "Cos" and n.name.startswith("attnx/") for n in graph.node) == 1
    assert len({n.input[0] for n in ifs}) == 1
    rotations = [n for n in graph.node if n.op_type == "RotaryEmbedding"]
    assert len(rotations) == 2 * len(report.blocks) and len({tuple(n.input[1:]) for n in rotations}) == 1


def test_pick_writes_the_cheapest_core_and_keeps_a_faster_graph():
    """The rule on given numbers (times are measured, so the rule is tested apart from them): a request is a prompt
    and TIME_SHAPE's steps; the cheapest candidate is written, the graph's own block kept where it is cheaper, a
    candidate that was not timed passed over."""
    own = Timing(10.0, 1.0)  # 10 + 128 * 1.0 = 138 ms a request
    core, why = pick(own, {"gqa": Timing(9.0, 0.5), "grouped-mha": Timing(12.0, 0.4)})
    assert core == "grouped-mha" and "the fastest: 63.2 ms a request (the graph's own 138 ms); gqa 73" in why
    core, why = pick(Timing(1.0, 0.1), {"gqa": Timing(9.0, 0.5)})
    assert core is None and why.startswith("none is faster: the graph's own block costs 13.8 ms a request")
    core, _ = pick(own, {"gqa": Timing(error="Gather: index out of range"), "grouped-mha": Timing(12.0, 0.4)})
    assert core == "grouped-mha"
    core, why = pick(own, {"gqa": Timing(error="boom")})
    assert core is None and "gqa: boom" in why
    assert pick(None, {"mha": Timing(3.0)}) == ("mha", "the fastest: 3 ms a request")  # no cache: the prompt alone


def test_a_provider_that_is_not_here_is_refused_before_anything_is_read(tmp_path, capsys):
    """--provider cuda on a machine whose CUDA provider does not start: one line, exit 2, nothing written (never the
    CPU in its place)."""
    from attnx.runtimes.base import backend_unavailable_reason

    if backend_unavailable_reason("ort-cuda") is None:
        pytest.skip("the CUDA provider starts here: nothing to refuse")
    out = tmp_path / "o.onnx"
    assert main(["optimize", str(DYNAMO / "llama" / "sdpa-opset20" / "model.onnx"), "--out", str(out),
                 "--provider", "cuda"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "--provider cuda: backend 'ort-cuda' is unavailable" in err and not out.exists()


def test_the_flags_of_an_attnx_model_are_refused_for_a_whole_model_and_the_other_way(tmp_path, capsys):
    source = str(DYNAMO / "llama" / "sdpa-opset20" / "model.onnx")
    assert main(["optimize", source, "--out", str(tmp_path / "o.onnx"), "--dtype", "fp16"]) == 2
    assert "--dtype is for a model attnx wrote" in capsys.readouterr().err
    assert main(["optimize", source, "--out", source]) == 2
    assert not (tmp_path / "o.onnx").exists()


def test_the_whole_model_proof_fails_past_the_tolerance_tables_bound_and_names_where(tmp_path):
    """The whole-model proof holds the logits to the tolerance table's whole-model row (whole_model_tolerance), not to
    the greedy tokens alone: the lm_head's weights scaled by 1 + 1e-3 keep every greedy token yet move the logits past
    the bound; the proof fails and names the first row and position past it."""
    from numpy.testing import assert_array_less

    from attnx.model.tolerance import whole_model_tolerance
    from attnx.workflows.rewrite.prove import same_model
    from attnx.workflows.rewrite.report import ModelOptimizeReport

    source = DYNAMO / "llama" / "sdpa-opset20" / "model.onnx"
    model = onnx.load(str(source))
    head = next(n for n in reversed(model.graph.node) if n.op_type == "MatMul")
    weight = next(t for t in model.graph.initializer if t.name == head.input[1])
    scaled = onnx.numpy_helper.to_array(weight) * (1 + 1e-3)
    weight.CopyFrom(onnx.numpy_helper.from_array(scaled.astype(np.float32), weight.name))
    onnx.save(model, str(tmp_path / "scaled.onnx"))
    report = ModelOptimizeReport(str(source), "", None, [], [])
    assert same_model(report, str(source), str(source)), report.proofs  # itself: within the bound
    report = ModelOptimizeReport(str(source), "", None, [], [])
    assert not same_model(report, str(source), str(tmp_path / "scaled.onnx")), report.proofs
    assert all(line.startswith("FAIL: the whole model") and "the same greedy tokens" in line
               and "(first logits past the bound at row 0, position " in line for line in _proofs(report))  # fmt: skip
    assert_array_less(whole_model_tolerance("fp32", 1).ulps, whole_model_tolerance("fp32", 4).ulps)


class _Logits:
    """A stand-in for a loaded whole model (input_ids, attention_mask -> logits, no cache): each real position's
    logits a function of its token alone; `fault` what a padded batch makes of it: "padding" NaN at the padding
    positions (a row that sees no key), "spreads" NaN at every position of a padded row (that NaN carried through keys
    its mask hides: 0 * NaN), "real" NaN wherever the token it is first fed at row 1, position 5 comes (a real
    position, padded or not)."""

    def __init__(self, fault: str | None = None) -> None:
        from attnx.model.config import TensorSpec

        self.fault = fault
        self.token = None
        self.inputs = [TensorSpec("input_ids", "int64", ("batch", "sequence")),
                       TensorSpec("attention_mask", "int64", ("batch", "sequence"))]  # fmt: skip
        # its vocabulary not declared: the proof's token ids below 100, each of its 7 logits a function of the id
        self.outputs = [TensorSpec("logits", "float32", ("batch", "sequence", "vocab"))]

    def run(self, feeds):
        ids, mask = feeds["input_ids"], feeds["attention_mask"]
        logits = np.sin(ids[..., None] * np.arange(1, 8)).astype(np.float32)
        padded = mask == 0
        if self.fault == "padding":
            logits[padded] = np.nan
        elif self.fault == "spreads":
            logits[padded.any(axis=1)] = np.nan
        elif self.fault == "real":
            self.token = ids[1, 5] if self.token is None else self.token
            logits[ids == self.token] = np.nan
        return {"logits": logits}


@pytest.mark.parametrize(("before", "after", "passed", "said"), [
    (None, "padding", True, None),  # the written model's padding positions: no meaning, never compared
    ("padding", None, True, None),  # the input's
    ("spreads", None, True, "said: the input's logits at row 1's own positions are not finite in the padded batch"),
    (None, "real", False, "the written model's logits not finite at row 1, position 5"),
    ("real", None, False, "the input's logits not finite at row 1, position 5"),
])  # fmt: skip
def test_padding_positions_never_enter_the_whole_model_proof(before, after, passed, said):
    """A padding position's output has no meaning: the whole-model proof compares real positions alone, and where the
    input's padding spreads into its real positions (a NaN through a hidden key), that row is held to the input's run
    of it alone. A NaN at a real position is a failure named by its row and position."""
    from attnx.model.tolerance import ProblemSize, whole_model_tolerance
    from attnx.workflows.rewrite.prove import same_tokens
    from attnx.workflows.rewrite.report import ModelOptimizeReport

    report = ModelOptimizeReport("in.onnx", "", None, [], [])
    ok = same_tokens(report, _Logits(before), _Logits(after), False, whole_model_tolerance("fp32", 1), ProblemSize(7))
    assert ok == passed == all(report.proofs), report.proofs  # a proof is false for a failure alone
    verdicts = [line for line in _proofs(report) if "the whole model" in line]
    assert len(verdicts) == 1 and verdicts[0].startswith("pass" if passed else "FAIL") and "nan" not in verdicts[0]
    assert said is None or said in "\n".join(_proofs(report)), report.proofs


def test_a_gemma2_fault_whose_padding_rows_see_no_key_is_judged_at_real_positions(tmp_path):
    """Gemma 2 (torch.onnx dynamo) with layer 0's masked scores scaled by 1.25 after its softcap: 1.25 * 50 tanh(s /
    50) is no softcap of the formula (it was once read as the scale inside it, 50 tanh(1.25 s / 50), and rewritten on
    that guess), so layer 0 is not read: kept as it is and named with the reason, and layer 1 alone is rewritten
    and proven. The whole model is then judged at real positions: row 0 (no padding) agrees, as both models compute
    layer 0 alike. The kept fault still breaks the padded row: the export's finfo.min mask times 1.25 overflows to
    -inf, so a left-padded row's padding positions see no key and give NaN, which layer 1 carries into that row's
    real positions (0 * NaN through keys its mask hides) in the input and in the written model alike. The input's
    padded row is held to its run alone (finite), which the written model, keeping layer 0, cannot meet: the proof
    fails at row 1 only, and nothing is written. Scaled inside the softcap instead, the fault is in both models and
    the proof passes."""
    from onnx import helper, numpy_helper

    proto = onnx.load(str(DYNAMO / "gemma2" / "eager-opset20" / "model.onnx"))
    softmax, layer_1 = (n for n in proto.graph.node if n.op_type == "Softmax")
    proto.graph.initializer.append(numpy_helper.from_array(np.array(1.25, np.float32), "planted"))
    proto.graph.node.insert(list(proto.graph.node).index(softmax),
                            helper.make_node("Mul", [softmax.input[0], "planted"], ["planted_scores"]))  # fmt: skip
    softmax.input[0] = "planted_scores"
    source = tmp_path / "model.onnx"
    onnx.save(proto, str(source))
    report = optimize_model(str(source), str(tmp_path / "out.onnx"), core="gqa")
    assert f"not read: node {softmax.name}: not read as attention: a Mul by 1.25 after the softcap: no term explains " \
           "it" in _proofs(report), report.proofs  # fmt: skip
    assert [(b.node, b.written) for b in report.blocks] == [(layer_1.name, "gqa")], report.blocks
    assert any(line.startswith("pass: block 0 (gqa)") for line in _proofs(report)), report.proofs
    assert any(line.startswith("said: the input's logits at row 1's own positions are not finite") for line in
               _proofs(report)), report.proofs  # fmt: skip
    verdicts = [line for line in _proofs(report) if "the whole model," in line]
    assert len(verdicts) == 2 and all(line.startswith("FAIL") and "first logits past the bound at row 1, " in line
                                      and "the written model's logits not finite at row 1" in line
                                      for line in verdicts), verdicts  # fmt: skip
    assert not report.passed and not (tmp_path / "out.onnx").exists()

    proto = onnx.load(str(DYNAMO / "gemma2" / "eager-opset20" / "model.onnx"))
    scale = next(n for n in proto.graph.node if n.op_type == "Mul" and n.input[0] == "matmul")  # q.k * scale
    value = next(t for t in proto.graph.initializer if t.name == scale.input[1])
    proto.graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(value) * np.float32(1.25), "planted"))
    scale.input[1] = "planted"
    onnx.save(proto, str(source))
    report = optimize_model(str(source), str(tmp_path / "out.onnx"), core="gqa")
    assert report.passed and sum(line.startswith("pass: the whole model") for line in _proofs(report)) == 2, \
        report.proofs  # fmt: skip


def test_a_model_with_external_data_is_written_with_its_own(tmp_path):
    """A model whose tensors lie in model.onnx.data: OUT's tensors are written, one at a time, into OUT.onnx.data
    beside it (its location relative), never pointing into the input's data file; OUT loads and is proven."""
    import os
    import stat

    source = tmp_path / "in" / "model.onnx"
    source.parent.mkdir()
    onnx.save(onnx.load(str(DYNAMO / "llama" / "sdpa-opset20" / "model.onnx")), str(source), save_as_external_data=True,
              location="model.onnx.data", size_threshold=1024)  # fmt: skip
    out = tmp_path / "out" / "opt.onnx"
    out.parent.mkdir()
    report = optimize_model(str(source), str(out), checkpoint=str(FIXTURES / "genai" / "llama" / "checkpoint"),
                            core="gqa")  # fmt: skip
    assert report.passed and report.written, report.lines()
    proto = onnx.load(str(out), load_external_data=False)
    locations = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"opt.onnx.data"} and sorted(os.listdir(out.parent)) == ["opt.onnx", "opt.onnx.data"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((out.parent / "opt.onnx.data").stat().st_mode) == 0o666 & ~umask
    assert _io(out) == _io(source) and len(onnx.load(str(out)).graph.initializer) == len(proto.graph.initializer)


@pytest.mark.parametrize(("model", "checkpoint", "fault", "layer", "fixed"), [
    # a decomposed core's scale: rewritten either way, as the graph states it or as the checkpoint does
    ("exported/torch-dynamo/llama/sdpa-opset20", "genai/llama/checkpoint", "scale x1.2", 1, "scale 0.3 in the graph"),
    # MatMulNBits kept: the core alone rewritten, with the checkpoint's scale
    ("genai/llama/int4", "genai/llama/checkpoint", "scale x1.2", 0, "scale 0.3 in the graph"),
    # the op's own rotation on the other pairs: the checkpoint's table written, not the graph's
    ("genai/qwen2/fp32", "genai/qwen2/checkpoint", "rotary interleaved", 1, "rotary_interleaved 1 in the graph"),
])  # fmt: skip
def test_a_planted_fault_is_kept_without_the_checkpoint_and_repaired_in_its_layer_with_it(
        model, checkpoint, fault, layer, fixed, tmp_path):  # fmt: skip
    """The audit's gallery plants a fault in one layer (tests/workflows/_gallery.py). Without --checkpoint the graph's
    formula is what is written (or the block is kept where that would be the block itself), the fault included,
    never fixed on a guess, and the block's formula is said. With it, that layer alone is repaired, the repair named
    in its layer, and its new block is held to the checkpoint's layer."""
    proto = onnx.load(str(FIXTURES / model / "model.onnx"))
    said = _gallery.FAULTS[fault](proto, layer, _gallery.checkpoint_layers(str(FIXTURES / checkpoint)))
    assert said is not None
    source = tmp_path / "model.onnx"
    onnx.save(proto, str(source))
    core = "gqa" if "-opset" in model else "measure"  # a builder's block: measured, as a user runs it
    faulty = optimize_model(str(source), str(tmp_path / "kept.onnx"), core=core)
    if "-opset" in model:  # decomposed: rewritten into the graph's own formula, whose tokens the input's are
        assert faulty.passed and faulty.blocks[layer].written == "gqa", faulty.lines()
        assert sum(line.startswith("pass: the whole model") for line in _proofs(faulty)) == 2
    else:  # GroupQueryAttention already: the same core, the same formula
        assert faulty.passed and not any(b.written for b in faulty.blocks) and faulty.blocks[layer].choice.fastest
        assert "the rewrite would be the block itself" in faulty.blocks[layer].kept
    assert not any(b.repairs for b in faulty.blocks)
    graph_said = {"scale x1.2": "scale 0.3;", "rotary interleaved": ", interleaved"}[fault]
    assert graph_said in faulty.blocks[layer].formula and all(
        graph_said not in b.formula for b in faulty.blocks if b.index != layer)  # fmt: skip
    repaired = optimize_model(str(source), str(tmp_path / "out.onnx"), checkpoint=str(FIXTURES / checkpoint),
                              core=core)  # fmt: skip
    assert repaired.passed and repaired.blocks[layer].written == "gqa", repaired.lines()
    assert [(b.layer, r.split(":")[0]) for b in repaired.blocks for r in b.repairs] == [(layer, f"layer {layer}")]
    assert repaired.blocks[layer].repairs[0].startswith(f"layer {layer}: {fixed}")
    assert f"block {layer} repair: layer {layer}: {fixed}" in "\n".join(repaired.lines())
    assert any(line.startswith(f"pass: block {layer} (gqa) against the float64 reference and the checkpoint")
               for line in _proofs(repaired))  # fmt: skip
    if "int4" in model:  # its projections kept as they were
        assert "MatMulNBits" in {n.op_type for n in onnx.load(str(tmp_path / "out.onnx")).graph.node}


@pytest.mark.parametrize("core", ["grouped-mha", "switch"])
def test_a_block_splits_into_what_the_model_shares_and_its_own_part(core):
    """What a block computes from the model's inputs alone (its rotary table from position_ids, its token grid from
    the padding mask) cut apart from the rest, as the choice times it (split_shared: the written model computes it
    once for all its blocks): the shared part reads neither x nor the cache, the rest reads what it makes, and the
    two run one after the other give the whole block's outputs exactly."""
    import onnxruntime as ort

    from attnx.export import build_model
    from attnx.model import AttentionConfig, init_weights
    from attnx.model.rope import Rope
    from attnx.workflows.rewrite.choose import split_shared

    c = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, causal=True, kv_cache=True, bias=False,
                        rope=Rope(theta=10000.0, dim=16), key_padding_mask=True)  # fmt: skip
    model = build_model(c, init_weights(c, seed=3), "ort-fused", "growing", core=core)
    shared, rest = split_shared(model, {"x", "past_key", "past_value"})
    assert {i.name for i in shared.graph.input} == {"position_ids", "key_padding_mask"}
    assert {"Cos", "Sin", "Range"} <= {n.op_type for n in shared.graph.node}
    assert {o.name for o in shared.graph.output} <= {i.name for i in rest.graph.input}
    rng = np.random.default_rng(0)
    for past, tokens in ((0, 7), (6, 1)):  # a prompt, a step
        feeds = {"x": rng.standard_normal((2, tokens, 64)).astype(np.float32),
                 "past_key": rng.standard_normal((2, 2, past, 16)).astype(np.float32),
                 "past_value": rng.standard_normal((2, 2, past, 16)).astype(np.float32),
                 "key_padding_mask": np.zeros((2, past + tokens), bool),
                 "position_ids": np.tile(np.arange(past, past + tokens), (2, 1))}  # fmt: skip
        whole = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        first = ort.InferenceSession(shared.SerializeToString(), providers=["CPUExecutionProvider"])
        second = ort.InferenceSession(rest.SerializeToString(), providers=["CPUExecutionProvider"])
        made = dict(zip([o.name for o in first.get_outputs()],
                        first.run(None, {i.name: feeds[i.name] for i in first.get_inputs()})))  # fmt: skip
        both = {**feeds, **made}
        outputs = second.run(None, {i.name: both[i.name] for i in second.get_inputs()})
        for a, b in zip(outputs, whole.run(None, feeds)):
            assert np.array_equal(a, b)


def test_a_block_whose_mask_reads_an_input_the_rewrite_does_not_bind_is_kept(tmp_path):
    """A graph whose padding mask is an input of its own (attnx's key_padding_mask), not transformers' attention_mask:
    a core written without it would drop the mask (the written model differed by 0.43 while every proof held); the
    block is kept, the input named."""
    import onnx

    from attnx.export import build_model
    from attnx.model import AttentionConfig, init_weights
    from attnx.workflows.audit.whole import open_whole_model
    from attnx.workflows.rewrite import _optimize_model

    config = AttentionConfig(d_model=32, n_heads=4, causal=True, key_padding_mask=True)
    onnx.save(build_model(config, init_weights(config, 0), "decomposed", "full"), tmp_path / "in.onnx")
    report = _optimize_model(open_whole_model(str(tmp_path / "in.onnx")), str(tmp_path / "out.onnx"))
    assert [b.written for b in report.blocks] == [None] and not (tmp_path / "out.onnx").exists()
    assert "its mask reads the graph input key_padding_mask" in report.blocks[0].kept
