"""Localisation (issue 23): each planted fault is localised to the stage it was planted in, on every
backend that runs the model file (ONNX Runtime CPU, OpenVINO), and a passing case names no stage.

The faults are planted in the exported graph (the reference and the weights are left as they are),
by the names the export gives (docs/reference/onnx-graph.md, "Names"): the stage tensors by stage, the weights by their
safetensors names."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from attnx.model.config import AttentionConfig
from attnx.model.inputs import make_inputs
from attnx.model.stages import STAGES_KEY, stage_layouts
from attnx.model.tolerance import problem_size, tolerance_for
from attnx.model.weights import init_weights
from attnx.runtimes import ModelSource
from attnx.runtimes.base import backend_unavailable_reason
from attnx.runtimes.localise import localise_case
from attnx.runtimes.parity import run_parity
from attnx.workflows import export_model

TESTED_BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(backend_unavailable_reason(b) is not None,
                                                     reason=str(backend_unavailable_reason(b))))
            for b in ("ort-cpu", "openvino")]  # fmt: skip
SELF = AttentionConfig(d_model=32, n_heads=4, causal=True, key_padding_mask=True)
WINDOW = AttentionConfig(d_model=32, n_heads=4, causal=True, sliding_window=3)


def _export(tmp_path, config, attention="decomposed", dtype="fp32", name="model.onnx", **kw) -> str:
    path = str(tmp_path / name)
    export_model(config, path, init_weights(config, seed=1), attention=attention, dtype=dtype, validate=False, **kw)
    return path


def _initializer(model: onnx.ModelProto, prefix: str, suffix: str = "") -> onnx.TensorProto:
    found = [t for t in model.graph.initializer if t.name.startswith(prefix) and t.name.endswith(suffix)]
    assert len(found) == 1, (prefix, suffix, [t.name for t in model.graph.initializer])
    return found[0]


def _set(tensor: onnx.TensorProto, value: np.ndarray) -> None:
    tensor.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(value, numpy_helper.to_array(tensor).dtype),
                                            tensor.name))  # fmt: skip


def _producer(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if name in n.output)


def _localise(path, config, backend, *, dtype="fp32", batch=2, seq=9, levels=False, quantization=None):
    weights = init_weights(config, seed=1)
    feeds = make_inputs(config, batch, seq, None, seed=3, dtype="fp32")
    if config.key_padding_mask:  # some padding, never a whole row
        feeds["key_padding_mask"][:, :2] = True
    size = problem_size(config, weights, feeds, activations=quantization is not None)
    return localise_case(ModelSource(config, weights, path, dtype), backend, feeds,
                         tol=tolerance_for(dtype, backend, quantization), size=size, levels=levels)  # fmt: skip


# Faults: each edits a model in place and names the stage it must be localised to.
def wrong_scale(model: onnx.ModelProto) -> str:
    node = _producer(model, "scores")  # scale * (q k^T): its constant operand
    const = next(t for t in model.graph.initializer if t.name in node.input)
    _set(const, numpy_helper.to_array(const) * 1.25)
    return "scores"


def swapped_qk_weights(model: onnx.ModelProto) -> str:
    q, k = _initializer(model, "q_proj.weight"), _initializer(model, "k_proj.weight")
    qv, kv = numpy_helper.to_array(q).copy(), numpy_helper.to_array(k).copy()
    _set(q, kv), _set(k, qv)
    return "q"


def transposed_q_weight(model: onnx.ModelProto) -> str:
    q = _initializer(model, "q_proj.weight")
    _set(q, numpy_helper.to_array(q).T)
    return "q"


def inverted_key_padding(model: onnx.ModelProto) -> str:
    node = helper.make_node("Not", ["key_padding_mask"], ["key_padding_mask/inverted"], name="planted/Not")
    for n in model.graph.node:
        n.input[:] = ["key_padding_mask/inverted" if i == "key_padding_mask" else i for i in n.input]
    model.graph.node.insert(0, node)
    return "probs"


def permuted_heads(model: onnx.ModelProto) -> str:
    w = _initializer(model, "out_proj.weight")  # [heads * v_head_dim, d_model]: z's heads are its row blocks
    value = numpy_helper.to_array(w)
    blocks = value.reshape(SELF.n_heads, -1, value.shape[-1])
    _set(w, blocks[[1, 0, 2, 3]].reshape(value.shape))
    return "y"


GRAPH_FAULTS = [wrong_scale, swapped_qk_weights, transposed_q_weight, inverted_key_padding, permuted_heads]


@pytest.fixture(scope="module")
def self_model(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("self"), SELF)


@pytest.mark.parametrize("backend", TESTED_BACKENDS)
@pytest.mark.parametrize("fault", GRAPH_FAULTS, ids=lambda f: f.__name__)
def test_planted_fault_is_localised_to_its_stage(self_model, tmp_path, fault, backend):
    model = onnx.load(self_model)
    assert stage_layouts({p.key: p.value for p in model.metadata_props}), "the export names its stages"
    stage = fault(model)
    path = str(tmp_path / "fault.onnx")
    onnx.save(model, path)
    found = _localise(path, SELF, backend)
    assert found.stage == stage, found.line()
    first = next(c for c in found.checks if c.stage == stage)
    assert first.status == "fail" and first.max_abs > first.atol
    upstream = [c.stage for c in found.checks[: found.checks.index(first)] if c.status != "hidden"]
    assert found.agree == upstream  # every stage before it was exposed, compared and agreed
    assert found.nodes and found.nodes[0]["name"], found.line()
    assert stage in found.line() and "agree:" in found.line()


@pytest.mark.parametrize("backend", TESTED_BACKENDS)
def test_mask_off_by_one_is_localised_to_probs(tmp_path, backend):
    # The graph's window is one key wider than the formula's: the scores agree, the probabilities not.
    wider = dataclasses.replace(WINDOW, sliding_window=WINDOW.sliding_window + 1)
    path = _export(tmp_path, wider)
    model = onnx.load(path)
    for prop in model.metadata_props:  # the model says it is WINDOW's
        if prop.key == "attnx.config":
            prop.value = WINDOW.to_json()
    onnx.save(model, path)
    found = _localise(path, WINDOW, backend, levels=True)
    assert found.stage == "probs", found.line()
    assert "scores" in found.agree
    if backend == "ort-cpu":
        assert found.optimization == {"disabled": "fail"}  # off fails too: no level is run, none is the cause
        assert found.cause is None and "optimizations off too (not the optimizer)" in found.line()


def test_fused_operator_is_looked_inside(tmp_path):
    # The ort-fused form hides scores and probs in MultiHeadAttention: its window is planted one
    # key wider (an attention mask the op reads); the decomposed form of the same model agrees, so the
    # fused operator is named.
    wider = dataclasses.replace(WINDOW, sliding_window=WINDOW.sliding_window + 1)
    path = _export(tmp_path, wider, attention="ort-fused")
    model = onnx.load(path)
    for prop in model.metadata_props:
        if prop.key == "attnx.config":
            prop.value = WINDOW.to_json()
    onnx.save(model, path)
    found = _localise(path, WINDOW, "ort-cpu")
    assert "scores" in found.hidden and "probs" in found.hidden
    assert found.stage == "z", found.line()
    assert found.nodes[0]["op_type"] in ("MultiHeadAttention", "GroupQueryAttention", "Attention")
    assert found.inside is not None and found.inside["verdict"] == "agrees", found.inside
    assert "fused operator" in found.cause


def test_a_weight_fault_inside_a_fused_form_names_the_weight(tmp_path):
    # MultiHeadAttention folds the biases in: q and k are not exposed, the fault shows at z; the
    # weights the file holds (by their names, the packed bias split) name it.
    path = _export(tmp_path, SELF, attention="ort-fused")
    model = onnx.load(path)
    swapped_qk_weights(model)
    onnx.save(model, path)
    found = _localise(path, SELF, "ort-cpu")
    assert found.stage == "z" and {"q", "k"} <= set(found.hidden), found.line()
    assert found.weights == ["q_proj.weight", "k_proj.weight"] and found.inside is None
    assert "q_proj.weight, k_proj.weight" in found.cause and "weights differ" in found.line()


@pytest.mark.parametrize("backend", TESTED_BACKENDS)
def test_quantized_scale_doubled_is_localised_to_q(tmp_path, backend):
    path = _export(tmp_path, SELF, dtype="int8")
    model = onnx.load(path)
    scale = _initializer(model, "q_proj", "scale")
    _set(scale, numpy_helper.to_array(scale) * 2.0)
    onnx.save(model, path)
    from attnx.model.contract import describe

    quant = describe(path).quantization
    found = _localise(path, SELF, backend, dtype="int8", quantization=quant)
    assert found.stage == "q", found.line()


def test_fp16_overflow_is_localised_to_scores(tmp_path):
    config = AttentionConfig(d_model=32, n_heads=2, bias=False)
    weights = init_weights(config, seed=1)
    weights = {k: v * (400.0 if k in ("q_proj.weight", "k_proj.weight") else 1.0) for k, v in weights.items()}
    path = str(tmp_path / "fp16.onnx")
    export_model(config, path, weights, dtype="fp16", validate=False, keep_io_fp32=True)
    feeds = make_inputs(config, 1, 8, None, seed=0, dtype="fp32")
    size = problem_size(config, weights, feeds)
    found = localise_case(ModelSource(config, weights, path, "fp16"), "ort-cpu", feeds,
                          tol=tolerance_for("fp16", "ort-cpu"), size=size, levels=False)  # fmt: skip
    assert found.stage == "scores", found.line()  # q and k fit in fp16 (|q| < 1e3), scale * q.k does not (1.8e5 > 65504)
    assert not np.isfinite(found.checks[[c.stage for c in found.checks].index("scores")].max_abs or np.inf)


def test_optimizer_is_named_when_only_an_optimization_level_fails(tmp_path, monkeypatch):
    # A stand-in for an optimizer fault: the runner factory corrupts y when the session optimizes
    # (any level but disabled); localisation must say the optimizer changes the verdict.
    from attnx.runtimes import create_runner

    path = _export(tmp_path, SELF)

    def factory(name, source, **options):
        runner = create_runner(name, source, **options)
        opts = options.get("session_options")
        import onnxruntime as ort

        if opts is None or opts.graph_optimization_level != ort.GraphOptimizationLevel.ORT_DISABLE_ALL:
            run = runner.run_impl
            runner.run_impl = lambda feeds: {k: v * 1.01 if k == "y" else v for k, v in run(feeds).items()}
        return runner

    weights = init_weights(SELF, seed=1)
    feeds = make_inputs(SELF, 2, 5, None, seed=3, dtype="fp32")
    found = localise_case(ModelSource(SELF, weights, path), "ort-cpu", feeds, tol=tolerance_for("fp32", "ort-cpu"),
                          size=problem_size(SELF, weights, feeds), runner_factory=factory)  # fmt: skip
    assert found.optimization == {"disabled": "pass", "basic": "fail"}  # up to the first level that fails
    assert "optimizer" in found.cause and "basic" in found.cause


def test_passing_cases_name_no_stage(self_model):
    report = run_parity(ModelSource(SELF, init_weights(SELF, seed=1), self_model), ["ort-cpu", "openvino", "torch"],
                        batches=(1, 3), seqs=(1, 7), localise="all")  # fmt: skip
    assert report.passed
    ran = [c for c in report.cases if c.status == "pass"]
    assert ran and all(c.localisation and c.localisation["stage"] is None for c in ran), [
        c.localisation.get("line") for c in ran if c.localisation]
    assert all("error" not in c.localisation for c in ran)


def test_failing_parity_case_carries_its_localisation(self_model, tmp_path):
    model = onnx.load(self_model)
    wrong_scale(model)
    path = str(tmp_path / "fault.onnx")
    onnx.save(model, path)
    report = run_parity(ModelSource(SELF, init_weights(SELF, seed=1), path), ["ort-cpu", "torch"], batches=(2,),
                        seqs=(5,))  # fmt: skip
    failing = [c for c in report.cases if c.status == "fail"]
    assert [c.backend for c in failing] == ["ort-cpu"]
    assert failing[0].localisation["stage"] == "scores"
    assert failing[0].localisation["line"].startswith("localised: first stage beyond its bound: scores")
    assert all(c.localisation is None for c in report.cases if c.status == "pass")  # failing ones only, by default
    report = run_parity(ModelSource(SELF, init_weights(SELF, seed=1), path), ["ort-cpu"], batches=(2,), seqs=(5,),
                        localise="off")  # fmt: skip
    assert report.cases[0].status == "fail" and report.cases[0].localisation is None


def test_model_without_names_compares_its_outputs(tmp_path, self_model):
    model = onnx.load(self_model)
    keep = [p for p in model.metadata_props if p.key != STAGES_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    out = model.graph.initializer
    w = next(t for t in out if t.name.startswith("out_proj.bias"))
    _set(w, numpy_helper.to_array(w) + 1.0)
    path = str(tmp_path / "old.onnx")
    onnx.save(model, path)
    found = _localise(path, SELF, "ort-cpu")
    assert found.stage == "y" and "names no stages" in found.note
    assert set(found.hidden) >= {"q", "k", "v", "scores", "probs", "z"}


@pytest.mark.skipif(backend_unavailable_reason("openvino") is not None,
                    reason=str(backend_unavailable_reason("openvino")))  # fmt: skip
def test_openvino_shape_cache_fault_is_localised(tmp_path):
    # OpenVINO 2026.4's CPU shape cache (runtimes/openvino_runner.py's module doc), turned back on:
    # plain self-attention at seq >= 16 after a seq-1 run on the same compiled model is wrong. The
    # localisation replays what the runner ran before the failing case, and names a stage.
    from attnx.runtimes import create_runner

    config = AttentionConfig(d_model=64, n_heads=4)
    path = _export(tmp_path, config)

    def factory(name, source, **options):
        return create_runner(name, source, **({"shape_cache": True} if name == "openvino" else {}), **options)

    report = run_parity(ModelSource(config, init_weights(config, seed=1), path), ["openvino"], batches=(1,),
                        seqs=(1, 7, 128), runner_factory=factory)  # fmt: skip
    failing = [c for c in report.cases if c.status == "fail"]
    if not failing:
        pytest.skip("this OpenVINO computes right with its shape cache on: the fault is not there to localise")
    loc = failing[0].localisation
    # the fault is in OpenVINO's fused attention: the projections agree, z (its output) does not; with
    # scores and probs exposed it fuses nothing and computes right (the note says so)
    assert loc["stage"] == "z", loc["line"]
    assert loc["agree"] == ["q", "k", "v"] and {"scores", "probs"} <= set(loc["hidden"])
    assert "left inside the graph" in loc["note"]


@pytest.mark.parametrize("name", ["self", "causal", "kpm", "causal_kpm", "llm", "llama"])
def test_the_decomposed_form_a_look_inside_runs_is_the_formula(name):
    # What a look inside compares a fused operator with is built by hand (no trace): it must be the
    # formula itself, every stage named.
    import onnxruntime as ort

    from attnx.export import build_decomposed_model
    from attnx.model.reference import reference_attention
    from attnx.model.stages import stages_of
    from tests.conftest import CONFIGS, LLM_CONFIGS

    config = {**CONFIGS, **LLM_CONFIGS}[name]
    weights = init_weights(config, seed=1)
    model = build_decomposed_model(config, weights)
    assert set(stage_layouts({p.key: p.value for p in model.metadata_props})) == {s.name for s in stages_of(config)}
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = make_inputs(config, 3, 9, None, seed=2)
    want = reference_attention(config, weights, feeds["x"], key_padding_mask=feeds.get("key_padding_mask"),
                               position_ids=feeds.get("position_ids"))  # fmt: skip
    size = problem_size(config, weights, feeds)
    from attnx.runtimes.compare import compare_arrays

    assert compare_arrays("y", session.run(["y"], feeds)[0], want, tolerance_for("fp32"), size)


def test_a_model_with_external_data_is_localised(self_model, tmp_path):
    # A model over 2 GB keeps its weights beside it: the exposed copy keeps them there too.
    model = onnx.load(self_model)
    wrong_scale(model)
    path = str(tmp_path / "ext.onnx")
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="ext.onnx.data",
              size_threshold=0)  # fmt: skip
    found = _localise(path, SELF, "ort-cpu")
    assert found.stage == "scores", found.line()


def test_scores_and_probs_too_large_to_hold_are_left_inside(self_model, tmp_path, monkeypatch):
    # [batch, n_heads, seq, keys] in float64 grows with seq^2 (gpt3 at seq 2048: 9.7 GB): past the
    # limit they are neither recorded nor exposed, the rest still localises, and the note says why.
    from attnx.runtimes import localise as localise_module

    monkeypatch.setattr(localise_module, "CORE_STAGE_BYTES", 1000)
    model = onnx.load(self_model)
    permuted_heads(model)
    path = str(tmp_path / "fault.onnx")
    onnx.save(model, path)
    for backend in ("ort-cpu", "torch"):
        found = _localise(path, SELF, backend)
        assert {"scores", "probs"} <= set(found.hidden), found.line()
        assert "scores and probs not compared" in found.note
        if backend == "ort-cpu":
            assert found.stage == "y" and found.agree == ["q", "k", "v", "z"], found.line()


def test_localisation_that_would_not_fit_in_memory_is_refused_saying_so(self_model, tmp_path, monkeypatch):
    from attnx.runtimes import localise as localise_module

    monkeypatch.setattr(localise_module, "available_memory_bytes", lambda: 1000)
    model = onnx.load(self_model)
    wrong_scale(model)
    path = str(tmp_path / "fault.onnx")
    onnx.save(model, path)
    report = run_parity(ModelSource(SELF, init_weights(SELF, seed=1), path), ["ort-cpu"], batches=(2,), seqs=(5,))
    (case,) = report.cases
    assert case.status == "fail"  # the verdict stands; the localisation says why it did not run
    assert case.localisation["line"].startswith("not localised: localising needs about")


def test_a_matrix_parity_case_carries_its_localisation(self_model, tmp_path):
    from attnx.matrix._worker import _parity

    model = onnx.load(self_model)
    wrong_scale(model)
    path = str(tmp_path / "fault.onnx")
    onnx.save(model, path)
    result = _parity({"config": SELF.to_dict(), "seed": 1, "model_path": path, "dtype": "fp32", "backend": "ort-cpu",
                      "mem_seq": None, "batch": 2, "seq": 5})  # fmt: skip
    assert result["status"] == "fail" and result["localisation"]["stage"] == "scores"
    assert "localised: first stage beyond its bound: scores" in result["reason"]  # report.md's reasons show it


def test_a_torch_fault_is_localised_by_the_modules_own_stages(tmp_path):
    # The torch backend runs the module, not the graph: a key projection loaded wrong there (scaled
    # 1.1) is found at k, q and v agreeing, from the stages the module records.
    import torch

    from attnx.runtimes import create_runner

    def factory(name, source, **options):
        runner = create_runner(name, source, **options)
        if name == "torch":
            load = runner.load_impl

            def wrong_load():
                load()
                k = runner.module.k_proj  # a new tensor: the module's weights share the reference's memory
                k.weight = torch.nn.Parameter(k.weight.detach() * 1.1, requires_grad=False)

            runner.load_impl = wrong_load
        return runner

    report = run_parity(ModelSource(SELF, init_weights(SELF, seed=1)), ["torch"], batches=(2,), seqs=(5,),
                        runner_factory=factory)  # fmt: skip
    (case,) = report.cases
    assert case.status == "fail" and case.localisation["stage"] == "k", case.localisation
    assert case.localisation["agree"] == ["q"] and "the torch module's" in case.localisation["line"]


def _fused_fault(tmp_path) -> tuple[ModelSource, str]:
    """The ort-fused form with MultiHeadAttention's scale x1.25: a fault inside the fused operator."""
    path = _export(tmp_path, SELF, attention="ort-fused")
    model = onnx.load(path)
    mha = next(n for n in model.graph.node if n.op_type == "MultiHeadAttention")
    scale = next((a for a in mha.attribute if a.name == "scale"), None)
    if scale is None:
        mha.attribute.append(helper.make_attribute("scale", 1.25 * SELF.softmax_scale))
    else:
        scale.f *= 1.25
    onnx.save(model, path)
    return ModelSource(SELF, init_weights(SELF, seed=1), path), path


def test_a_parity_localisation_reuses_the_cases_reference(tmp_path, monkeypatch):
    # The reference's stages of the failing case (recorded by its own run, scores and probs aside) serve
    # the localisation; scores and probs are computed only where a stage compared needs them: the look
    # inside whose decomposed form diverges (planted here: its scale x1.25) is named at scores.
    from attnx.runtimes import localise as loc

    source, _ = _fused_fault(tmp_path)
    calls = []
    real = loc.reference_stages
    monkeypatch.setattr(loc, "reference_stages", lambda *a, **k: calls.append(a[3:] or k) or real(*a, **k))
    report = run_parity(source, ["ort-cpu"], batches=(2,), seqs=(5,))
    (case,) = report.cases
    assert case.status == "fail" and (case.localisation["inside"] or {}).get("verdict") == "agrees", case.localisation["line"]
    assert calls == []  # the fused form names no scores: the case's own reference served

    write = loc._decomposed_writer

    def wrong_decomposed(src, directory):  # the scale constant of the hand-built form x1.25
        model = write(src, directory)
        node = _producer(model, "scores")
        while not any(t.name in node.input for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT):
            node = _producer(model, node.input[0])  # back through the reshape to the scale's Mul
        const = next(t for t in model.graph.initializer if t.name in node.input)
        _set(const, numpy_helper.to_array(const) * 1.25)
        return model

    monkeypatch.setattr(loc, "_decomposed_writer", wrong_decomposed)
    (case,) = run_parity(source, ["ort-cpu"], batches=(2,), seqs=(5,)).cases
    assert case.localisation["inside"]["verdict"] == "diverges", case.localisation["line"]
    assert case.localisation["inside"]["stage"] == "scores" and calls == [(True,)]


def test_a_small_case_is_localised_on_one_thread(tmp_path, monkeypatch):
    from attnx.runtimes import create_runner
    from attnx.runtimes import localise as loc

    source, _ = _fused_fault(tmp_path)
    seen = []

    def factory(name, src, **options):
        seen.append(options.get("threads"))
        return create_runner(name, src, **options)

    run_parity(source, ["ort-cpu"], batches=(2,), seqs=(5,), runner_factory=factory)
    # the reference's and ort-cpu's runners for the parity, then the localisation's: the exposed model, the look inside
    assert seen == [None, None, 1, 1], seen
    seen.clear()
    monkeypatch.setattr(loc, "SMALL_CASE_FLOPS", 0)
    report = run_parity(source, ["ort-cpu"], batches=(2,), seqs=(5,), runner_factory=factory)
    assert report.cases[0].localisation["stage"] == "z" and set(seen) == {None}


def test_a_graph_saved_by_ort_offline_optimization_is_localised(self_model, tmp_path):
    # ONNX Runtime's saved graph keeps the stage tensors' names (its fused nodes are named after ours)
    from attnx.runtimes.ort_offline import optimize_for_provider

    model = onnx.load(self_model)
    wrong_scale(model)
    onnx.save(model, tmp_path / "fault.onnx")
    optimize_for_provider(str(tmp_path / "fault.onnx"), str(tmp_path / "saved.onnx"), "cpu", "all")
    (case,) = run_parity(ModelSource(SELF, init_weights(SELF, seed=1), str(tmp_path / "saved.onnx")), ["ort-cpu"],
                         batches=(2,), seqs=(5,)).cases  # fmt: skip
    assert case.status == "fail" and case.localisation["stage"] == "scores", case.localisation["line"]
    assert case.localisation["nodes"] and {"q", "k", "v"} <= set(case.localisation["agree"])
