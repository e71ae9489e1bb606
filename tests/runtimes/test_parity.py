"""Parity over the skeleton's matrix: torch, ORT CPU and the reference agree."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from attnx.errors import ProviderUnavailable
from attnx.runtimes import ModelSource, Runner, create_runner
from attnx.runtimes.base import backend_unavailable_reason
from attnx.runtimes.parity import ParityReport, run_parity
from tests.conftest import CONFIGS, weights_for

CONTRACT_KEYS = {"backend", "reference", "dtype", "batch", "seq", "mem_seq", "status", "reason", "max_abs",
                 "max_rel", "atol", "rtol", "input_mean"}  # fmt: skip


@pytest.mark.parametrize("attention", ["decomposed", "onnx"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_parity_matrix(exported, name, attention):
    config = CONFIGS[name]
    source = ModelSource(config, weights_for(name), exported(name, attention))
    report = run_parity(source, ["reference", "torch", "ort-cpu"], batches=(1, 3), seqs=(1, 7, 128),
                        mem_seqs=(5,) if config.cross else None)  # fmt: skip
    assert report.passed, [c.reason for c in report.cases if c.status != "pass"]
    assert len(report.cases) == 3 * 2 * 3
    assert {c.status for c in report.cases} == {"pass"}
    assert {c.input_mean for c in report.cases} == {0.0, 0.5}  # zero-mean and shifted inputs, in turn
    if config.cross:
        assert {c.mem_seq for c in report.cases} == {5}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cross_kpm", "causal_kpm"])
def test_parity_long_sequence(exported, name):
    config = CONFIGS[name]
    source = ModelSource(config, weights_for(name), exported(name))
    report = run_parity(source, ["torch", "ort-cpu"], batches=(2,), seqs=(1100,), mem_seqs=(1030,))
    assert report.passed, [c.reason for c in report.cases]


def test_report_json_follows_the_contract(exported, tmp_path):
    source = ModelSource(CONFIGS["self"], weights_for("self"), exported("self"))
    report = run_parity(source, ["reference", "ort-cpu", "ort-cuda", "torch-cuda"], batches=(1,), seqs=(3,))
    path = tmp_path / "p.json"
    report.write_json(path)
    data = json.loads(path.read_text())
    assert data["passed"] is True
    for case in data["cases"]:
        assert CONTRACT_KEYS <= set(case)
    by_backend = {c["backend"]: c for c in data["cases"]}
    assert by_backend["reference"]["reference"] == "torch-fp64" and by_backend["reference"]["status"] == "pass"
    assert by_backend["ort-cpu"]["status"] == "pass" and by_backend["ort-cpu"]["max_abs"] < by_backend["ort-cpu"]["atol"]
    for gpu in ("ort-cuda", "torch-cuda"):  # pass where a GPU runs them, else skipped with the reason
        if backend_unavailable_reason(gpu) is None:
            assert by_backend[gpu]["status"] == "pass" and by_backend[gpu]["reason"] is None
        else:
            assert by_backend[gpu]["status"] == "skipped"
            assert gpu in by_backend[gpu]["reason"] and "unavailable" in by_backend[gpu]["reason"]
    assert ParityReport.from_dict(data).to_dict() == data


class _WrongRunner(Runner):
    """A backend that computes the wrong thing: parity must fail it."""

    name = "wrong"

    def load_impl(self) -> None:
        self.inputs = self.source.config.inputs()

    def run_impl(self, feeds):
        from attnx.model import reference_attention

        y = reference_attention(self.source.config, self.source.weights, **feeds)
        y[0, 0, 0] += 1e-3 * np.sqrt(np.mean(y * y))  # one element, a thousandth of the RMS off
        return {"y": y.astype(np.float32)}


class _MissingRunner(Runner):
    name = "missing"

    def load_impl(self) -> None:
        raise ProviderUnavailable("backend 'missing' is unavailable: no such device")


def _factory(name, source):
    return {"wrong": _WrongRunner, "missing": _MissingRunner}.get(name, lambda s: create_runner(name, s))(source)


def test_parity_fails_a_wrong_backend_and_skips_a_missing_one():
    source = ModelSource(CONFIGS["kpm"], weights_for("kpm"))
    report = run_parity(source, ["wrong", "missing"], batches=(1,), seqs=(4,), runner_factory=_factory)
    assert not report.passed
    by = {c.backend: c for c in report.cases}
    assert by["wrong"].status == "fail" and "would need atol" in by["wrong"].reason
    assert by["wrong"].max_abs > by["wrong"].atol
    assert by["missing"].status == "skipped" and by["missing"].reason.endswith("no such device")


def test_all_skipped_is_not_a_pass():
    source = ModelSource(CONFIGS["self"], weights_for("self"))
    report = run_parity(source, ["missing"], batches=(1,), seqs=(2,), runner_factory=_factory)
    assert not report.passed and {c.status for c in report.cases} == {"skipped"}


def test_a_case_the_model_s_fixed_dims_rule_out_is_not_applicable_not_an_error(exported, tmp_path):
    """A model whose batch is fixed at 1 (edited after export): its batch-3 cases are skipped on the backends that run
    the file, naming the input and its dims; the batch-1 cases run; the module backends run every case."""
    import onnx

    proto = onnx.load(exported("self"))
    for value in [*proto.graph.input, *proto.graph.output]:
        dim = value.type.tensor_type.shape.dim[0]
        dim.Clear()
        dim.dim_value = 1
    path = str(tmp_path / "b1.onnx")
    onnx.save(proto, path)
    report = run_parity(ModelSource(CONFIGS["self"], weights_for("self"), path), ["torch", "ort-cpu"], batches=(1, 3),
                        seqs=(4,))  # fmt: skip
    by = {(c.backend, c.batch): c for c in report.cases}
    assert by[("ort-cpu", 1)].status == by[("torch", 3)].status == "pass" and report.passed
    assert by[("ort-cpu", 3)].status == "skipped"
    assert by[("ort-cpu", 3)].reason == ("not applicable: the model's own dims rule this case out (input 'x' has size "
                                         "3 on axis 0, expected 1 [1, seq, 32])")  # fmt: skip


@pytest.mark.parametrize("location", ["../outside.data", "/etc/hostname"])
def test_a_model_whose_data_lies_outside_its_folder_is_refused_for_every_backend(exported, tmp_path, capsys, location):
    """One rule before any backend reads the file: ONNX Runtime refuses such a model and OpenVINO reads
    it, so parity refuses it first (exit 2, the location named), whichever backends are asked."""
    import onnx

    from attnx.cli import main

    proto = onnx.load(exported("self", "ort-fused"))
    (tmp_path / "m").mkdir()
    path = str(tmp_path / "m" / "model.onnx")
    onnx.save(proto, path, save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    os.replace(tmp_path / "m" / "model.onnx.data", tmp_path / "outside.data")
    moved = onnx.load(path, load_external_data=False)
    for t in moved.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    onnx.save(moved, path)
    for backends in ("reference,openvino", "reference,ort-cpu"):
        assert main(["parity", "--model", path, "--backends", backends, "--seq", "3"]) == 2
        err = capsys.readouterr().err
        assert location in err and "refused" in err, err
