"""The registry of cores, both halves: every core written for every config the registry says it computes
(attnx.export.build_model), agreeing with the reference, and read back (the core, what its node says of
the config, the weights); every core a config does not go with refused with the registry's reasons."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from attnx.errors import UsageError
from attnx.export import GRAPH_CORES, build_model, core_of, qk_weights, read_cores, read_weights
from attnx.export import v_weights as read_v_weights
from attnx.model import AttentionConfig, reference_attention
from attnx.model.contract import LOWERINGS, describe
from attnx.model.cores import CORES, core_for, lowerings_for, why_not
from attnx.model.inputs import make_inputs
from attnx.model.tolerance import problem_size, tolerance_for
from attnx.runtimes.compare import compare_arrays
from attnx.workflows import AUTO_CANDIDATES, lower
from tests.conftest import CONFIGS, LLM_CONFIGS, LLM_FUSED_CONFIGS, weights_for

# (batch, seq, mem_seq): seq 1, and batch 3, whose element 1 has every key hidden by make_inputs' padding mask
SHAPES = [(1, 1, 1), (3, 7, 9), (2, 33, 4)]
FULL = {**CONFIGS, **{k: v for k, v in LLM_CONFIGS.items()}, **{f"fused-{k}": v for k, v in LLM_FUSED_CONFIGS.items()
                                                                  if not v.kv_cache}}  # fmt: skip
CASES = [(name, lowering) for name, c in FULL.items() for lowering in lowerings_for(c)]


def _weights(name: str):
    from attnx.model import init_weights

    return weights_for(name) if name in CONFIGS or name in LLM_CONFIGS else init_weights(FULL[name], seed=1)


def _agrees_with_reference(model: onnx.ModelProto, config: AttentionConfig, weights, dtype: str = "fp32",
                           shapes=SHAPES) -> None:  # fmt: skip
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch, seq, mem in shapes:
        feeds = make_inputs(config, batch, seq, mem if config.cross else None, dtype=dtype, seed=seq)
        (y,) = session.run(["y"], feeds)
        ref = reference_attention(config, weights, **feeds)
        cmp = compare_arrays("y", y, ref, tolerance_for(dtype, "ort-cpu"), problem_size(config, weights, feeds))
        assert cmp, f"batch={batch} seq={seq}: {cmp}"


def test_every_core_has_its_emitter_and_reader():
    assert set(GRAPH_CORES) == set(CORES) and all(entry.emit for entry in GRAPH_CORES.values())
    # every core's node is read, the auto core's If too (the growing form's; the buffer form's If is read as its
    # branches' cores: test_the_audit_reads_the_growing_auto_core_as_one_block_and_runs_both_branches)
    assert {n for n, entry in GRAPH_CORES.items() if entry.read is not None} == set(CORES)


@pytest.mark.parametrize(("name", "lowering"), CASES, ids=[f"{n}-{lw}" for n, lw in CASES])
def test_each_lowering_writes_its_core_and_agrees_with_the_reference(name, lowering):
    config, weights = FULL[name], _weights(name)
    model = build_model(config, weights, lowering)
    core = core_for(lowering, config)
    irm = ir.from_proto(model)
    assert core_of(irm) == core.name
    _agrees_with_reference(model, config, weights)
    # read back: the weights by their names, and what the core's node says of the config
    read = read_weights(irm, config)
    assert set(read) == set(weights)
    for key, value in weights.items():
        np.testing.assert_array_equal(read[key], value, err_msg=key)
    (reading,) = read_cores(irm)
    assert reading.core == core.name
    for key, value in reading.stated.items():
        if key in ("n_heads", "n_kv_heads", "causal", "softcap", "sliding_window", "sinks", "key_padding_mask"):
            assert value == getattr(config, key), (key, value)
    assert reading.stated["scale"] == pytest.approx(config.softmax_scale, rel=1e-6)


@pytest.mark.parametrize("name", list(FULL))
def test_a_core_that_cannot_compute_a_config_is_refused_with_its_reasons(name):
    """Every lowering a config does not go with is refused by name, saying what its cores lack."""
    config = FULL[name]
    refused = [lw for lw in LOWERINGS if lw not in lowerings_for(config) and "full" in LOWERINGS[lw].cores]
    for lowering in refused:
        reasons = [r for core in LOWERINGS[lowering].cores["full"] for r in why_not(core, config)]
        assert reasons
        with pytest.raises(UsageError) as info:
            build_model(config, _weights(name), lowering)
        for reason in reasons:
            assert reason in str(info.value)


def _unused_initializers(model: onnx.ModelProto) -> set[str]:
    from attnx.model.contract import all_nodes

    used = {i for node in all_nodes(model.graph) for i in node.input}
    return {t.name for t in model.graph.initializer} - used


STEPS = [(LLM_FUSED_CONFIGS["buffer"], "ort-fused", "buffer", core) for core in ("gqa",)] + [
    (dataclasses.replace(LLM_FUSED_CONFIGS["buffer"], softcap=None, sinks=False), "ort-fused", "buffer", core)
    for core in ("grouped-mha", "switch")
] + [(dataclasses.replace(LLM_FUSED_CONFIGS["ort-fused"], kv_cache=True), lw, "growing", None)
     for lw in ("decomposed", "ort-fused")] + [
    (AttentionConfig(d_model=32, n_heads=4, causal=True, key_padding_mask=True, kv_cache=True), lw, "growing", None)
    for lw in ("decomposed", "onnx", "ort-fused")]  # fmt: skip


@pytest.mark.parametrize(("config", "lowering", "form", "core"), STEPS)
def test_no_model_carries_an_unused_initializer(config, lowering, form, core):
    """ONNX Runtime warns of every initializer no node reads ("Removing initializer 'zero_f'"): every
    form attnx writes reads each of its constants, step models and If branches included."""
    from attnx.model import init_weights

    model = build_model(config, init_weights(config, 1), lowering, form, buffer_core=core)
    assert _unused_initializers(model) == set()
    full = build_model(dataclasses.replace(config, kv_cache=False), init_weights(config, 1), lowering
                       if lowering != "ort-fused" or form == "growing" else "ort-fused")  # fmt: skip
    assert _unused_initializers(full) == set()


def test_why_not_names_every_term_a_core_lacks():
    config = LLM_CONFIGS["llm"]
    (reason,) = [r for r in why_not("mha", config) if "does not express" in r]
    assert reason.endswith("does not express grouped_heads, qk_norm, rope, softcap, sliding_window, sinks")
    assert any("multiple of 8" in r for r in why_not("gqa", config))
    assert why_not("decomposed", config) == []
    assert any("no buffer form" in r for r in why_not("mha", AttentionConfig(d_model=32, n_heads=4, causal=True,
                                                                             kv_cache=True), form="buffer"))


@pytest.mark.parametrize("name", [n for n, c in CONFIGS.items() if c.key_padding_mask])
@pytest.mark.parametrize("lowering", ["ort-fused", "ort-fused-packed", "ort-attention", "onnx"])
def test_a_fully_hidden_query_gives_the_output_bias(name, lowering):
    """The fused ops average a row whose keys are all hidden; the formula gives z = 0, y = bo."""
    config, weights = CONFIGS[name], weights_for(name)
    if lowering not in lowerings_for(config):
        pytest.skip(f"{lowering} does not compute {name}")
    session = ort.InferenceSession(build_model(config, weights, lowering).SerializeToString(),
                                   providers=["CPUExecutionProvider"])  # fmt: skip
    feeds = make_inputs(config, 3, 5, 4 if config.cross else None, seed=1)
    assert feeds["key_padding_mask"][1].all()
    (y,) = session.run(["y"], feeds)
    bias = weights.get("out_proj.bias", np.zeros(config.d_model, np.float32))  # y = bo (0 without biases)
    np.testing.assert_allclose(y[1], np.broadcast_to(bias, y[1].shape), atol=1e-6)


@pytest.mark.parametrize("lowering", ["ort-fused", "ort-fused-packed", "ort-attention"])
def test_large_scores_keep_hidden_keys_hidden(lowering):
    """Weights scaled up give scores past 1e5: a mask applied as -10000 (the fused ops' default) would
    leave hidden keys weight; the emitters give them the dtype's lowest value."""
    name = "causal_kpm"
    weights = {k: v * (400.0 if k.startswith(("q_", "k_")) else 1.0) for k, v in weights_for(name).items()}
    feeds = make_inputs(CONFIGS[name], 2, 40, seed=3)
    assert problem_size(CONFIGS[name], weights, feeds).score_max > 1e5
    _agrees_with_reference(build_model(CONFIGS[name], weights, lowering), CONFIGS[name], weights,
                           shapes=[(3, 40, 1), (1, 9, 1)])  # fmt: skip


@pytest.mark.parametrize(("lowering", "op", "matmuls"), [("ort-fused-packed", "com.microsoft.MultiHeadAttention", 2),
                                                         ("ort-attention", "com.microsoft.Attention", 1)])
def test_packed_self_attention_variants(exported, lowering, op, matmuls):
    name = "causal_kpm"
    info = describe(exported(name, lowering) if lowering in LOWERINGS and LOWERINGS[lowering].export else
                    _saved(build_model(CONFIGS[name], weights_for(name), lowering)))  # fmt: skip
    assert info.lowering == lowering
    assert info.operators.get(op) == 1 and info.operators.get("MatMul") == matmuls  # packed q/k/v (+ output)


def _saved(model: onnx.ModelProto) -> str:
    import tempfile

    path = tempfile.NamedTemporaryFile(suffix=".onnx", delete=False).name
    onnx.save(model, path)
    return path


def test_auto_measures_the_candidates_that_compute_the_config_and_records_its_choice():
    name = "cross_kpm"  # the packed forms do not take cross-attention: not applicable, with the reason
    config, weights = CONFIGS[name], weights_for(name)
    result = lower(config, weights, attention="measure", auto_shape=(1, 16, 16))
    meta = {p.key: p.value for p in result.model.metadata_props}
    auto = json.loads(meta["attnx.auto"])
    assert auto["provider"] == "cpu" and auto["shape"] == [1, 16, 16]
    assert set(auto["status"]) == set(AUTO_CANDIDATES)
    for packed in ("ort-fused-packed", "ort-attention"):
        assert auto["status"][packed].startswith("not applicable") and "cross" in auto["status"][packed]
    timed = {k: t for k, t in auto["times_ms"].items() if t is not None}
    assert set(timed) == {"decomposed", "ort-fused"} and all(auto["status"][k] == "pass" for k in timed)
    assert auto["choice"] == min(timed, key=timed.__getitem__) == result.lowering == meta["attnx.attention"]
    _agrees_with_reference(result.model, config, weights)


@pytest.mark.parametrize("lowering", ["ort-fused", "onnx"])
def test_fused_fp16(exported, lowering):
    name = "cross_kpm"
    model = onnx.load(exported(name, lowering, "fp16"))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    _agrees_with_reference(model, CONFIGS[name], weights_for(name), dtype="fp16")


def test_the_opset_is_the_cores_or_the_one_asked():
    config, weights = CONFIGS["causal"], weights_for("causal")
    for opset in (18, 21, 25):
        model = build_model(config, weights, "ort-fused", opset=opset)
        assert {o.domain: o.version for o in model.opset_import}[""] == opset
    with pytest.raises(UsageError, match="outside what the Attention \\(opset 23\\) graph"):
        build_model(config, weights, "onnx", opset=18)


def test_weights_made_outside_attnx(tmp_path):
    """torch.nn.MultiheadAttention's own initialisation (not attnx's seeded weights), cross
    attention with a key padding mask, kv width != d_model, through the CLI's export."""
    import torch

    from attnx.cli import main
    from attnx.model import from_torch_mha_state_dict, save_weights

    config = AttentionConfig(d_model=48, n_heads=6, cross=True, kv_dim=40, key_padding_mask=True)
    torch.manual_seed(7)
    mha = torch.nn.MultiheadAttention(48, 6, kdim=40, vdim=40, batch_first=True)
    with torch.no_grad():
        mha.in_proj_bias.normal_()  # torch initialises biases to 0; a real model's are not
        mha.out_proj.bias.normal_()
    weights = from_torch_mha_state_dict(mha.state_dict(), config)
    (tmp_path / "c.json").write_text(config.to_json())
    save_weights(weights, tmp_path / "w.safetensors")
    out = tmp_path / "m.onnx"
    args = ["export", "--config", str(tmp_path / "c.json"), "--weights", str(tmp_path / "w.safetensors")]
    assert main([*args, "--attention", "ort-fused", "--out", str(out)]) == 0
    assert describe(out).operators.get("com.microsoft.MultiHeadAttention") == 1
    _agrees_with_reference(onnx.load(out), config, weights)
    # and torch's own module agrees too (its key_padding_mask: True hides, as ours)
    feeds = make_inputs(config, 3, 11, 7, seed=5)
    (y,) = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(["y"], feeds)
    with torch.no_grad():
        t, _ = mha(*(torch.from_numpy(feeds[k]) for k in ("x", "memory", "memory")),
                   key_padding_mask=torch.from_numpy(feeds["key_padding_mask"]))  # fmt: skip
    rows = [0, 2]  # torch gives NaN for the fully hidden element 1; attnx gives the out bias
    np.testing.assert_allclose(y[rows], t.numpy()[rows], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("name", "attention"), [("self", a) for a in LOWERINGS] + [("cross", "ort-fused")])
def test_projections_read_back_by_structure_from_every_lowering(name, attention):
    """The tolerance is sized from a model file alone: the q, k and v projections (weights and biases, in
    torch's convention) are read back by the graph's structure from every form attnx writes, packed ones
    included (a Split of one MatMul, the op's packed bias, com.microsoft Attention's one weight)."""
    config, weights = CONFIGS[name], weights_for(name)
    model = ir.from_proto(build_model(config, weights, attention))
    found = qk_weights(model)
    assert found is not None
    found.update(read_v_weights(model) or {})
    assert set(found) == {f"{p}_proj.{t}" for p in "qkv" for t in ("weight", "bias")}
    for key, value in found.items():
        np.testing.assert_array_equal(value, weights[key], err_msg=key)


@pytest.mark.parametrize("name", ["causal_kpm", "llm"])
def test_the_torch_export_is_read_back_too(exported, name):
    """The decomposed form `attnx export` traces from torch: its weights by the names NameStages gives
    them (the norms' and the sinks' too: what `attnx optimize` writes another lowering from), its core's
    scale and masks by its structure (the mask reader of attnx.export.passes._masks)."""
    config = CONFIGS.get(name) or LLM_CONFIGS[name]
    model = ir.load(exported(name, "decomposed"))
    read = read_weights(model, config)
    for key, value in weights_for(name).items():
        np.testing.assert_array_equal(read[key], value, err_msg=key)
    (reading,) = read_cores(model)
    assert reading.core == "decomposed"
    assert reading.stated["scale"] == pytest.approx(config.softmax_scale, rel=1e-6)
    if name == "causal_kpm":
        assert reading.stated["causal"] and reading.stated["key_padding_mask"]
    else:
        assert reading.stated["sinks"] and reading.stated["softcap"] == pytest.approx(config.softcap)


@pytest.mark.parametrize(("form", "core", "bound", "dtype"), [
    ("growing", "gqa", "separate", "fp32"), ("growing", "grouped-mha", "packed", "fp32"),
    ("growing", "gqa", "packed", "fp16"), ("buffer", "gqa", "packed", "fp32"), ("buffer", "gqa", "separate", "fp16"),
])  # fmt: skip
def test_a_core_bound_at_projections_made_elsewhere_gives_the_whole_blocks_z(form, core, bound, dtype):
    """build_model's bound: the core alone, fed q, k and v (or the packed qkv) computed outside it, gives z, which
    through the output projection is the whole block's y, and the same presents (attnx optimize splices it at a
    whole model's own projections, MatMulNBits or fp16, kept as they are)."""
    from attnx.model import init_weights
    from attnx.model.rope import Rope

    n_kv = 2
    c = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=n_kv, causal=True, kv_cache=True, bias=True,
                        rope=Rope(theta=10000.0, dim=16), key_padding_mask=form == "growing")  # fmt: skip
    w = init_weights(c, seed=2)
    np_dtype = np.float16 if dtype == "fp16" else np.float32
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 64)).astype(np_dtype)
    feeds = {"x": x, "past_key": np.zeros((2, n_kv, 5 if form == "buffer" else 0, 16), np_dtype)}
    feeds["past_value"] = feeds["past_key"]
    if form == "buffer":
        feeds |= {"seqlens_k": np.full((2,), 4, np.int32), "total_sequence_length": np.array(5, np.int32)}
    else:
        feeds |= {"key_padding_mask": np.zeros((2, 5), bool), "position_ids": np.tile(np.arange(5), (2, 1))}
    whole = ort.InferenceSession(build_model(c, w, "ort-fused", form, dtype, core=core, rope_positions=16)
                                 .SerializeToString(), providers=["CPUExecutionProvider"])  # fmt: skip
    y, *presents = whole.run(None, feeds)
    projected = {n: x.astype(np.float64) @ np.asarray(w[f"{n}_proj.weight"], np.float64).T + w[f"{n}_proj.bias"]
                 for n in "qkv"}  # fmt: skip
    extra = {"qkv": np.concatenate([projected[n] for n in "qkv"], -1)} if bound == "packed" else projected
    alone = ort.InferenceSession(build_model(c, w, "ort-fused", form, dtype, core=core, rope_positions=16, bound=bound)
                                 .SerializeToString(), providers=["CPUExecutionProvider"])  # fmt: skip
    assert [i.name for i in alone.get_inputs()][:1 + len(extra)] == ["x", *extra] and alone.get_outputs()[0].name == "z"
    z, *bound_presents = alone.run(None, {**feeds, **{k: v.astype(np_dtype) for k, v in extra.items()}})
    out = z.astype(np.float64) @ np.asarray(w["out_proj.weight"], np.float64).T + w["out_proj.bias"]
    tol = tolerance_for(dtype)
    size = problem_size(c, w, {"x": x.astype(np.float32), "position_ids": np.tile(np.arange(5), (2, 1))})
    assert compare_arrays("y", out, y.astype(np.float64), tol, size)
    assert all(compare_arrays("present", a.astype(np.float64), b.astype(np.float64), tol, size)
               for a, b in zip(bound_presents, presents))  # fmt: skip


@pytest.mark.parametrize("case", ["prompt", "chunk after a past", "padded prompt", "step", "padded step"])
def test_the_growing_auto_core_takes_each_branch_where_it_computes_the_formula(case, tmp_path):
    """The growing form's auto core: an If, the grouped core for a step or a padded call, GroupQueryAttention with
    no bias for a call of more tokens with no padding. Each case, by the branch it takes, against the float64
    reference: y and the presents."""
    from attnx.model import init_weights
    from attnx.model.reference import reference_attention
    from attnx.model.rope import Rope

    c = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, causal=True, kv_cache=True, bias=False,
                        rope=Rope(theta=10000.0, dim=16), key_padding_mask=True, sliding_window=5)  # fmt: skip
    w = init_weights(c, seed=3)
    rng = np.random.default_rng(1)
    batch, past, tokens = 2, 0 if "prompt" in case else 6, 1 if "step" in case else 7
    x = rng.standard_normal((batch, tokens, 64)).astype(np.float32)
    past_kv = [rng.standard_normal((batch, 2, past, 16)).astype(np.float32) for _ in range(2)]
    kpm = np.zeros((batch, past + tokens), bool)
    if "padded" in case:
        kpm[1, :3] = True  # row 1 left-padded by 3
    positions = np.maximum(np.cumsum(~kpm, axis=1) - 1, 0)[:, past:]  # transformers' position_ids
    feeds = {"x": x, "past_key": past_kv[0], "past_value": past_kv[1], "key_padding_mask": kpm,
             "position_ids": positions.astype(np.int64)}  # fmt: skip
    model = build_model(c, w, "ort-fused", "growing", core="switch")
    assert [n.op_type for n in model.graph.node].count("If") == 1
    options = ort.SessionOptions()
    options.enable_profiling, options.profile_file_prefix = True, str(tmp_path / "profile")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    y, present_k, present_v = session.run(None, feeds)
    with open(session.end_profiling(), encoding="utf-8") as f:
        ran = {e["args"]["op_name"] for e in json.load(f) if e.get("cat") == "Node" and "op_name" in e.get("args", {})}
    # the branch the call took: GroupQueryAttention for a prompt with no padding, else the grouped core
    assert ("GroupQueryAttention" in ran) == (case == "prompt") and ("MultiHeadAttention" in ran) != (case == "prompt")
    ref_y, ref_k, ref_v = reference_attention(c, w, x, key_padding_mask=kpm, past_key=past_kv[0],
                                              past_value=past_kv[1], position_ids=feeds["position_ids"])  # fmt: skip
    tol = tolerance_for("fp32")
    size = problem_size(c, w, feeds)
    for name, got, want in (("y", y, ref_y), ("present_key", present_k, ref_k), ("present_value", present_v, ref_v)):
        assert compare_arrays(name, want, got.astype(np.float64), tol, size), name


def test_the_audit_reads_the_growing_auto_core_as_one_block_and_runs_both_branches(tmp_path):
    """The If is one block (not its branches' two ops), cut with what its branches read from the graph around them;
    the audit's full sequence takes GroupQueryAttention, its padded batch and steps the grouped core: all pass."""
    from attnx.model import init_weights
    from attnx.model.rope import Rope
    from attnx.workflows.audit import audit_model

    c = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, causal=True, kv_cache=True, bias=False,
                        rope=Rope(theta=10000.0, dim=16), key_padding_mask=True, sliding_window=5)  # fmt: skip
    path = tmp_path / "auto.onnx"
    onnx.save(build_model(c, init_weights(c, 3), "ort-fused", "growing", core="switch"), path)
    report = audit_model(str(path))
    (block,) = report.blocks
    assert block.core == "switch" and not block.findings and not report.unread and not report.findings
    assert {"grouped_heads", "rope", "sliding_window"} <= set(block.terms)
    assert len(block.checks) == 3 and all(": PASS " in str(check) for check in block.checks), block.checks
