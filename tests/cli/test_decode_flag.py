"""--decode: the step model of a causal self-attention preset or config, from the command line (issue
30), read the same way by export, build, parity and bench (attnx.commands._common.step_config)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from attnx.cli import main
from attnx.commands._common import step_config
from attnx.model import AttentionConfig, describe, preset

# A decoder layer without 'kv_cache': small, so that every export here is quick.
CAUSAL = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, causal=True)
CROSS = AttentionConfig(d_model=32, n_heads=4, cross=True, kv_dim=24)


@pytest.fixture()
def configs(tmp_path):
    for name, config in (("causal", CAUSAL), ("cross", CROSS)):
        (tmp_path / f"{name}.json").write_text(config.to_json())
    return tmp_path


def test_export_decode_writes_the_step_model_of_a_causal_config(configs):
    step = dataclasses.replace(CAUSAL, kv_cache=True)
    assert main(["export", "--config", str(configs / "causal.json"), "--decode", "--out", str(configs / "g.onnx")]) == 0
    info = describe(configs / "g.onnx")
    assert (info.config, info.decode) == (step, "growing")
    assert [s.name for s in info.inputs] == ["x", "past_key", "past_value"]
    # issue 30's command, on a small config: the buffer form wants no JSON with 'kv_cache' in it
    assert main(["export", "--config", str(configs / "causal.json"), "--decode", "--attention", "ort-fused",
                 "--decode-form", "buffer", "--out", str(configs / "b.onnx")]) == 0  # fmt: skip
    info = describe(configs / "b.onnx")
    assert (info.config, info.decode, info.lowering) == (step, "buffer", "ort-fused")


def test_build_decode_packages_the_step_model(configs):
    pkg = configs / "pkg"
    assert main(["build", "--config", str(configs / "causal.json"), "--decode", "--provider", "cpu",
                 "--out", str(pkg)]) == 0  # fmt: skip
    manifest = json.loads((pkg / "manifest.json").read_text())
    assert manifest["config"] == dataclasses.replace(CAUSAL, kv_cache=True).to_dict()
    assert manifest["models"][0]["decode"] == "growing"


def test_parity_decode_checks_the_step_model_of_a_causal_config(configs, capsys):
    model = configs / "g.onnx"
    assert main(["export", "--config", str(configs / "causal.json"), "--decode", "--no-validate", "--out", str(model)]) == 0
    # the config and the model agree: --decode makes the config the model's, as export --decode wrote it
    capsys.readouterr()
    assert main(["parity", "--config", str(configs / "causal.json"), "--decode", "--model", str(model),
                 "--backends", "reference,ort-cpu", "--batch", "1", "--prefill", "0,2", "--steps", "2"]) == 0  # fmt: skip
    assert "parity PASSED" in capsys.readouterr().out
    # a full-sequence model has no steps to check
    full = configs / "full.onnx"
    assert main(["export", "--config", str(configs / "causal.json"), "--no-validate", "--out", str(full)]) == 0
    capsys.readouterr()
    assert main(["parity", "--model", str(full), "--decode"]) == 2
    assert "--decode needs a step model, and" in capsys.readouterr().err


def test_decode_of_a_step_model_config_changes_nothing():
    assert step_config(preset("large-gqa"), "--preset large-gqa") == preset("large-gqa")
    assert step_config(preset("llama3-8b"), "--preset llama3-8b") == dataclasses.replace(preset("llama3-8b"), kv_cache=True)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["export", "--preset", "tiny", "--decode"],
         "--decode: --preset tiny has no step model: config key 'kv_cache' needs causal self-attention"),
        (["build", "--preset", "tiny", "--decode"],
         "--decode: --preset tiny has no step model: config key 'kv_cache' needs causal self-attention"),
        (["export", "--config", "{d}/cross.json", "--decode"],
         "--decode: --config {d}/cross.json has no step model: config key 'kv_cache' needs causal self-attention"),
        (["parity", "--config", "{d}/cross.json", "--decode"],
         "--decode: --config {d}/cross.json has no step model: config key 'kv_cache' needs causal self-attention"),
        # --decode-form names a form of the step model: without --decode, the error says to add it ...
        (["export", "--config", "{d}/causal.json", "--attention", "ort-fused", "--decode-form", "buffer"],
         "--decode-form buffer is a form of the step model: add --decode for the step model of --config {d}/causal.json"),
        (["build", "--config", "{d}/causal.json", "--attention", "ort-fused", "--decode-form", "buffer"],
         "--decode-form buffer is a form of the step model: add --decode"),
        # ... or why the config has none
        (["export", "--preset", "tiny", "--decode-form", "buffer"],
         "--decode-form buffer: --preset tiny has no step model: config key 'kv_cache' needs causal self-attention"),
    ],
)  # fmt: skip
def test_a_config_without_a_step_model_is_one_error_exit_2(configs, capsys, args, message):
    args = [a.format(d=configs) for a in args]
    out = ["--out", str(configs / ("pkg" if args[0] == "build" else "m.onnx"))] if args[0] != "parity" else []
    assert main([*args, *out]) == 2
    err = capsys.readouterr().err
    assert message.format(d=configs) in err and len(err.strip().splitlines()) == 1, err
    assert not (configs / "m.onnx").exists() and not (configs / "pkg").exists()
