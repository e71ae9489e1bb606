"""The CLI: exit codes, one-line errors, outputs. Run in-process except where the real
process boundary (stderr, exit status) is the point."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from attnx.cli import main
from attnx.model import AttentionConfig, init_weights, preset, reference_attention, save_weights
from attnx.model.tolerance import problem_size, tolerance_for
from attnx.runtimes.base import backend_unavailable_reason
from attnx.runtimes.compare import compare_arrays


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "m.onnx"
    assert main(["export", "--preset", "tiny", "--out", str(path)]) == 0
    return path


def attnx(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnx.cli", *args], capture_output=True, text=True, timeout=300)


def error_lines(stderr: str) -> list[str]:
    """stderr without the progress lines ("[   0.0s] ...")."""
    return [ln for ln in stderr.splitlines() if not ln.startswith("[")]


def test_export_then_parity_json(tiny_model, tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(["parity", "--preset", "tiny", "--model", str(tiny_model), "--seq", "1,9", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    statuses = {}
    for c in data["cases"]:
        statuses.setdefault(c["backend"], set()).add(c["status"])
    # The GPU backends (and openvino, an extra) pass where they run, and are skipped with their own reason elsewhere.
    gpu = {b: backend_unavailable_reason(b) for b in ("ort-cuda", "torch-cuda", "openvino")}
    assert statuses == {"reference": {"pass"}, "torch": {"pass"}, "ort-cpu": {"pass"},
                        **{b: {"pass" if reason is None else "skipped"} for b, reason in gpu.items()}}  # fmt: skip
    printed = capsys.readouterr().out
    assert "parity PASSED" in printed
    for backend, reason in gpu.items():
        assert (f"skipped {backend}: " in printed) == (reason is not None)


def test_parity_exports_a_model_when_none_is_given(capsys):
    assert main(["parity", "--preset", "tiny", "--backends", "ort-cpu", "--seq", "2", "--batch", "1"]) == 0
    assert "1 passed, 0 failed, 0 skipped" in capsys.readouterr().out


def test_require_unavailable_backend_exits_2_with_the_reason(tiny_model):
    if backend_unavailable_reason("ort-cuda") is None:
        pytest.skip("ort-cuda runs here: this is the path of a machine without it")
    r = attnx("parity", "--preset", "tiny", "--model", str(tiny_model), "--require", "ort-cuda", "--seq", "2")
    assert r.returncode == 2
    # Everything on stderr but the progress lines is the one error line: ORT's own C++ log
    # is captured into the reason, not printed.
    lines = error_lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("attnx parity: error: backend 'ort-cuda' is unavailable")
    assert "session providers: CPUExecutionProvider" in lines[0]


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        (lambda d: (d / "c.json").write_text('{"d_model": 8, "n_heads": 2, "heads": 3}'),
         ["export", "--config", "{d}/c.json", "--out", "{d}/m.onnx"], "unknown config key 'heads'"),
        (lambda d: None, ["export", "--config", "{d}/none.json", "--out", "{d}/m.onnx"], "cannot read config"),
        (lambda d: save_weights({**init_weights(AttentionConfig(d_model=8, n_heads=2)),
                                 "q_proj.weight": np.zeros((8, 7), np.float32)}, d / "w.safetensors"),
         ["export", "--config", "{d}/c8.json", "--weights", "{d}/w.safetensors", "--out", "{d}/m.onnx"],
         "'q_proj.weight' has shape [8, 7], expected [8, 8]"),
        (lambda d: None, ["export", "--preset", "tiny", "--out", "{d}/no/such/dir/m.onnx"], "does not exist"),
        (lambda d: None, ["export", "--preset", "tiny", "--out", ""], "--out '' names no file"),
        (lambda d: None, ["export", "--preset", "tiny", "--out", "{d}/new/"], "names no file"),
        (lambda d: None, ["run", "{d}/none.onnx", "--input", "{d}/x.npy", "--output", "{d}/y.npy"], "does not exist"),
        (lambda d: (d / "bad.onnx").write_bytes(b"junk"), ["inspect", "{d}/bad.onnx"], "not an ONNX model"),
        # a path that is not a regular file is named for what it is (attnx._io.not_a_file)
        (lambda d: (d / "link.onnx").symlink_to(d / "gone.onnx"), ["inspect", "{d}/link.onnx"], "is a broken link"),
        (lambda d: None, ["inspect", "/dev/null"], "'/dev/null' is not a regular file (a device, pipe or socket)"),
        (lambda d: (d / "x.npy").mkdir(), ["run", "{d}/none.onnx", "--input", "{d}/x.npy", "--output", "{d}/y.npy"],
         "--input file '{d}/x.npy' is a folder, not a file"),
        (lambda d: (d / "w.safetensors").mkdir(),
         ["export", "--config", "{d}/c8.json", "--weights", "{d}/w.safetensors", "--out", "{d}/m.onnx"],
         "weights file '{d}/w.safetensors' is a folder, not a file"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_with_one_line(tmp_path, setup, args, message):
    (tmp_path / "c8.json").write_text('{"d_model": 8, "n_heads": 2}')
    setup(tmp_path)
    r = attnx(*[a.format(d=tmp_path) for a in args])
    assert r.returncode == 2, r.stderr
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("attnx ") and message.format(d=tmp_path) in lines[0], r.stderr
    assert not (tmp_path / "m.onnx").exists()  # nothing half-written


def test_run_checks_feeds_and_writes_output(tiny_model, tmp_path, capsys):
    x = np.random.default_rng(0).standard_normal((2, 5, 64)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    args = ["run", str(tiny_model), "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npy")]
    assert main(args) == 0
    y = np.load(tmp_path / "y.npy")
    config, weights = preset("tiny"), init_weights(preset("tiny"), 0)  # what `attnx export --preset tiny` used
    cmp = compare_arrays("y", y, reference_attention(config, weights, x), tolerance_for("fp32"),
                         problem_size(config, weights, {"x": x}))  # fmt: skip
    assert cmp, cmp
    np.save(tmp_path / "x.npy", x[0])  # wrong rank
    assert main(args) == 2
    assert "'x' has rank 2" in capsys.readouterr().err
    np.save(tmp_path / "x.npy", x.astype(np.float64))  # wrong dtype
    assert main(args) == 2
    assert "dtype fp64, expected fp32" in capsys.readouterr().err
    np.save(tmp_path / "x.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)  # a pickle: refused
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "not a plain .npy array: Object arrays cannot be loaded" in err
    (tmp_path / "x.npy").write_bytes(b"junk, not an array")  # numpy takes it for a pickle, and suggests loading it
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "not a plain .npy array: it holds pickled data" in err and "unsafely" not in err


def test_inspect_describes_the_model(tiny_model, capsys):
    assert main(["inspect", str(tiny_model), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["config"]["d_model"] == 64 and info["ir_version"] == 10
    assert info["inputs"] == [{"name": "x", "dtype": "fp32", "shape": ["batch", "seq", 64]}]  # attnx's dtype names
    assert info["lowering"] == "decomposed" and info["dtype"] == "fp32"
    assert info["operators"]["Softmax"] == 1
    # one spelling of operators: inspect (onnx protos) and the pass reports (onnx-ir) agree
    import onnx_ir as ir

    from attnx.export.passes import count_ops

    assert info["operators"] == count_ops(ir.load(str(tiny_model))) and info["nodes"] == sum(info["operators"].values())


@pytest.mark.slow
def test_export_output_is_clean(tmp_path, no_trace_cache):
    """The dynamo exporter's chatter stays out of the CLI's stdout."""
    r = attnx("export", "--preset", "tiny", "--out", str(tmp_path / "m.onnx"), "--no-validate")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1].startswith("wrote ")
    assert "torchvision" not in r.stdout + r.stderr and "Translate the graph" not in r.stdout + r.stderr
    assert os.path.exists(tmp_path / "m.onnx")


def test_run_takes_the_positions_of_a_model_with_rope(exported, tmp_path, capsys):
    from attnx.model.inputs import make_inputs
    from tests.conftest import LLM_CONFIGS

    config = LLM_CONFIGS["llama"]
    feeds = make_inputs(config, 2, 5)  # a left-padded batch: its position_ids are not token indices
    for name in ("x", "position_ids"):
        np.save(tmp_path / f"{name}.npy", feeds[name])
    model = exported("llama")
    args = ["run", model, "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npy")]
    assert main(args) == 2
    assert "position_ids" in capsys.readouterr().err
    assert main([*args, "--position-ids", str(tmp_path / "position_ids.npy")]) == 0
    weights = init_weights(config, seed=1)
    ref = reference_attention(config, weights, feeds["x"], position_ids=feeds["position_ids"])
    cmp = compare_arrays("y", np.load(tmp_path / "y.npy"), ref, tolerance_for("fp32"), problem_size(config, weights, feeds))
    assert cmp, cmp


@pytest.mark.parametrize("command", ["export", "build", "optimize"])
def test_int8_bits_with_another_dtype_exits_2_naming_the_flag(command, tiny_model, tmp_path, capsys):
    """--int8-bits is int8's weight width: an explicit 7 or 8 with another dtype is bad usage (auto, the
    default, goes with every dtype); nothing is written."""
    model = ["--preset", "tiny"] if command != "optimize" else [str(tiny_model)]  # optimize: the model's fp32
    dtype = ["--dtype", "int4"] if command == "build" else []
    out = tmp_path / ("pkg" if command == "build" else "m.onnx")
    assert main([command, *model, *dtype, "--int8-bits", "7", "--out", str(out)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("[")]
    want = f"--int8-bits 7 is for --dtype int8 (the int8 weights' width), not --dtype {'int4' if dtype else 'fp32'}"
    assert len(err) == 1 and err[0].startswith(f"attnx {command}: error: ") and want in err[0], err
    assert not out.exists()
    with pytest.raises(SystemExit) as e:  # argparse's choices: auto, 7, 8
        main([command, *model, "--dtype", "int8", "--int8-bits", "6", "--out", str(out)])
    assert e.value.code == 2 and "--int8-bits: invalid choice: '6'" in capsys.readouterr().err


def test_export_writes_the_int8_width_asked(tmp_path, capsys):
    out = tmp_path / "m.onnx"
    args = ["export", "--preset", "tiny", "--attention", "ort-fused", "--dtype", "int8", "--out", str(out)]
    assert main([*args, "--int8-bits", "7", "--no-validate"]) == 0
    assert "precision: int8 projections (QuantizeProjections), 7-bit weights" in capsys.readouterr().out
    assert main(["inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["metadata"]["attnx.int8_weight_bits"] == "7"


@pytest.mark.parametrize(("command", "flag", "old", "new"), [
    ("export", "--attention", "auto", "measure"),
    ("optimize", "--attention", "auto", "measure"),
    ("optimize", "--core", "auto", "measure"),
    ("build", "--core", "auto", "measure"),
    ("export", "--buffer-core", "auto", "switch"),
    ("build", "--buffer-core", "auto", "switch"),
])  # fmt: skip
def test_the_old_auto_spellings_still_parse_as_their_new_names_with_one_line(command, flag, old, new, capsys):
    """"auto" named three things: measuring the lowerings (--attention), measuring the cores (--core) and the If core
    (--buffer-core). Each has its own name now (measure, measure, switch); the old spelling parses as the new one with
    one deprecation line on stderr, and the new one parses silently. The switch core can be forced (--core switch)."""
    from attnx.cli import build_parser

    parser = build_parser(command)
    model = ["--preset", "tiny"] if command != "optimize" else ["m.onnx"]
    dest = flag.lstrip("-").replace("-", "_")
    args = parser.parse_args([command, *model, flag, old, "--out", "o"])
    err = capsys.readouterr().err.splitlines()
    assert getattr(args, dest) == new and len(err) == 1, err
    assert f"{flag} {old} is deprecated: say {flag} {new}" in err[0]
    assert getattr(parser.parse_args([command, *model, flag, new, "--out", "o"]), dest) == new
    assert capsys.readouterr().err == ""
    if flag == "--core":
        assert parser.parse_args([command, *model, flag, "switch", "--out", "o"]).core == "switch"
