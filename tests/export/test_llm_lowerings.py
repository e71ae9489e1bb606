"""The onnx and ort-fused lowerings of the modern-LLM layers (rope, window, softcap, q/k norms, sinks),
full-sequence and step model, and the buffer form: each exported and validated by export_model, then
held to the reference on ort-cpu and openvino (where it runs) with Hugging Face's position_ids of a
left-padded batch, and at position 8192; a graph with each term planted wrong fails; what a form
cannot express is refused by name; a position past the buffer form's rope table is an error."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from attnx.errors import InputError, UsageError
from attnx.export import build_model, build_step_model
from attnx.model import init_weights
from attnx.model.contract import ROPE_POSITIONS_KEY, describe
from attnx.runtimes import ModelSource, create_runner
from attnx.runtimes.base import backend_unavailable_reason
from attnx.runtimes.decode import BufferDecoder, run_buffer_parity, run_decode_parity
from attnx.runtimes.parity import run_parity
from attnx.workflows import export_model
from tests.conftest import LLM_CONFIGS, LLM_FUSED_CONFIGS

TESTED_BACKENDS = ["ort-cpu", "openvino"]
LOWERINGS = ("onnx", "ort-fused")
# The operators each lowering is written in (docs/concepts/formula.md, "Modern LLM attention").
OPS = {
    "onnx": {"RMSNormalization", "RotaryEmbedding", "Attention"},
    "ort-fused": {"RMSNormalization", "com.microsoft.RotaryEmbedding", "com.microsoft.GroupQueryAttention"},
}


def _config(lowering: str, step: bool = False):
    return dataclasses.replace(LLM_FUSED_CONFIGS[lowering], kv_cache=step)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """model(lowering, step, name=None) -> (config, weights, path): export_model's checked, validated file."""
    root, made = tmp_path_factory.mktemp("llm-lowerings"), {}

    def get(lowering: str, step: bool = False, name: str | None = None):
        key = (lowering, step, name)
        if key not in made:
            config = _config(lowering, step) if name is None else dataclasses.replace(LLM_CONFIGS[name], kv_cache=step)
            weights = init_weights(config, 1)
            path = str(root / f"{lowering}-{step}-{name}.onnx")
            export_model(config, path, weights, attention=lowering)  # validates: torch / the reference step by step
            made[key] = (config, weights, path)
        return made[key]

    return get


def _passed(report, backends=("ort-cpu",)):
    failed = [c for c in report.cases if c.status == "fail"]
    assert report.passed and not failed, failed[0].reason if failed else report.summary()
    ran = {c.backend for c in report.cases if c.status == "pass"}
    assert set(backends) <= ran, report.summary()
    return ran


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_full_sequence_lowering_parity_and_describe(model, lowering):
    config, weights, path = model(lowering)
    info = describe(path)
    assert info.lowering == lowering and info.decode is None and info.config == config
    assert OPS[lowering] <= set(info.operators), info.operators
    ran = _passed(run_parity(ModelSource(config, weights, path), TESTED_BACKENDS, batches=(1, 3), seqs=(1, 7, 33)))
    if lowering == "onnx" and backend_unavailable_reason("openvino") is None:
        assert "openvino" in ran  # RotaryEmbedding-23, RMSNormalization-23, Attention-23 with softcap


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_step_model_lowering_decode_parity(model, lowering):
    config, weights, path = model(lowering, step=True)
    info = describe(path)
    assert info.lowering == lowering and info.decode == "growing"
    assert OPS[lowering] <= set(info.operators), info.operators
    report = run_decode_parity(ModelSource(config, weights, path), TESTED_BACKENDS, prefills=(0, 5), steps=6, batch=3)
    ran = _passed(report)
    if lowering == "onnx" and backend_unavailable_reason("openvino") is None:
        assert "openvino" in ran


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_a_long_context_at_position_8192(model, lowering):
    config, weights, path = model(lowering, step=True, name="llama")  # llama3 scaling, no biases
    report = run_decode_parity(ModelSource(config, weights, path), ["ort-cpu"], prefills=(3,), steps=3, batch=2,
                               position_offset=8192)  # fmt: skip
    _passed(report)
    full = dataclasses.replace(config, kv_cache=False)
    path_full = path.replace(".onnx", "-full.onnx")
    onnx.save(build_model(full, weights, lowering), path_full)
    _passed(run_parity(ModelSource(full, weights, path_full), ["ort-cpu"], batches=(3,), seqs=(7,), position_offset=8192))


def test_buffer_form_parity_and_its_rope_table(tmp_path):
    config = LLM_FUSED_CONFIGS["buffer"]  # every term, partial interleaved rotary inside GroupQueryAttention
    weights = init_weights(config, 1)
    path = str(tmp_path / "buffer.onnx")
    report = export_model(config, path, weights, attention="ort-fused", decode_form="buffer")
    assert report.validation == [] and describe(path).decode == "buffer"
    info = describe(path)
    assert info.metadata[ROPE_POSITIONS_KEY] == "32768" and info.lowering == "ort-fused"
    gqa = next(n for n in onnx.load(path).graph.node if n.op_type == "GroupQueryAttention")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gqa.attribute}
    assert attrs["do_rotary"] == 1 and attrs["local_window_size"] == 4 and attrs["softcap"] == 2.0
    _passed(run_buffer_parity(ModelSource(config, weights, path), prefills=(0, 5), steps=6, batch=3))
    # A position past the table: refused before a step, and the op's own error if bound anyway.
    short = tmp_path / "short.onnx"
    onnx.save(build_step_model(config, weights, "ort-fused", "buffer", rope_positions=8), short)
    with create_runner("ort-cpu", ModelSource(config, weights, str(short))) as runner:
        with pytest.raises(InputError, match=r"reaches past the model's rope table \(positions 0..7\)"):
            BufferDecoder(runner, config, 9, 1)
        dec = BufferDecoder(runner, config, 8, 1)
        dec.step(np.zeros((1, 8, config.d_model), np.float32))  # positions 0..7: in the table
    session = ort.InferenceSession(str(short), providers=["CPUExecutionProvider"])
    cache = np.zeros((1, 1, 9, 32), np.float32)
    feeds = {"x": np.zeros((1, 1, 64), np.float32), "past_key": cache, "past_value": cache,
             "seqlens_k": np.array([8], np.int32), "total_sequence_length": np.array(9, np.int32)}  # fmt: skip
    with pytest.raises(Exception, match="cos_cache dimension 0 shall not be less than total_sequence_length"):
        session.run(None, feeds)


@pytest.mark.parametrize("core", ["grouped-mha", "switch"])
def test_buffer_form_cores_with_rope_qk_norm_and_a_window(tmp_path, core):
    """The buffer form's other cores on a modern-LLM config they take (no softcap, no sinks): rope (yarn,
    partial, interleaved pairs) and q/k norms by their own nodes in the grouped core, inside
    GroupQueryAttention in auto's prefill branch; the window in the grouped core's mask. Prefill 0, 1
    and 5 (auto: the grouped core for one token, GroupQueryAttention for five) then single-token steps."""
    config = dataclasses.replace(LLM_FUSED_CONFIGS["buffer"], softcap=None, sinks=False)
    weights = init_weights(config, 1)
    path = str(tmp_path / "buffer.onnx")
    report = export_model(config, path, weights, attention="ort-fused", decode_form="buffer", buffer_core=core)
    assert report.validation == [] and describe(path).lowering == "ort-fused"
    _passed(run_buffer_parity(ModelSource(config, weights, path), prefills=(0, 1, 5), steps=6, batch=3))
    with pytest.raises(UsageError, match="does not express softcap, sinks; use --buffer-core gqa"):
        build_step_model(LLM_FUSED_CONFIGS["buffer"], weights, "ort-fused", "buffer", buffer_core=core)


def _faults(config):
    """(name, the config a faulty graph is built from, a runner wrapper) for each planted fault."""
    rope = config.rope
    faults = [
        ("window one wider", dataclasses.replace(config, sliding_window=config.sliding_window + 1), None),
        ("the other pair layout", dataclasses.replace(config, rope={**rope.to_dict(), "interleaved": not rope.interleaved}),
         None),
        ("softcap missing", dataclasses.replace(config, softcap=None), None),
        ("q/k norm over every head at once (the wrong axes)", config, "norm axis"),
        ("positions off by one", config, "shift"),
    ]  # fmt: skip
    if config.sinks:
        faults.append(("sink dropped", dataclasses.replace(config, sinks=False), None))
    return faults


@pytest.mark.parametrize("lowering", [*LOWERINGS, "buffer"])
def test_each_planted_fault_fails(tmp_path, lowering):
    form = "buffer" if lowering == "buffer" else "growing"
    attention = "ort-fused" if lowering == "buffer" else lowering
    config = _config(lowering, step=True)
    weights = init_weights(config, 1)
    for what, wrong, wrap in _faults(config):
        path = str(tmp_path / "wrong.onnx")
        if wrap == "shift" and form == "buffer":
            # Its positions are token indices: a table one row off moves every position, which leaves
            # y as it was (rope sees differences) and the cache of rotated keys wrong.
            import attnx.export.cores.gqa as step_module

            table = step_module.rope_table
            step_module.rope_table = lambda c, n, table=table: tuple(t[1:] for t in table(c, n + 1))
            try:
                onnx.save(build_step_model(config, weights, attention, form), path)
            finally:
                step_module.rope_table = table
        else:
            proto = build_step_model(wrong, weights, attention, form)
            if wrap == "norm axis":  # [B, S, heads, hd] normalized over axes 2.. (all heads), not 3 (each head's)
                for node in proto.graph.node:
                    if node.op_type == "RMSNormalization":
                        next(a for a in node.attribute if a.name == "axis").i = 2
            onnx.save(proto, path)

        def factory(name, source, wrap=wrap):
            runner = create_runner(name, source)
            if wrap == "shift" and form == "growing":
                right = runner.step

                def shifted(x, state, key_padding_mask=None, position_ids=None):  # the steps', not the prefill's
                    return right(x, state, key_padding_mask, position_ids + 1 if state.length else position_ids)

                runner.step = shifted
            return runner

        source = ModelSource(config, weights, path)
        if form == "buffer":
            report = run_buffer_parity(source, prefills=(5,), steps=4, batch=2)
        else:
            report = run_decode_parity(source, ["ort-cpu"], prefills=(5,), steps=4, batch=2, runner_factory=factory)
        assert [c.status for c in report.cases] == ["fail"], f"{lowering}: {what} passed"


def test_what_a_form_cannot_express_is_refused_by_name(tmp_path):
    buffer = LLM_FUSED_CONFIGS["buffer"]
    weights = init_weights(buffer, 1)
    narrow = dataclasses.replace(buffer, rope={**buffer.rope.to_dict(), "dim": 8})  # cos/sin width 4
    with pytest.raises(UsageError, match="cannot rotate rope dim 8.*multiple of 8"):
        build_step_model(narrow, weights, "ort-fused", "buffer")
    build_step_model(narrow, weights, "ort-fused", "growing")  # its own rotation node takes any even dim
    longrope = dataclasses.replace(buffer, rope={"theta": 10000.0, "scaling": {
        "rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
        "original_max_position_embeddings": 16, "attention_factor": 1.0}})  # fmt: skip
    with pytest.raises(UsageError, match="cannot express longrope"):
        build_step_model(longrope, weights, "ort-fused", "buffer")
    # both refusals are GroupQueryAttention's (its do_rotary reads one table): the grouped core, for a
    # config without softcap or sinks (its window in the mask), rotates with its own node and takes both
    for config, refusal in ((narrow, "cannot rotate rope dim 8"), (longrope, "cannot express longrope")):
        plain = dataclasses.replace(config, softcap=None, sinks=False)
        model = build_step_model(plain, init_weights(plain, 1), "ort-fused", "buffer", buffer_core="grouped-mha")
        assert "MultiHeadAttention" in [n.op_type for n in model.graph.node]
        with pytest.raises(UsageError, match=refusal):  # auto prefills with GroupQueryAttention: its limits
            build_step_model(plain, init_weights(plain, 1), "ort-fused", "buffer", buffer_core="switch")
    with pytest.raises(UsageError, match="Attention \\(opset 23\\) does not express sinks"):
        build_step_model(buffer, weights, "onnx")
    out = tmp_path / "m.onnx"
    with pytest.raises(UsageError, match="outside what the Attention \\(opset 23\\) graph of this config is written at"):
        export_model(LLM_FUSED_CONFIGS["onnx"], out, attention="onnx", opset=22)
    assert not out.exists()


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_a_bidirectional_layer_with_rope(tmp_path, lowering):
    """No causal mask (an encoder with rope): GroupQueryAttention with causal=0; Attention-23 with the
    key padding mask alone, one row per query (the op broadcasts no query axis of its mask)."""
    config = dataclasses.replace(LLM_FUSED_CONFIGS[lowering], causal=False, sliding_window=None)
    weights = init_weights(config, 2)
    path = str(tmp_path / "m.onnx")
    onnx.save(build_model(config, weights, lowering), path)
    _passed(run_parity(ModelSource(config, weights, path), ["ort-cpu"], batches=(3,), seqs=(1, 9)))


# int8 / int4 projections: rope and q/k norms compose with the quantized error model ----------------
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_projections_of_a_rope_and_qk_norm_layer(tmp_path, dtype):
    """The projections quantized in the onnx full-sequence graph, the ort-fused growing step model and
    the buffer form (its packed q/k/v split for the norms): the pass finds q, k and v behind the
    norms and the rotation, each form passes under the quantized rows plus the rope term, and a step
    fed positions one too far fails there too."""
    config = dataclasses.replace(LLM_CONFIGS["llama"], qk_norm={"eps": 1e-6}, bias=True)
    weights = init_weights(config, 1)
    full = str(tmp_path / "full.onnx")
    export_model(config, full, weights, attention="onnx", dtype=dtype)
    assert set(describe(full).quantization["projections"]) == {"q", "k", "v", "out"}
    _passed(run_parity(ModelSource(config, weights, full, dtype=dtype), TESTED_BACKENDS, batches=(3,), seqs=(1, 9)))
    step = dataclasses.replace(config, kv_cache=True)
    for form in ("growing", "buffer"):
        path = str(tmp_path / f"{form}.onnx")
        export_model(step, path, weights, attention="ort-fused", dtype=dtype, decode_form=form)
        source = ModelSource(step, weights, path, dtype=dtype)
        if form == "buffer":
            assert set(describe(path).quantization["projections"]) == {"qkv", "out"}
            _passed(run_buffer_parity(source, prefills=(0, 5), steps=4, batch=2))
            continue

        def factory(name, source):
            runner = create_runner(name, source)
            right = runner.step
            runner.step = lambda x, state, m=None, p=None: right(x, state, m, p + 1 if state.length else p)
            return runner

        _passed(run_decode_parity(source, ["ort-cpu"], prefills=(0, 5), steps=4, batch=2))
        wrong = run_decode_parity(source, ["ort-cpu"], prefills=(5,), steps=4, batch=2, runner_factory=factory)
        assert [c.status for c in wrong.cases] == ["fail"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_projections_of_a_window_softcap_and_sinks_layer(tmp_path, dtype):
    """Every modern-LLM term under int8/int4 (the quantized error model holds through a window, softcap
    and sinks: model/tolerance.py): the decomposed full-sequence export and the ort-fused step model
    pass, and each term planted wrong in the quantized graph fails: the softcap dropped, the sinks
    dropped, the window one key wider."""
    # rope, a window, softcap, q/k norms, sinks, grouped heads; a cap the scores reach (|s| ~ 1), so that
    # dropping it is a fault int4's error (~8% of each projection) cannot hide
    config = dataclasses.replace(LLM_FUSED_CONFIGS["ort-fused"], softcap=0.5)
    weights = init_weights(config, 1)
    full = str(tmp_path / "full.onnx")
    export_model(config, full, weights, attention="decomposed", dtype=dtype)
    source = ModelSource(config, weights, full, dtype=dtype)
    _passed(run_parity(source, TESTED_BACKENDS, batches=(3,), seqs=(1, 9)))
    model = onnx.load(full)
    for name in ("softcap", "sinks"):
        wrong = onnx.ModelProto()
        wrong.CopyFrom(model)
        if name == "softcap":  # c * tanh(s / c) without the tanh: s itself
            next(n for n in wrong.graph.node if n.op_type == "Tanh").op_type = "Identity"
        else:  # a sink logit no probability reaches
            tensor = next(t for t in wrong.graph.initializer if t.name == "sinks")
            tensor.CopyFrom(numpy_helper.from_array(np.full_like(numpy_helper.to_array(tensor), -1e4), "sinks"))
        path = str(tmp_path / f"no-{name}.onnx")
        onnx.save(wrong, path)
        report = run_parity(dataclasses.replace(source, model_path=path), ["ort-cpu"], batches=(3,), seqs=(9,),
                            localise="off")  # fmt: skip
        assert [c.status for c in report.cases] == ["fail"], name
    # the window's fault as the registry writes its graph (the trace's twin: tests/export/test_decomposed_builders.py),
    # quantized as the export is; a second trace of the layer would cost 5-8 s of CPU and check nothing more
    wider = str(tmp_path / "wider.onnx")
    onnx.save(build_model(dataclasses.replace(config, sliding_window=config.sliding_window + 1), weights, "decomposed",
                          dtype=dtype), wider)  # fmt: skip
    report = run_parity(dataclasses.replace(source, model_path=wider), ["ort-cpu"], batches=(3,), seqs=(9,),
                        localise="off")  # fmt: skip
    assert [c.status for c in report.cases] == ["fail"]
    step = dataclasses.replace(config, kv_cache=True)
    path = str(tmp_path / "step.onnx")
    export_model(step, path, weights, attention="ort-fused", dtype=dtype)
    _passed(run_decode_parity(ModelSource(step, weights, path, dtype=dtype), ["ort-cpu"], prefills=(0, 5), steps=4,
                              batch=2))  # fmt: skip


def test_the_buffer_forms_rope_table_at_long_positions():
    """The table GroupQueryAttention rotates from, rows 8192..: the cos/sin of the float32 angle, within
    the rope term's eps * p * inv_freq of the float64 angle (a whole-prefill parity at position 8192
    measured 2.1e-5 against atol 2.6e-3: too slow for the suite, so the table itself is held here)."""
    from attnx.export._llm import rope_table
    from attnx.model.rope import rope_cos_sin, rope_frequencies

    config = LLM_FUSED_CONFIGS["buffer"]
    cos, sin = rope_table(config, 8200)
    positions = np.arange(8192, 8200)
    want_cos, want_sin = rope_cos_sin(config.rope, positions)
    inv_freq, factor = rope_frequencies(config.rope)
    bound = np.finfo(np.float32).eps * (positions[:, None] * inv_freq + 4) * factor  # the angle's rounding, a few ulps
    assert np.all(np.abs(cos[8192:] - want_cos) <= bound) and np.all(np.abs(sin[8192:] - want_sin) <= bound)
    assert np.abs(cos[8193:] - want_cos[:-1]).max() > 100 * bound.max()  # a row off by one is far outside it
