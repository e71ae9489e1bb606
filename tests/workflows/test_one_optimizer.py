"""One optimizer (issue 52): `attnx optimize` takes every model through attnx.workflows.optimize_model, a model attnx
wrote as a whole model with one block; the flags of one kind of model are refused (exit 2) for the other, and the
report (printed and --json) is one report. The model is parsed once per command, whichever flags it is given."""

from __future__ import annotations

import json
import os
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest

from attnx.cli import main
from attnx.export.passes import count_ops
from attnx.workflows import optimize_model
from tests.workflows.test_parse_once import Parses

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
WHOLE = FIXTURES / "exported" / "torch-dynamo" / "llama" / "sdpa-opset20" / "model.onnx"


def _meta(path) -> dict[str, str]:
    return {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}


def test_a_model_attnx_wrote_is_one_block_in_the_report_and_its_json(exported, tmp_path, capsys):
    out, report_path = tmp_path / "o.onnx", tmp_path / "r.json"
    argv = ["optimize", exported("causal_kpm"), "--out", str(out), "--attention", "onnx", "--json", str(report_path)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    # the table's row: block 0, no checkpoint layer, the graph's core, the core written
    assert any(line.split()[:4] == ["0", "-", "decomposed", "attention23"] for line in printed.splitlines()), printed
    report = json.loads(report_path.read_text())
    assert report["passed"] and report["written"] and report["checkpoint"] is None
    (block,) = report["blocks"]
    assert (block["core"], block["written"], block["kept"]) == ("decomposed", "attention23", None)
    assert block["config"]["causal"] and block["config"]["scale"] == 0.2
    statuses = [p["status"] for p in report["proof_results"]]
    assert statuses.count("pass") == 4 and "fail" not in statuses  # the file's checks and y at three shapes
    assert _meta(out)["attnx.attention"] == "onnx"


def test_a_core_named_or_measured_within_the_lowering(exported, tmp_path):
    named = optimize_model(exported("kpm"), str(tmp_path / "gqa.onnx"), core="gqa")
    assert named.passed and named.blocks[0].written == "gqa"
    assert count_ops(ir.load(str(tmp_path / "gqa.onnx"))).get("com.microsoft.GroupQueryAttention") == 1
    measured = optimize_model(exported("kpm"), str(tmp_path / "m.onnx"), core="measure", auto_seq=32)
    choice = measured.blocks[0].choice
    assert measured.passed and set(choice.times) == {"mha", "gqa"} and choice.shape["prefill"] == 32
    assert choice.core == measured.blocks[0].written == min(choice.times, key=lambda n: choice.times[n].prefill_ms)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--checkpoint", "ckpt"], "--checkpoint is for a whole model another tool exported"),
    (["--weights", "int4"], "--weights is for a whole model another tool exported"),
    (["--core", "decomposed"], "--core decomposed: the ort-fused lowering writes no decomposed core"),
    (["--attention", "measure", "--core", "mha"], "--core mha is one core of one lowering"),
    (["--core", "gqa"], "--core gqa does not compute this model: com.microsoft.GroupQueryAttention does not express "
                        "cross"),
])  # fmt: skip
def test_what_a_model_attnx_wrote_does_not_take_exits_2(exported, tmp_path, capsys, argv, needle):
    out = tmp_path / "o.onnx"
    assert main(["optimize", exported("cross_kpm"), "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0], err
    assert not out.exists()


@pytest.mark.parametrize(("argv", "needle"), [
    (["--dtype", "fp16"], "--dtype is for a model attnx wrote"),
    (["--auto-seq", "64"], "--auto-seq is for a model attnx wrote"),
    (["--keep-io-fp32"], "--keep-io-fp32 is for a model attnx wrote"),
    (["--block-size", "64"], "--block-size is for a model attnx wrote"),
    (["--int8-bits", "7"], "--int8-bits is for a model attnx wrote"),
    (["--attention", "measure", "--core", "mha"], "--core mha is one core of one lowering"),
])  # fmt: skip
def test_what_a_whole_model_does_not_take_exits_2(tmp_path, capsys, argv, needle):
    out = tmp_path / "o.onnx"
    assert main(["optimize", str(WHOLE), "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not out.exists()


def test_a_model_attnx_wrote_is_parsed_once_whatever_its_flags(monkeypatch, tmp_path):
    """The input parsed once (its untrusted-input checks' read), through the measured lowerings and the fp16
    conversion too; ONNX Runtime's sessions read their own copies."""
    source = tmp_path / "tiny.onnx"
    assert main(["export", "--preset", "tiny", "--out", str(source), "--no-validate"]) == 0
    parses = Parses(monkeypatch, source, "out.onnx")
    argv = ["optimize", str(source), "--out", str(tmp_path / "out.onnx"), "--attention", "measure", "--auto-seq",
            "16", "--dtype", "fp16", "--json", str(tmp_path / "r.json")]  # fmt: skip
    assert main(argv) == 0
    said = sorted(parses.counts.items())
    assert parses.parses("input") == {"parse": 1}, said
    assert os.path.exists(tmp_path / "r.json") and _meta(tmp_path / "out.onnx")["attnx.dtype"] == "fp16"


def test_a_whole_model_is_written_in_the_lowering_asked(tmp_path, capsys):
    """--attention means the lowering written for every model: a whole model's blocks in its cores, each proven; with
    measure, the cores of every lowering measured timed and the fastest written (or the block kept)."""
    out = tmp_path / "o.onnx"
    report = optimize_model(str(WHOLE), str(out), lowering="onnx")
    assert report.passed and report.written and [b.written for b in report.blocks] == ["attention23", "attention23"]
    assert count_ops(ir.load(str(out))).get("Attention") == 2
    measured = optimize_model(str(WHOLE), str(tmp_path / "m.onnx"), lowering="measure")
    choice = measured.blocks[0].choice  # the cores of each lowering measure times, the graph's own block beside them
    assert measured.passed and {"decomposed", "switch"} <= set(choice.times)
    costs = {name: t.cost() for name, t in choice.times.items() if t.cost() is not None}
    best = min(costs, key=costs.__getitem__)
    assert choice.core == (None if choice.before.cost() <= costs[best] else best), (choice.core, costs)
    argv = ["optimize", str(WHOLE), "--out", str(tmp_path / "d.onnx"), "--attention", "decomposed", "--core", "gqa"]
    assert main(argv) == 2
    assert "--core gqa: the decomposed lowering writes no gqa core" in capsys.readouterr().err
    assert not (tmp_path / "d.onnx").exists()
