"""attnx optimize of whole models other tools exported (issue 40's first slice, attnx.workflows.optimize_model): the
committed fixtures' blocks rewritten into the ort-fused lowering's cores, spliced into the graph, the interface kept,
proven (each new block against the float64 reference and its checkpoint, the whole model's greedy tokens through its
own cache) before anything is written; a block no core takes, or one not read, kept and named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest

from attnx.cli import main
from attnx.workflows import optimize_model
from attnx.workflows.rewrite.choose import Timing, pick

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
    report = optimize_model(str(source), str(out), checkpoint=str(checkpoint), core="gqa")
    assert report.passed and report.written and out.exists(), report.lines()
    assert report.blocks and all(b.written == "gqa" == b.choice.core for b in report.blocks)
    assert all(set(b.choice.times) == {"gqa"} and b.choice.before.cost() is not None for b in report.blocks)
    assert [b.layer for b in report.blocks] == list(range(len(report.blocks)))
    assert _io(out) == _io(source)  # whatever fed the model feeds its rewrite
    ops = {(n.domain, n.op_type) for n in onnx.load(str(out)).graph.node}
    assert ("com.microsoft", "GroupQueryAttention") in ops and ("", "Softmax") not in ops
    assert sum(line.startswith("pass: the whole model") for line in report.proofs) == 2
    assert set(report.model_times) == {"before", "after"} and all(t.error is None for t in report.model_times.values())


def test_each_core_is_the_one_its_measured_times_choose(tmp_path):
    """The default, --core auto: every core that computes a block is timed on the provider (MultiHeadAttention does
    not take a softcap: Gemma 2's blocks have GroupQueryAttention alone), and the graph's own block too; each block
    is what pick() makes of those times: the cheapest core, or kept where the graph's own is cheaper. Which one wins
    is the machine's (the times are not asserted here)."""
    for export, checkpoint, cores in (("llama/sdpa-opset20", "llama", {"gqa", "grouped-mha"}),
                                      ("gemma2/eager-opset20", "gemma2", {"gqa"})):  # fmt: skip
        report = optimize_model(str(DYNAMO / export / "model.onnx"), str(tmp_path / "out.onnx"),
                                checkpoint=str(FIXTURES / "genai" / checkpoint / "checkpoint"))  # fmt: skip
        for b in report.blocks:
            assert set(b.choice.times) == cores and b.choice.before is not None
            assert (b.written, b.kept or b.choice.reason) == pick(b.choice.before, b.choice.times)
        assert report.passed == any(b.written for b in report.blocks), report.lines()


def test_an_encoder_whose_output_bias_is_added_after_its_block(tmp_path):
    """BERT as ONNX Runtime's optimizer fuses it: com.microsoft Attention reading each row's length (right padding),
    its output projection's bias added by the SkipLayerNormalization after it. Rewritten into MultiHeadAttention, the
    new block ends before that bias (added once), and the whole model runs a right-padded batch."""
    bert = FIXTURES / "exported" / "ort-optimizer" / "bert"
    report = optimize_model(str(bert / "model.onnx"), str(tmp_path / "out.onnx"), checkpoint=str(bert / "checkpoint"),
                            core="mha")  # fmt: skip
    assert report.passed and [b.written for b in report.blocks] == ["mha", "mha"], report.lines()
    assert any("full sequence of a right-padded batch: the same greedy tokens" in line for line in report.proofs)
    ops = [n.op_type for n in onnx.load(str(tmp_path / "out.onnx")).graph.node]
    assert ops.count("SkipLayerNormalization") == 4 and "Attention" not in ops


def test_gpt2_s_packed_addmm_projections_are_rewritten_and_still_agree_with_transformers(tmp_path):
    """GPT-2 as torch.onnx exports it: q|k|v one Conv1D (torch's addmm: a Gemm on flattened tokens, shaped back, split
    three ways), learned absolute positions before the first layer. Every block is rewritten into the fastest fused
    core (measured), the interface kept, and the rewrite agrees with transformers: the full sequence, a batch of 2,
    prefill + steps through its own cache, and a left-padded batch (fixturelib's checks, the fixtures' bound)."""
    from tests.fixtures import fixturelib

    home = DYNAMO / "gpt2"
    source, out = home / "sdpa-opset20" / "model.onnx", tmp_path / "out.onnx"
    report = optimize_model(str(source), str(out), checkpoint=str(home / "checkpoint"))
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


def test_a_model_of_other_shapes_with_its_batch_fixed_at_one(tmp_path):
    """The unseen set's llama (head_dim 32, 3 layers, a llama3 rope) exported with its batch fixed at 1: every
    block rewritten, the whole model run on one row."""
    unseen = FIXTURES / "unseen"
    source = unseen / "exported" / "torch-dynamo" / "llama" / "sdpa-opset20-b1" / "model.onnx"
    report = optimize_model(str(source), str(tmp_path / "out.onnx"), checkpoint=str(unseen / "genai" / "llama" / "checkpoint"),
                            core="grouped-mha")  # fmt: skip
    assert report.passed and [b.written for b in report.blocks] == ["grouped-mha"] * 3, report.lines()
    assert _io(tmp_path / "out.onnx") == _io(source)
    assert sum("of one row (the model's batch is fixed at 1)" in line for line in report.proofs) == 2


def test_without_a_checkpoint_a_block_not_read_is_kept_and_named(tmp_path, capsys):
    """Llama 4's rotating layers use a llama3-scaled rope that no theta fits: without its checkpoint the block is
    not read, so it is kept as it is and said; the NoPE layer is rewritten; through the CLI, with its JSON."""
    out, report_path = tmp_path / "out.onnx", tmp_path / "r.json"
    code = main(["optimize", str(DYNAMO / "llama4" / "eager-opset20" / "model.onnx"), "--out", str(out),
                 "--json", str(report_path), "--core", "gqa"])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads(report_path.read_text())
    assert [b["written"] for b in report["blocks"]] == [None, None, None, "gqa"]
    assert all("a scaled rope" in b["kept"] for b in report["blocks"][:3])
    assert re.search(r"\n +3 +- +decomposed +gqa +[0-9.]+ -> [0-9.]+ +[0-9.]+ -> [0-9.]+\n", text), text
    assert "block 3: asked (--core gqa); a request (ms): the graph's " in text
    assert "optimize PASSED: 1 of 4 block(s) rewritten" in text
    assert report["blocks"][3]["choice"]["core"] == "gqa" and report["blocks"][3]["choice"]["before"]["step_ms"] > 0
    assert report["model_times"]["after"]["step_ms"] > 0 and "the whole model on cpu: prefill 512 " in text


def test_a_model_with_no_block_to_rewrite_writes_nothing(tmp_path, capsys):
    """The builder's int4 model: its projections are MatMulNBits, kept in this version; with nothing rewritten
    nothing is written (exit 1), and the reason of each block is said."""
    source = FIXTURES / "genai" / "llama" / "int4" / "model.onnx"
    out = tmp_path / "out.onnx"
    assert main(["optimize", str(source), "--out", str(out)]) == 1
    text = capsys.readouterr().out
    assert "MatMulNBits 4-bit: kept in this version" in text and "nothing written" in text
    assert not out.exists()


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
               for line in report.proofs) == len(report.blocks)  # fmt: skip
    nodes = [n for n in onnx.load(str(out)).graph.node if n.op_type == "MultiHeadAttention"]
    assert len(nodes) == len(report.blocks) and all(len(n.input) == 8 and n.input[6] for n in nodes)  # past/present


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
               and "(first logits past the bound at row 0, position " in line for line in report.proofs)  # fmt: skip
    assert_array_less(whole_model_tolerance("fp32", 1).ulps, whole_model_tolerance("fp32", 4).ulps)


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
    report = optimize_model(str(source), str(out), checkpoint=str(FIXTURES / "genai" / "llama" / "checkpoint"))
    assert report.passed and report.written, report.lines()
    proto = onnx.load(str(out), load_external_data=False)
    locations = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"opt.onnx.data"} and sorted(os.listdir(out.parent)) == ["opt.onnx", "opt.onnx.data"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((out.parent / "opt.onnx.data").stat().st_mode) == 0o666 & ~umask
    assert _io(out) == _io(source) and len(onnx.load(str(out)).graph.initializer) == len(proto.graph.initializer)
