"""The decomposed core's buffer form: each row's new tokens written into one fixed buffer per cache tensor by
TensorScatter-24 (per-head keys and values, or the latent), in place when present is bound to past; proven against the
float64 reference, prefill + steps and rows of other lengths in one call."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from attnx.errors import UsageError
from attnx.export import build_model
from attnx.export._emit import graph_opset
from attnx.model import AttentionConfig, init_weights
from attnx.model.contract import buffer_form_specs, describe
from attnx.model.cores import BUFFER_CORES, core_for, lowerings_for, why_not
from attnx.runtimes import ModelSource, create_runner
from attnx.runtimes.decode import BufferDecoder, run_buffer_parity

_STEP = dict(causal=True, kv_cache=True)
_ROPE = {"theta": 10000.0, "dim": 8, "interleaved": True}
# DeepSeek's latent attention, small: heads of 24 for q and k (8 rotated), 16 for v; latent ranks 16 (q) and 32 (kv)
MLA = AttentionConfig(d_model=64, n_heads=4, head_dim=24, v_head_dim=16, bias=False, rope=_ROPE,
                      latent={"kv_lora_rank": 32, "q_lora_rank": 16, "eps": 1e-6}, **_STEP)  # fmt: skip
CONFIGS = {
    "mha": AttentionConfig(d_model=32, n_heads=4, **_STEP),
    "grouped-window": AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, sliding_window=5, **_STEP),
    "rope-softcap-sinks": AttentionConfig(d_model=32, n_heads=4, n_kv_heads=1, rope=_ROPE, softcap=20.0, sinks=True,
                                          qk_norm={"eps": 1e-6}, **_STEP),  # fmt: skip
    "mla": MLA,
    # q_proj instead of the q latent, biases, half-split pairs, a yarn rope with its mscale ratio
    "mla-q-proj-yarn": dataclasses.replace(MLA, bias=True, latent={"kv_lora_rank": 32, "q_lora_rank": None, "eps": 1e-6},
                                           rope={**_ROPE, "interleaved": False, "scaling": {
                                               "rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 4, "mscale": 1.0,
                                               "mscale_all_dim": 0.8}}),  # fmt: skip
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{name: (config, weights, path)}: each config's decomposed buffer form, written once."""
    root = tmp_path_factory.mktemp("decomposed-buffer")
    out = {}
    for name, config in CONFIGS.items():
        weights = init_weights(config, 0)
        path = str(root / f"{name}.onnx")
        onnx.save(build_model(config, weights, "decomposed", "buffer"), path)
        out[name] = (config, weights, path)
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_buffer_form_equals_the_reference_prefill_steps_and_rows_of_other_lengths(models, name):
    """Per-head (MHA, grouped heads with a window, rope with softcap, sinks and q/k norms) and the latent (q_lora_rank
    set and None, v_head_dim unlike the qk size): prefills 0 and 5 then 4 steps, batch 2; then three rows of prompts
    of 5, 2 and 7 tokens, each run into its own row, and 4 steps of every row in one call."""
    config, weights, path = models[name]
    info = describe(path)
    assert info.decode == "buffer" and info.lowering == "decomposed"
    assert [s.name for s in info.inputs] == [s.name for s in buffer_form_specs(config)[0]]
    model = onnx.load(path, load_external_data=False)
    assert {o.domain: o.version for o in model.opset_import}[""] == 24
    scatters = [n for n in model.graph.node if n.op_type == "TensorScatter"]
    assert len(scatters) == len(config.cache_specs())  # one a cache tensor: keys and values, or the latent
    report = run_buffer_parity(ModelSource(config, weights, path), prefills=(0, 5), steps=4, batch=2, rows=(5, 2, 7))
    assert [c.status for c in report.cases] == ["pass"] * 3, [c.reason for c in report.cases]
    assert report.cases[-1].batch == 3 and report.cases[-1].prefill == 7


def test_the_latent_buffer_is_one_tensor_of_the_latents():
    """buffer_form_specs reads the core's cache layout: past_latent [batch, 1, capacity, rope + kv_lora_rank]."""
    inputs, outputs = buffer_form_specs(MLA)
    assert [(s.name, s.shape) for s in inputs[1:2]] == [("past_latent", ("batch", 1, "capacity", 8 + 32))]
    assert [s.name for s in outputs] == ["y", "present_latent"]
    assert [s.name for s in inputs[2:]] == ["seqlens_k", "total_sequence_length"]


def test_the_step_writes_the_bound_buffer_in_place(models, capfd):
    """The new token lands in the OrtValue bound as past and present (its keys at its position, the rest as before),
    and ONNX Runtime says nothing of copying; run with present unbound, the same session says it copies."""
    config, weights, path = models["grouped-window"]
    options = ort.SessionOptions()
    options.log_severity_level = 1  # TensorScatter's copy is a warning (the runner's own sessions log errors alone)
    with create_runner("ort-cpu", ModelSource(config, weights, path)) as runner:
        runner.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        dec = BufferDecoder(runner, config, capacity=8, batch=2)
        x = np.random.default_rng(0).standard_normal((2, 4, config.d_model)).astype(np.float32)
        dec.step(x[:, :3])
        (_, key), _ = dec.cache
        before = key.numpy().copy()
        dec.step(x[:, 3:])
        after = key.numpy()
        assert np.abs(after[:, :, 3]).min() > 0 and np.array_equal(after[:, :, 4:], before[:, :, 4:])
        assert np.array_equal(after[:, :, :3], before[:, :, :3]) and not before[:, :, 3].any()
        assert "in-place optimization not activated" not in capfd.readouterr().err
        feeds = {"x": x[:, :1], "seqlens_k": np.zeros(2, np.int32), "total_sequence_length": np.asarray(1, np.int32),
                 "past_key": before, "past_value": before}  # fmt: skip
        runner.session.run(None, feeds)
        assert "in-place optimization not activated" in capfd.readouterr().err


def test_the_registry_writes_it_at_opset_24_and_refuses_what_it_cannot_express():
    """The decomposed lowering's buffer core is its own, at TensorScatter's opset; ort-fused's stays GroupQueryAttention;
    a buffer core of the other lowering is refused naming the lowering that writes it; the terms the form has no
    per-row positions for (the padding mask: none in this form, ALiBi, the temperature) are refused by name."""
    c = CONFIGS["mha"]
    assert core_for("decomposed", c, form="buffer").name == "decomposed"
    assert core_for("ort-fused", c, form="buffer").name == "gqa" and BUFFER_CORES[0] == "gqa"
    assert graph_opset(c, "decomposed", "buffer") == 24 and graph_opset(c, "decomposed", "growing") == 18
    with pytest.raises(UsageError, match="--buffer-core decomposed is --attention decomposed's"):
        core_for("ort-fused", c, form="buffer", buffer_core="decomposed")
    with pytest.raises(UsageError, match="writes no gqa core"):
        core_for("decomposed", c, form="buffer", buffer_core="gqa")
    assert lowerings_for(MLA, form="buffer") == ["decomposed"]
    for change, term in (({"key_padding_mask": True}, "key_padding_mask"), ({"alibi": True}, "alibi"),
                         ({"attn_temperature": {"floor_scale": 4.0, "attn_scale": 0.1}}, "attn_temperature")):  # fmt: skip
        reasons = why_not("decomposed", dataclasses.replace(c, **change), form="buffer")
        assert any(term in r and "buffer form" in r for r in reasons), reasons


def test_export_writes_and_validates_the_latent_buffer_form(tmp_path, capsys):
    """attnx export --decode-form buffer --buffer-core decomposed of an MLA config: written at opset 24, checked step
    by step; inspect names the form; ort-fused with that core is one usage error naming --attention decomposed."""
    from attnx.cli import main

    cfg = tmp_path / "mla.json"
    cfg.write_text(json.dumps(MLA.to_dict()))
    out = tmp_path / "mla.onnx"
    assert main(["export", "--config", str(cfg), "--decode-form", "buffer", "--buffer-core", "decomposed",
                 "--out", str(out)]) == 0  # fmt: skip
    assert "opset 24" in capsys.readouterr().out
    assert main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["decode"] == "buffer" and "past_latent" in json.dumps(info["inputs"])
    assert main(["export", "--config", str(cfg), "--attention", "ort-fused", "--decode-form", "buffer",
                 "--buffer-core", "decomposed", "--out", str(tmp_path / "no.onnx")]) == 2  # fmt: skip
    assert "--attention decomposed" in capsys.readouterr().err and not (tmp_path / "no.onnx").exists()


def test_openvino_refuses_it_naming_tensorscatter(models):
    """A runtime without TensorScatter-24 refuses the model when it loads, naming the operator: never a fallback."""
    from attnx.errors import ProviderUnavailable
    from attnx.runtimes.base import backend_unavailable_reason

    if (why := backend_unavailable_reason("openvino")) is not None:
        pytest.skip(why)
    config, weights, path = models["mha"]
    with pytest.raises(ProviderUnavailable, match="TensorScatter-24"):
        create_runner("openvino", ModelSource(config, weights, path)).load()


def test_a_layer_package_of_the_latent_buffer_form_builds_and_verifies(tmp_path):
    """attnx build of the MLA step model in the decomposed buffer form: its parity, its golden decode over the latent
    cache (present_latent, not per-head keys and values) and the package's verify all pass."""
    from attnx.workflows._build import build_package

    report = build_package(MLA, tmp_path / "pkg", attention="decomposed", providers=["cpu"], decode_form="buffer")
    assert report.parity.passed and report.verify.passed
    manifest = json.loads((tmp_path / "pkg" / "manifest.json").read_text())
    assert manifest["attention"] == "decomposed" and manifest["golden"][0]["outputs"] == ["y", "present_latent"]


@pytest.mark.parametrize("name", ["grouped-window", "mla"])
def test_a_buffer_form_block_is_not_read_back_and_says_so(models, name):
    """The reader of the decomposed core does not read the buffer form (its keys come from TensorScatter's buffer):
    NotRead naming it, never a block read as another (a growing form's block is read: tests/export/test_cores.py)."""
    import onnx_ir as ir

    from attnx.export.cores import GRAPH_CORES
    from attnx.export.passes.walk import NotRead

    graph = ir.load(models[name][2]).graph
    softmaxes = [n for n in ir.traversal.RecursiveGraphIterator(graph) if n.op_type == "Softmax"]
    # MLA: one in each branch of the If between the prompt's expanded heads and the step's absorbed ones; the
    # absorbed one met first (the reader's, iter_blocks), the other never read as a block either
    assert len(softmaxes) == (2 if name == "mla" else 1)
    with pytest.raises(NotRead, match="TensorScatter .*buffer form.*not read as a block"):
        GRAPH_CORES["decomposed"].read_block(0, softmaxes[0])
    for softmax in softmaxes[1:]:
        with pytest.raises(NotRead):
            GRAPH_CORES["decomposed"].read_block(0, softmax)
