"""Decode localisation (issue 23): a failing decode case says the first step (0 = the prefill), the
first position (token index) and which of y, present_key, present_value left its bound first; a step
of the growing form is then run alone from the reference's cache to name its first stage. Each fault
is planted where a real one would be: a runner that writes the cache one position early, a model file
whose output bias changed, a buffer decoder that tells ONNX Runtime the wrong sequence length."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from attnx.export import build_step_model
from attnx.model import AttentionConfig, init_weights
from attnx.model.stages import stages_of
from attnx.runtimes import ModelSource, Runner, create_runner
from attnx.runtimes import decode as decode_module
from attnx.runtimes.decode import BufferDecoder, run_decode_parity

CONFIG = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, causal=True, kv_cache=True, key_padding_mask=True)
BUFFER = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, causal=True, kv_cache=True)  # the buffer form: no mask
PREFILL, STEPS, FAULT_STEP = 3, 6, 3  # step 3 writes token 5 (the prefill is step 0: tokens 0..2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("localise-decode")
    growing, buffer = str(root / "growing.onnx"), str(root / "buffer.onnx")
    onnx.save(build_step_model(CONFIG, init_weights(CONFIG, 0), "decomposed"), growing)
    onnx.save(build_step_model(BUFFER, init_weights(BUFFER, 0), "ort-fused", form="buffer"), buffer)
    return {"growing": growing, "buffer": buffer}


class CacheWrittenEarly(Runner):
    """A real runner whose step writes its new key one position early (over the previous token's)
    once the cache reaches `from_length` positions: y of that step is right, the cache it returns is
    not. Runs outside a decode (localisation's own runs) are the real runner's."""

    def __init__(self, inner: Runner, from_length: int) -> None:
        super().__init__(inner.source)
        self.inner, self.from_length, self.name = inner, from_length, inner.name

    def load_impl(self) -> None:
        self.inner.load()
        self.inputs, self.outputs = self.inner.inputs, self.inner.outputs

    def run_impl(self, feeds):
        return self.inner.run_impl(feeds)

    def run_step_impl(self, feeds):
        out = dict(self.inner.run_step_impl(feeds))
        key = out["present_key"]
        key = np.array(key.numpy() if hasattr(key, "numpy") else key)
        if key.shape[2] >= self.from_length:
            key[:, :, -2] = key[:, :, -1]
        out["present_key"] = key
        return out

    def close_impl(self) -> None:
        self.inner.close()


def test_a_cache_written_at_the_wrong_position_is_found_at_its_step(models):
    fault_length = PREFILL + FAULT_STEP  # the cache's length after step FAULT_STEP

    def factory(name, source, **options):
        real = create_runner(name, source, **options)
        return CacheWrittenEarly(real, fault_length) if name == "ort-cpu" else real

    report = run_decode_parity(ModelSource(CONFIG, init_weights(CONFIG, 0), models["growing"]), ["ort-cpu"],
                               prefills=(PREFILL,), steps=STEPS, runner_factory=factory)  # fmt: skip
    (case,) = report.cases
    assert case.status == "fail"
    loc = case.localisation
    assert (loc["step"], loc["position"], loc["output"]) == (FAULT_STEP, fault_length - 2, "present_key"), loc
    # the step run alone from the reference's cache agrees: what was carried into it is the fault
    assert loc["stage"] is None and "carried into step 3" in loc["cause"]
    assert "at step 3 (position 4, present_key first)" in loc["line"]


def test_a_fault_in_y_alone_is_found_at_the_prefill(models, tmp_path):
    proto = onnx.load(models["growing"])
    bias = next(t for t in proto.graph.initializer if t.name == "out_proj.bias")
    changed = onnx.numpy_helper.to_array(bias).copy()
    changed[0] += 0.1
    bias.CopyFrom(onnx.numpy_helper.from_array(changed, bias.name))
    path = str(tmp_path / "bias.onnx")
    onnx.save(proto, path)
    report = run_decode_parity(ModelSource(CONFIG, init_weights(CONFIG, 0), path), ["ort-cpu"], prefills=(PREFILL,),
                               steps=2)  # fmt: skip
    (case,) = report.cases
    loc = case.localisation
    assert case.status == "fail" and (loc["step"], loc["position"], loc["output"]) == (0, 0, "y"), loc
    assert loc["stage"] == "y" and loc["nodes"] and loc["optimization"]  # the step run alone names its stage


def test_the_buffer_form_told_the_wrong_length_is_found_at_that_step(models, monkeypatch):
    """From step FAULT_STEP on, seqlens_k and total_sequence_length say one token fewer: the op
    (MultiHeadAttention, or GroupQueryAttention: each reads one of them) writes the new key and value
    over the previous token's."""

    class Binding:
        def __init__(self, decoder, inner):
            self.decoder, self.inner = decoder, inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def bind_cpu_input(self, name, value):
            if name in ("seqlens_k", "total_sequence_length") and self.decoder.length + 1 >= PREFILL + FAULT_STEP:
                value = np.asarray(value - 1, value.dtype)
            self.inner.bind_cpu_input(name, value)

    class OffByOne(BufferDecoder):
        def __init__(self, *args):
            super().__init__(*args)
            self.binding = Binding(self, self.binding)

    monkeypatch.setattr(decode_module, "BufferDecoder", OffByOne)
    report = run_decode_parity(ModelSource(BUFFER, init_weights(BUFFER, 0), models["buffer"]), ["ort-cpu"],
                               prefills=(PREFILL,), steps=STEPS)  # fmt: skip
    (case,) = report.cases
    loc = case.localisation
    assert case.status == "fail"
    assert (loc["step"], loc["position"], loc["output"]) == (FAULT_STEP, PREFILL + FAULT_STEP - 2, "present_key"), loc
    assert loc["stage"] is None and not loc["checks"] and "buffer form" in loc["note"]
    assert loc["line"].startswith("localised: first beyond its bound at step 3 (position 4, present_key first)")


def test_a_passing_case_localised_all_has_no_step_and_no_stage(models):
    report = run_decode_parity(ModelSource(CONFIG, init_weights(CONFIG, 0), models["growing"]),
                               ["ort-cpu", "reference"], prefills=(0,), steps=3, localise="all")  # fmt: skip
    assert report.passed
    for case in report.cases:
        loc = case.localisation
        assert loc is not None and "error" not in loc, loc
        assert loc["stage"] is None and loc["step"] is None and loc["position"] is None, loc
    ort = next(c.localisation for c in report.cases if c.backend == "ort-cpu")
    # the growing decomposed step model names every stage of its formula, and each agrees
    assert {c["stage"] for c in ort["checks"] if c["status"] == "pass"} == {s.name for s in stages_of(CONFIG, True)}


def test_localise_off_and_a_localisation_that_fails(models, monkeypatch):
    source = ModelSource(CONFIG, init_weights(CONFIG, 0), models["growing"])
    report = run_decode_parity(source, ["ort-cpu"], prefills=(1,), steps=1, localise="off")
    assert report.cases[0].localisation is None

    def broken(*args, **kwargs):
        raise RuntimeError("no way to localise")

    monkeypatch.setattr(decode_module, "first_divergence", broken)
    report = run_decode_parity(source, ["ort-cpu"], prefills=(1,), steps=1, localise="all")
    assert report.passed and report.cases[0].localisation == {
        "error": "RuntimeError: no way to localise", "line": "not localised: RuntimeError: no way to localise"}
