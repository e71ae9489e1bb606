"""The step model on every backend: prefill + single-token steps equal the full forward."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest

from attnx.errors import UsageError
from attnx.export import build_step_model
from attnx.model import AttentionConfig, init_weights
from attnx.model.contract import BUFFER_CORES, describe
from attnx.runtimes import ModelSource, create_runner
from attnx.runtimes.decode import make_decode_inputs, run_decode_parity
from attnx.runtimes.parity import run_parity

TESTED_BACKENDS = ["reference", "torch", "ort-cpu", "ort-cuda", "torch-cuda"]


def _step(heads: int, kv_heads: int, kpm: bool = True) -> AttentionConfig:
    return AttentionConfig(d_model=32, n_heads=heads, n_kv_heads=kv_heads, causal=True, key_padding_mask=kpm,
                           kv_cache=True)  # fmt: skip


@pytest.fixture(scope="module")
def step_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("step")
    cache = {}

    def get(config: AttentionConfig, attention: str) -> str:
        key = (config, attention)
        if key not in cache:
            path = str(root / f"step-{len(cache)}.onnx")
            onnx.save(build_step_model(config, init_weights(config, 0), attention), path)
            cache[key] = path
        return cache[key]

    return get


@pytest.mark.parametrize("attention", ["decomposed", "onnx", "ort-fused"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_decode_parity_every_backend(step_models, attention, heads, kv_heads):
    """P in {0, 1, 37}, 64 steps, batch 3 left-padded (row 2's first queries see no key)."""
    c = _step(heads, kv_heads)
    w = init_weights(c, 0)
    backends = TESTED_BACKENDS if attention == "decomposed" else ["ort-cpu", "ort-cuda"]
    report = run_decode_parity(ModelSource(c, w, step_models(c, attention)), backends, prefills=(0, 1, 37), steps=64,
                               batch=3)  # fmt: skip
    ran = {case.backend for case in report.cases if case.status == "pass"}
    assert report.passed, [case.reason for case in report.cases if case.status == "fail"]
    assert {"ort-cpu"} <= ran and (attention != "decomposed" or {"reference", "torch"} <= ran)
    assert {case.prefill for case in report.cases} == {0, 1, 37} and {case.steps for case in report.cases} == {64}
    for case in report.cases:
        if case.status == "skipped":
            assert case.backend.endswith("cuda") and case.reason


def test_long_prefill_then_steps(step_models):
    """P = 2048 (the long case), then 8 steps, GQA with left padding, on ORT's fused op and torch."""
    c = _step(4, 2)
    w = init_weights(c, 0)
    report = run_decode_parity(ModelSource(c, w, step_models(c, "ort-fused")), ["ort-cpu", "torch"],
                               prefills=(2048,), steps=8, batch=2)  # fmt: skip
    assert report.passed and len([x for x in report.cases if x.status == "pass"]) == 2


def test_a_step_that_drops_the_cache_fails(step_models):
    """The check can fail: a runner that forgets the cache between steps disagrees."""
    from attnx.runtimes.ort_runner import OrtCpuRunner

    c = _step(4, 2, kpm=False)
    w = init_weights(c, 0)

    class Forgetful(OrtCpuRunner):
        def run_step_impl(self, feeds):
            feeds = dict(feeds)
            for name in ("past_key", "past_value"):  # keep only the last position
                cache = feeds[name].numpy() if hasattr(feeds[name], "numpy") else feeds[name]
                feeds[name] = np.ascontiguousarray(cache[:, :, -1:])
            return super().run_step_impl(feeds)

    def factory(name, source):
        return Forgetful(source) if name == "ort-cpu" else create_runner(name, source)

    report = run_decode_parity(ModelSource(c, w, step_models(c, "decomposed")), ["ort-cpu"], prefills=(3,), steps=4,
                               batch=1, runner_factory=factory)  # fmt: skip
    assert not report.passed and report.cases[0].status == "fail" and "y[" in report.cases[0].reason


def test_decoder_api_and_describe(step_models):
    c = _step(4, 1)
    w = init_weights(c, 0)
    path = step_models(c, "onnx")
    info = describe(path)
    assert info.decode == "growing" and info.lowering == "onnx" and info.config == c
    assert [s.shape for s in info.inputs][1] == ("batch", 1, "past_seq", 8)
    feeds = make_decode_inputs(c, 2, 6, seed=4)
    x, kpm = feeds["x"], feeds["key_padding_mask"]
    with (
        create_runner("ort-cpu", ModelSource(c, w, path)) as runner,
        create_runner("reference", ModelSource(c, w)) as ref,
    ):
        state = runner.prefill(x[:, :5], kpm[:, :5])
        rstate = ref.prefill(x[:, :5], kpm[:, :5])
        assert state.y.shape == (2, 5, 32) and np.allclose(state.y, rstate.y, atol=1e-5)  # the prompt's y
        y1, state = runner.step(x[:, 5:], state)
        ry1, rstate = ref.step(x[:, 5:], rstate)
        assert state.length == 6 and state.key_padding_mask.shape == (2, 6) and state.y is y1
        assert np.allclose(y1, ry1, atol=1e-5)
        assert type(state.past_key).__name__ == "OrtValue"  # the cache stayed in ORT's buffers
        with pytest.raises(Exception, match="key_padding_mask of a step must be bool"):
            runner.step(x[:, 5:], state, np.zeros((2, 2), bool))
    plain = AttentionConfig(d_model=32, n_heads=4)
    with (
        create_runner("reference", ModelSource(plain, init_weights(plain, 0))) as ref,
        pytest.raises(UsageError, match="need a step model"),
    ):
        ref.prefill(x)


def test_grouped_full_sequence_parity_and_fused_refusal(tmp_path):
    """Full-sequence GQA/MQA (no cache): the decomposed, onnx and ort-fused (GroupQueryAttention: the
    registry's next core after MultiHeadAttention, which has no grouped heads) lowerings pass the parity
    matrix; the packed ones (MultiHeadAttention alone) refuse by name."""
    from attnx.export import build_model
    from attnx.workflows import export_model

    for kv_heads in (2, 1):
        c = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=kv_heads, causal=True, key_padding_mask=True)
        w = init_weights(c, 1)  # tests/export/test_names.py's GROUPED weights: its trace of the decomposed form reused
        for attention in ("decomposed", "onnx", "ort-fused"):
            path = str(tmp_path / f"{attention}-{kv_heads}.onnx")
            export_model(c, path, w, attention=attention, validate=False)  # the parity matrix below checks it
            report = run_parity(ModelSource(c, w, path), ["reference", "torch", "ort-cpu"], batches=(1, 3),
                                seqs=(1, 7, 40))  # fmt: skip
            assert report.passed and not [x for x in report.cases if x.status != "pass"]
        assert describe(path).operators.get("com.microsoft.GroupQueryAttention") == 1
        with pytest.raises(UsageError, match="MultiHeadAttention does not express grouped_heads"):
            build_model(c, w, "ort-fused-packed")


def test_cli_parity_decode(tmp_path, capsys):
    import json

    from attnx.cli import main

    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(_step(4, 2).to_dict()))
    out = tmp_path / "p.json"
    rc = main(["parity", "--config", str(cfg), "--decode", "--prefill", "0,3", "--steps", "4", "--batch", "2",
               "--backends", "reference,ort-cpu", "--attention", "onnx", "--json", str(out)])  # fmt: skip
    assert rc == 0
    cases = json.loads(out.read_text())["cases"]
    assert {(c["backend"], c["prefill"], c["steps"], c["status"]) for c in cases} == {
        (b, p, 4, "pass") for b in ("reference", "ort-cpu") for p in (0, 3)
    }
    # a step model's parity is step by step, --decode or not (the config says it is one)
    capsys.readouterr()
    assert main(["parity", "--config", str(cfg), "--prefill", "2", "--steps", "1", "--batch", "1",
                 "--backends", "reference"]) == 0  # fmt: skip
    assert "prefill" in capsys.readouterr().out


def _fused_ops(graph: onnx.GraphProto) -> list[str]:
    """The com.microsoft ops of a graph, an If's as {then: [...], else: [...]}."""
    ops = []
    for n in graph.node:
        if n.domain == "com.microsoft":
            ops.append(n.op_type)
        elif n.op_type == "If":
            ops.append({a.name.removesuffix("_branch"): _fused_ops(a.g) for a in n.attribute})
    return ops


BUFFER_CORE_OPS = {"grouped-mha": ["MultiHeadAttention"], "gqa": ["GroupQueryAttention"],
                   "switch": [{"then": ["MultiHeadAttention"], "else": ["GroupQueryAttention"]}]}  # fmt: skip


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("core", [c for c in BUFFER_CORES if c in BUFFER_CORE_OPS])  # decomposed's: its own file
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_buffer_form_step_parity(tmp_path, heads, kv_heads, core, window):
    """The buffer form: one preallocated cache bound as past and present (IOBinding), P 0/1/37 + 64 steps;
    its core either op (buffer_core: the grouped MultiHeadAttention where it can, GroupQueryAttention),
    or both (auto: the grouped core for a one-token call, GroupQueryAttention for a prefill)."""
    from attnx.export import build_model
    from attnx.runtimes.decode import run_buffer_parity

    c = dataclasses.replace(_step(heads, kv_heads, kpm=False), sliding_window=window)
    w = init_weights(c, 0)
    path = str(tmp_path / "buffer.onnx")
    model = build_model(c, w, "ort-fused", "buffer", buffer_core=core)
    assert _fused_ops(model.graph) == BUFFER_CORE_OPS[core]
    onnx.save(model, path)
    info = describe(path)
    assert info.decode == "buffer" and info.lowering == "ort-fused"
    assert [s.name for s in info.inputs] == ["x", "past_key", "past_value", "seqlens_k", "total_sequence_length"]
    report = run_buffer_parity(ModelSource(c, w, path), prefills=(0, 1, 37), steps=64, batch=3)
    assert report.passed and len(report.cases) == 3 and all(x.status == "pass" for x in report.cases)


def test_the_buffer_forms_grouped_core_is_asked_for_and_refused_where_it_cannot_go(tmp_path):
    """--buffer-core grouped-mha: MultiHeadAttention with a group's query heads as rows (num_heads = the
    kv heads; a window in its mask); refused by name for softcap, sinks and fp16. GroupQueryAttention is
    the default."""
    c = _step(4, 2, kpm=False)
    w = init_weights(c, 0)
    assert "GroupQueryAttention" in [n.op_type for n in build_step_model(c, w, "ort-fused", form="buffer").graph.node]
    model = build_step_model(c, w, "ort-fused", form="buffer", buffer_core="grouped-mha")
    (mha,) = [n for n in model.graph.node if n.op_type == "MultiHeadAttention"]
    assert {a.name: a.i for a in mha.attribute if a.name == "num_heads"} == {"num_heads": 2}
    build_step_model(dataclasses.replace(c, sliding_window=3), w, "ort-fused", "buffer", buffer_core="grouped-mha")
    for change, message in (({"softcap": 2.0}, "does not express softcap"), ({"sinks": True}, "does not express sinks")):
        other = dataclasses.replace(c, **change)
        with pytest.raises(UsageError, match=message):
            build_step_model(other, init_weights(other, 0), "ort-fused", "buffer", buffer_core="grouped-mha")
    for core in ("grouped-mha", "switch"):
        with pytest.raises(UsageError, match="is not built in fp16"):
            build_step_model(c, w, "ort-fused", "buffer", "fp16", buffer_core=core)
    from attnx.workflows import export_model

    with pytest.raises(UsageError, match="is the buffer form's"):
        export_model(c, tmp_path / "g.onnx", w, attention="ort-fused", buffer_core="grouped-mha")
    assert not list(tmp_path.iterdir())


def test_buffer_form_refusals():
    c = _step(4, 2, kpm=False)
    w = init_weights(c, 0)
    with pytest.raises(UsageError, match="onnx has no buffer form .*; use --attention decomposed or ort-fused"):
        build_step_model(c, w, "onnx", form="buffer")
    with pytest.raises(UsageError, match="does not express key_padding_mask in the buffer form"):
        build_step_model(_step(4, 2), init_weights(_step(4, 2), 0), "ort-fused", form="buffer")
    with pytest.raises(UsageError, match="ort-attention has no growing form"):
        build_step_model(c, w, "ort-attention")


def test_cli_run_with_a_cache(step_models, tmp_path):
    """attnx run on a step model: a prefill writes the cache, a step reads it back; equal to the full run."""
    from attnx.cli import main

    c = _step(4, 2)
    path = step_models(c, "ort-fused")
    feeds = make_decode_inputs(c, 2, 6, seed=7)
    files = {}
    for name, array in (("x5", feeds["x"][:, :5]), ("x1", feeds["x"][:, 5:]), ("x6", feeds["x"]),
                        ("m5", feeds["key_padding_mask"][:, :5]), ("m6", feeds["key_padding_mask"])):  # fmt: skip
        files[name] = str(tmp_path / f"{name}.npy")
        np.save(files[name], array)
    out = {n: str(tmp_path / f"{n}.npy") for n in ("y5", "pk", "pv", "y1", "y6")}
    assert main(["run", path, "--input", files["x5"], "--key-padding-mask", files["m5"], "--output", out["y5"],
                 "--present-key", out["pk"], "--present-value", out["pv"]]) == 0  # fmt: skip
    assert main(["run", path, "--input", files["x1"], "--key-padding-mask", files["m6"], "--past-key", out["pk"],
                 "--past-value", out["pv"], "--output", out["y1"]]) == 0  # fmt: skip
    assert main(["run", path, "--input", files["x6"], "--key-padding-mask", files["m6"], "--output", out["y6"]]) == 0
    stepped = np.concatenate([np.load(out["y5"]), np.load(out["y1"])], axis=1)
    assert np.allclose(stepped, np.load(out["y6"]), atol=1e-5)
    # the mask must cover past + new positions: one clear error, exit 2
    assert main(["run", path, "--input", files["x1"], "--key-padding-mask", files["m5"], "--past-key", out["pk"],
                 "--past-value", out["pv"], "--output", out["y1"]]) == 2  # fmt: skip


def test_step_model_other_shapes(tmp_path):
    """v_head_dim != head_dim, no biases, a custom scale: decomposed and onnx pass step by step; the
    fused ops (which need v_head_dim == head_dim) are refused by name; ort-fused without biases passes."""
    odd = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, head_dim=10, v_head_dim=6, causal=True,
                          key_padding_mask=True, kv_cache=True)  # fmt: skip
    plain = AttentionConfig(d_model=32, n_heads=4, bias=False, scale=0.3, causal=True, kv_cache=True)
    for c, lowerings in ((odd, ("decomposed", "onnx")), (plain, ("decomposed", "onnx", "ort-fused"))):
        w = init_weights(c, 0)
        for attention in lowerings:
            path = str(tmp_path / f"{attention}.onnx")
            onnx.save(build_step_model(c, w, attention), path)
            report = run_decode_parity(ModelSource(c, w, path), ["ort-cpu"], prefills=(0, 5), steps=6, batch=3)
            assert report.passed and all(x.status == "pass" for x in report.cases), attention
    with pytest.raises(UsageError, match="needs v_head_dim == head_dim"):
        build_step_model(odd, init_weights(odd, 0), "ort-fused")


def test_export_buffer_form_cli(tmp_path, capsys):
    """attnx export --decode-form buffer writes and validates the buffer form; inspect names it;
    attnx run and runner.prefill point at BufferDecoder; the form is refused where it does not apply."""
    import json

    from attnx.cli import main

    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(_step(4, 2, kpm=False).to_dict()))
    model = str(tmp_path / "buffer.onnx")
    assert main(["export", "--config", str(cfg), "--attention", "ort-fused", "--decode-form", "buffer",
                 "--out", model]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["inspect", model, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["decode"] == "buffer" and info["lowering"] == "ort-fused"
    assert [i["name"] for i in info["inputs"]][3:] == ["seqlens_k", "total_sequence_length"]
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((1, 2, 32), np.float32))
    assert main(["run", model, "--input", str(x), "--output", str(tmp_path / "y.npy")]) == 2
    assert "BufferDecoder" in capsys.readouterr().err
    source = ModelSource(_step(4, 2, kpm=False), None, model)
    with create_runner("ort-cpu", source) as runner, pytest.raises(UsageError, match="buffer form"):
        runner.prefill(np.zeros((1, 2, 32), np.float32))
    assert main(["export", "--config", str(cfg), "--attention", "onnx", "--decode-form", "buffer", "--out",
                 str(tmp_path / "d.onnx")]) == 2  # fmt: skip
    assert main(["export", "--preset", "tiny", "--decode-form", "buffer", "--out", str(tmp_path / "t.onnx")]) == 2
    assert not (tmp_path / "d.onnx").exists() and not (tmp_path / "t.onnx").exists()


@pytest.mark.cuda
@pytest.mark.parametrize("attention", ["decomposed", "onnx", "ort-fused"])
def test_decode_parity_on_the_gpu(step_models, attention):
    """ort-cuda (the cache fed back as ORT's device OrtValues) and torch-cuda, step by step;
    skipped with the backend's own reason where no GPU runs."""
    from attnx.runtimes.ort_runner import ort_cuda_unavailable_reason
    from attnx.runtimes.torch_runner import torch_cuda_unavailable_reason

    reasons = [r for r in (ort_cuda_unavailable_reason(), torch_cuda_unavailable_reason()) if r]
    if len(reasons) == 2:
        pytest.skip("; ".join(reasons))
    c = _step(4, 2)
    w = init_weights(c, 0)
    report = run_decode_parity(ModelSource(c, w, step_models(c, attention)), ["ort-cuda", "torch-cuda"],
                               prefills=(0, 37), steps=16, batch=3)  # fmt: skip
    assert report.passed, [x.reason for x in report.cases if x.status != "pass"]


@pytest.mark.cuda
@pytest.mark.parametrize("core", BUFFER_CORES)
def test_buffer_form_on_the_gpu(tmp_path, core):
    from attnx.export import build_model
    from attnx.runtimes.decode import run_buffer_parity
    from attnx.runtimes.ort_runner import ort_cuda_unavailable_reason

    reason = ort_cuda_unavailable_reason()
    if reason:
        pytest.skip(reason)
    from attnx.errors import ProviderUnavailable
    from attnx.model.cores import CORES, LOWERING_OF_CORE, why_not_on_cuda

    c = _step(4, 2, kpm=False)
    w = init_weights(c, 0)
    path = str(tmp_path / "buffer.onnx")
    # each core in a dtype its CUDA kernel runs (gqa: fp16); one CUDA runs in none is refused before its first run
    # (measured on an H200: the grouped core's in-place cache, a CUDA error 700 that ended the process)
    dtype = next((d for d in ("fp16", "fp32") if d in CORES[core].dtypes and not why_not_on_cuda(core, c, d, "buffer")),
                 None)  # fmt: skip
    onnx.save(build_model(c, w, LOWERING_OF_CORE[core], "buffer", dtype or "fp32", buffer_core=core), path)
    source = ModelSource(c, w, path, dtype or "fp32")
    if dtype is None:
        with pytest.raises(ProviderUnavailable, match="cache_indirection"):
            run_buffer_parity(source, "ort-cuda", prefills=(0, 37), steps=16, batch=2)
    else:
        assert run_buffer_parity(source, "ort-cuda", prefills=(0, 37), steps=16, batch=2).passed


def test_commands_that_do_not_take_a_step_model_say_so(step_models, tmp_path, capsys):
    import json

    from attnx.cli import main

    c = _step(4, 2, kpm=False)
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(c.to_dict()))
    model = step_models(c, "decomposed")
    for argv, needle in (
        (["bench", "--config", str(cfg), "--seq", "8"], "attnx bench --decode"),
        (["bench", "--model", model], "attnx bench --decode"),
        (["optimize", model, "--out", str(tmp_path / "o.onnx")], "not optimize"),
        (["export", "--config", str(cfg), "--attention", "measure", "--out", str(tmp_path / "a.onnx")], "measure"),
        (["export", "--config", str(cfg), "--dtype", "fp16", "--keep-io-fp32", "--out", str(tmp_path / "h.onnx")],
         "--keep-io-fp32 is for the full-sequence model"),
    ):
        assert main(argv) == 2, argv
        assert needle in capsys.readouterr().err
    assert not any(p.suffix == ".onnx" for p in tmp_path.iterdir())


def test_openvino_skips_the_fused_step_model_with_its_reason(step_models):
    """OpenVINO passes the decomposed and onnx step models (the parity above) but fails at run time on
    the fused ops with a past: it is skipped with that reason, never a crash of the whole parity run."""
    from attnx.runtimes.openvino_runner import OpenvinoRunner

    if OpenvinoRunner.unavailable_reason() is not None:
        pytest.skip(OpenvinoRunner.unavailable_reason())
    c = _step(4, 2, kpm=False)
    w = init_weights(c, 0)
    report = run_decode_parity(ModelSource(c, w, step_models(c, "ort-fused")), ["openvino", "ort-cpu"], prefills=(0,),
                               steps=2, batch=1)  # fmt: skip
    by_backend = {case.backend: case for case in report.cases}
    assert by_backend["ort-cpu"].status == "pass"
    assert by_backend["openvino"].status == "skipped" and "ort-fused step model" in by_backend["openvino"].reason


def test_the_grouped_buffer_core_switches_longrope_mid_decode(tmp_path):
    """longrope with an original length of 6 in the buffer form (its grouped core rotates with its own
    node, positions from total_sequence_length): a prefill of 3 then steps past position 6 switch to
    the long factors for the calls that reach it, as transformers does (decode parity's reference)."""
    from attnx.runtimes.decode import run_buffer_parity

    c = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, causal=True, kv_cache=True,
                        rope={"theta": 10000.0, "scaling": {
                            "rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5],
                            "long_factor": [3.0, 5.0, 7.0, 9.0], "original_max_position_embeddings": 6,
                            "factor": 4.0}})  # fmt: skip
    w = init_weights(c, 1)
    path = str(tmp_path / "buffer.onnx")
    onnx.save(build_step_model(c, w, "ort-fused", form="buffer", buffer_core="grouped-mha"), path)
    report = run_buffer_parity(ModelSource(c, w, path), prefills=(0, 3, 8), steps=6, batch=2)
    assert report.passed, [x.reason for x in report.cases if x.status != "pass"]


class _Binding:
    """What bind_cache asks of an IOBinding: the names bound, each to its buffer."""

    def __init__(self) -> None:
        self.inputs, self.outputs = {}, {}

    def bind_ortvalue_input(self, name, value):
        self.inputs[name] = value

    def bind_ortvalue_output(self, name, value):
        self.outputs[name] = value


def test_the_device_cache_is_allocated_and_bound_as_the_config_lays_it_out():
    """cache_buffers/bind_cache (BufferDecoder's and the bench's device cache) read cache_specs: a GQA config's keys
    and values, n_kv_heads x (head_dim + v_head_dim) a token; a latent one's one buffer of 1 x (rope +
    kv_lora_rank); each buffer bound as both its past and its present (written in place)."""
    from attnx.runtimes.decode import bind_cache, cache_buffers

    gqa = AttentionConfig(d_model=48, n_heads=4, n_kv_heads=2, head_dim=12, v_head_dim=8, causal=True, kv_cache=True)
    mla = AttentionConfig(d_model=64, n_heads=4, head_dim=24, v_head_dim=16, bias=False, causal=True, kv_cache=True,
                          rope={"theta": 10000.0, "dim": 8, "interleaved": True},
                          latent={"kv_lora_rank": 32, "q_lora_rank": 16, "eps": 1e-6})  # fmt: skip
    for config, shapes in ((gqa, [(3, 2, 7, 12), (3, 2, 7, 8)]), (mla, [(3, 1, 7, 8 + 32)])):
        cache = cache_buffers(config, 3, 7, np.float16)
        assert [a.shape for _, a in cache] == shapes and {a.dtype for _, a in cache} == {np.dtype(np.float16)}
        per_token = sum(a.size for _, a in cache) // (3 * 7)
        assert per_token == config.cache_values() == sum(spec.token_values for spec, _ in cache)
        binding = _Binding()
        bind_cache(binding, cache)
        assert list(binding.inputs) == config.input_names()[1 : 1 + len(cache)]
        assert list(binding.outputs) == [s.name for s in config.outputs()[1:]]
        assert all(binding.inputs[s.past] is binding.outputs[s.present] for s, _ in cache)
    assert gqa.cache_values() == 2 * (12 + 8) and mla.cache_values() == 1 * (8 + 32)
