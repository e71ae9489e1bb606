"""fp16 step models: the whole graph, its inputs, outputs and cache float16 (the rotary angle kept
float32: attnx.export.passes.fp16), in every lowering and the buffer form, decoded step by step
against the reference's full forward under fp16's rule (docs/concepts/step-forms.md)."""

from __future__ import annotations

import dataclasses

import onnx
import pytest

from attnx.export import build_step_model
from attnx.model import AttentionConfig
from attnx.model.weights import init_weights
from attnx.runtimes import ModelSource
from attnx.runtimes.decode import run_buffer_parity, run_decode_parity
from tests.conftest import LLM_CONFIGS, LLM_FUSED_CONFIGS

CONFIGS = {
    "plain": AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, causal=True, key_padding_mask=True, kv_cache=True),
    "llama": dataclasses.replace(LLM_CONFIGS["llama"], kv_cache=True),
    # rope on part of each head, a window, softcap, q/k norms, sinks, key padding
    "llm": dataclasses.replace(LLM_FUSED_CONFIGS["ort-fused"], kv_cache=True),
}


def _model(tmp_path, config, attention, form="growing"):
    path = tmp_path / f"{attention}-{form}.onnx"
    model = build_step_model(config, init_weights(config, seed=1), attention, form, "fp16")
    kinds = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
    assert {kinds[n] for n in ("x", "past_key", "past_value", "y", "present_key", "present_value")} == {
        onnx.TensorProto.FLOAT16}
    onnx.save(model, path)
    return ModelSource(config, init_weights(config, seed=1), str(path), "fp16")


@pytest.mark.parametrize("attention", ["decomposed", "onnx", "ort-fused"])
@pytest.mark.parametrize("name", CONFIGS)
def test_an_fp16_step_model_decodes_in_every_lowering(tmp_path, name, attention):
    config = CONFIGS[name]
    if attention == "onnx" and config.sinks:
        pytest.skip("the onnx lowering has no sink logit: refused by name (tests/model/test_llm.py)")
    report = run_decode_parity(_model(tmp_path, config, attention), ["ort-cpu"], prefills=(0, 1, 37), steps=8,
                               batch=3, localise="off")  # fmt: skip
    assert report.passed, [c.reason for c in report.cases if c.status != "pass"]


@pytest.mark.parametrize("name", CONFIGS)
def test_the_fp16_buffer_form_decodes(tmp_path, name):
    # the buffer form has no padding; its rotation a cos/sin width that is a multiple of 8 (conftest's "buffer")
    config = dataclasses.replace(LLM_FUSED_CONFIGS["buffer"] if name == "llm" else CONFIGS[name], key_padding_mask=False)
    report = run_buffer_parity(_model(tmp_path, config, "ort-fused", "buffer"), "ort-cpu", prefills=(0, 1, 37),
                               steps=8, batch=2)  # fmt: skip
    assert report.passed, [c.reason for c in report.cases if c.status != "pass"]


def test_an_fp16_step_model_at_position_8192_needs_its_angle_float32(tmp_path, monkeypatch):
    from attnx.export.passes import fp16 as fp16_module

    config = CONFIGS["llama"]

    def report(name):
        (tmp_path / name).mkdir()
        source = _model(tmp_path / name, config, "decomposed")
        return run_decode_parity(source, ["ort-cpu"], prefills=(5,), steps=4, batch=2, position_offset=8192,
                                 localise="off")  # fmt: skip

    assert report("right").passed
    monkeypatch.setattr(fp16_module, "_angle_region", lambda graph: set())
    assert not report("wrong").passed
