"""The model describes itself (docs/concepts/backends.md, "The model describes itself"): parity, bench and run take
a model file's config, dtype, lowering and decode form from the file; a flag that contradicts
the model is one error naming both."""

from __future__ import annotations

import json

import pytest

from attnx.cli import main
from attnx.model import save_weights
from attnx.model.contract import model_form
from tests.conftest import CONFIGS, weights_for


@pytest.fixture(scope="module")
def int4_model(tmp_path_factory):
    """An int4 export of the registry's "self" model with its config and weights files."""
    from attnx.workflows import export_model

    root = tmp_path_factory.mktemp("form")
    config = CONFIGS["self"]
    (root / "c.json").write_text(config.to_json())
    save_weights(weights_for("self"), root / "w.safetensors")
    export_model(config, root / "q.onnx", weights_for("self"), dtype="int4", validate=False)
    return root


def parity(root, *args):
    return main(["parity", "--weights", str(root / "w.safetensors"), "--model", str(root / "q.onnx"),
                 "--backends", "reference,ort-cpu", "--batch", "2", "--seq", "5", *map(str, args)])  # fmt: skip


def test_parity_takes_the_dtype_from_the_model(int4_model, tmp_path, capsys):
    # Before: compared under fp32's tolerance unless --dtype int4 was given again (6 of 6 failed).
    report = tmp_path / "p.json"
    assert parity(int4_model, "--config", int4_model / "c.json", "--json", report) == 0
    cases = {c["backend"]: c for c in json.loads(report.read_text())["cases"]}
    assert cases["ort-cpu"]["dtype"] == "int4" and cases["ort-cpu"]["status"] == "pass"
    assert cases["ort-cpu"]["atol"] > 1e-3  # int4's error model, not fp32's rule
    # without --config: the model's own config
    assert parity(int4_model) == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dtype", "int8"], "--dtype int8 contradicts the model 'q.onnx', which is int4"),
        (["--dtype", "fp32"], "--dtype fp32 contradicts the model 'q.onnx', which is int4"),
        (["--attention", "ort-fused"], "--attention ort-fused contradicts the model 'q.onnx', which is decomposed"),
        (["--preset", "tiny"], "--preset contradicts the model 'q.onnx', which was exported from another config "
                               "(d_model 64 vs 32"),
    ],
)  # fmt: skip
def test_a_flag_that_contradicts_the_model_is_one_error(int4_model, flags, message, capsys):
    assert parity(int4_model, *flags) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert "attnx inspect" in err


def test_bench_and_run_take_the_models_dtype(int4_model, capsys):
    from attnx.commands import bench, run

    args = bench_args(int4_model)
    assert bench._plan(args).dtypes == ["int4"]  # was the inputs' dtype: fp32
    with run.open_runner(str(int4_model / "q.onnx"), "cpu") as runner:
        assert runner.source.dtype == "int4" and runner.source.config == CONFIGS["self"]
    assert main(["bench", "--model", str(int4_model / "q.onnx"), "--dtype", "fp32"]) == 2
    assert "--dtype fp32 contradicts the model 'q.onnx', which is int4" in capsys.readouterr().err


def bench_args(root):
    import argparse

    from attnx.cli import build_parser

    parser: argparse.ArgumentParser = build_parser()
    return parser.parse_args(["bench", "--model", str(root / "q.onnx"), "--seq", "4"])


def test_model_form_reads_a_step_model(tmp_path, capsys):
    from attnx.model import AttentionConfig
    from attnx.workflows import export_model

    config = AttentionConfig(d_model=16, n_heads=2, n_kv_heads=1, causal=True, kv_cache=True)
    export_model(config, tmp_path / "s.onnx", validate=False, attention="ort-fused", decode_form="buffer")
    form = model_form(tmp_path / "s.onnx")
    assert (form.config, form.dtype, form.decode) == (config, "fp32", "buffer")
    with pytest.raises(Exception, match="--decode-form growing contradicts the model 's.onnx', which is the buffer"):
        form.agree(decode="growing")
    assert form.agree(dtype="bf16").dtype == "bf16"  # a runtime precision of the fp32 graph agrees with it
    # parity of a step model is step by step: implied by the model, no --decode needed
    assert main(["parity", "--model", str(tmp_path / "s.onnx"), "--backends", "reference,ort-cpu",
                 "--batch", "1", "--prefill", "2", "--steps", "2"]) == 0  # fmt: skip
    assert "prefill" in capsys.readouterr().out
