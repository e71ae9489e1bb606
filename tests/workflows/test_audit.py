"""attnx audit on whole models ONNX Runtime GenAI's builder made (tests/fixtures/genai, README there):
clean models pass against their checkpoints, each planted fault is found in its layer with its term,
and files it did not make are refused as untrusted input."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from attnx.cli import main
from attnx.model.importers import import_weights, read_projection
from attnx.workflows.audit import audit_model

# the same fixture models read again and again: each rotary table's named scaling searched once (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("rope_tables_named_once")

GENAI = Path(__file__).resolve().parents[1] / "fixtures" / "genai"
CLEAN = ["llama/fp32", "qwen2/fp32", "qwen3/fp32", "phi3/fp32", "llama/int4-acc1", "qwen3/int4-acc1", "llama/int4",
         "qwen3/int4"]
WINDOWED = ["gemma2/fp32", "gpt-oss/fp32"]  # layer 0 keeps its window in a ring buffer (sliding_window_cache)


def _checkpoint(model: str) -> str:
    return str(GENAI / model.split("/")[0] / "checkpoint")


@pytest.mark.parametrize("model", CLEAN)
def test_a_clean_builder_model_passes_against_its_checkpoint(model):
    report = audit_model(str(GENAI / model / "model.onnx"), checkpoint=_checkpoint(model))
    assert report.passed, [b.findings + b.not_checked for b in report.blocks]
    assert [b.layer for b in report.blocks] == [0, 1]
    assert all(len(b.checks) == 3 for b in report.blocks)  # full sequence, a padded batch, prefill + steps


@pytest.mark.parametrize("model", WINDOWED)
def test_a_windowed_model_passes_and_names_the_padded_batch_ort_refuses(model):
    """Decoded through the ring buffer the block returns; ONNX Runtime refuses a row shorter than the prompt in
    that mode: a gap, named with what the model then cannot serve, that fails the audit under strict alone."""
    report = audit_model(str(GENAI / model / "model.onnx"), checkpoint=_checkpoint(model))
    assert all(not b.findings and all(b.checks) for b in report.blocks)
    assert [len(b.checks) for b in report.blocks] == [2, 3]
    assert "sliding_window" in report.blocks[0].terms and report.passed and all(b.passed for b in report.blocks)
    [reason] = report.gaps
    assert reason.startswith("block 0: padded batch (rows of 12 and 9 tokens, right-padded): ort-cpu refuses it with "
                             "a sliding_window_cache (node /model/layers.0/attn/GroupQueryAttention (GroupQueryAttention)"
                             ": seqlens_k[1] = 8 is too small for sequence_length 12)")  # fmt: skip
    assert reason.endswith(": on ort-cpu this model cannot serve prompts of different lengths in one batch")
    strict = audit_model(str(GENAI / model / "model.onnx"), checkpoint=_checkpoint(model), strict=True)
    assert not strict.passed and not strict.blocks[0].passed and strict.blocks[1].passed


def test_the_builder_drops_mistral_s_window_and_the_audit_says_where():
    """transformers 5 saves no layer_types for Mistral; the builder reads the window from them alone."""
    report = audit_model(str(GENAI / "mistral/fp32/model.onnx"), checkpoint=_checkpoint("mistral/fp32"))
    for block in report.blocks:
        assert block.findings[0] == (f"layer {block.index}: no window in the graph (local_window_size -1), "
                                     "sliding_window 8 in the checkpoint: every query past 8 sees keys it must not")  # fmt: skip
        assert all(f.endswith("first at position 8") for f in block.findings[1:]) and len(block.findings) == 4
    # without the checkpoint, the graph agrees with the formula it states
    assert audit_model(str(GENAI / "mistral/fp32/model.onnx")).passed


def test_the_builder_s_fp16_model_agrees_block_by_block_and_its_decode_fails_as_exported():
    """llama/fp16: MultiHeadAttention fed by RotaryEmbedding nodes, the cache's Concat and a repeat of each kv head,
    its mask an additive bias computed once from attention_mask (read by running it: causal). Each block agrees
    with its checkpoint layer in fp16's tolerance, cut out alone, full sequence, left-padded batch and decoding;
    the whole model fails at its first decoding step, which the audit says naming ONNX Runtime's node."""
    report = audit_model(str(GENAI / "llama/fp16/model.onnx"), checkpoint=_checkpoint("llama/fp16"))
    assert [b.layer for b in report.blocks] == [0, 1] and all(b.passed for b in report.blocks)
    assert all(b.core == "mha" and len(b.checks) == 3 for b in report.blocks)
    assert all("left-padded" in b.checks[1].name and b.checks[0].atol > 1e-3 for b in report.blocks)  # fp16's bound
    [finding] = report.findings
    assert finding.startswith("the whole model as exported fails at decoding step 1 (after 9 tokens) on ort-cpu: "
                              "node InsertedPrecisionFreeCast_/model/layers.1/attn/v_proj/repeat_kv/Reshape_4")  # fmt: skip
    assert not report.passed


def test_a_computed_mask_and_a_rotary_node_are_read_from_the_graph_alone(monkeypatch):
    """Without a checkpoint: the rope fitted to the RotaryEmbedding's fp16 tables, the mask (the op's unidirectional
    is 0) read as causal by running its subgraph; the same audit not reading the mask fails at position 0."""
    import onnx_ir as ir

    from attnx.export._blocks import read_blocks
    from attnx.workflows.audit import cut

    path = str(GENAI / "llama/fp16/model.onnx")
    blocks = read_blocks(ir.load(path)).blocks
    assert [b.config.rope.theta for b in blocks] == pytest.approx([10000.0] * 2, rel=1e-4)
    assert all(b.mask == "/model/attn_mask_reformat/Tile/output_0" and not b.config.causal for b in blocks)
    assert audit_model(path, layers=[1]).blocks[0].passed
    monkeypatch.setattr(cut, "read_mask_terms", lambda graph, block, reach: block.config)
    [block] = audit_model(path, layers=[1]).blocks
    assert not block.passed and block.findings[0].endswith("first at position 0")


def test_accuracy_level_4_is_checked_as_it_computes_int8_activations(monkeypatch):
    """The builder's CPU int4 default (accuracy_level 4) quantizes each projection's input to int8 in blocks:
    against the plain formula of its own dequantized weights it is ~3% off, so the reference quantizes the
    same inputs (int8_blocks); without that step the same audit fails."""
    from attnx.workflows.audit import compare

    path = str(GENAI / "llama/int4/model.onnx")
    assert audit_model(path).passed
    monkeypatch.setattr(compare, "int8_blocks", lambda a, block: np.asarray(a, np.float64))
    report = audit_model(path)
    assert not report.passed and all("full sequence" in b.findings[0] for b in report.blocks)


def _z_across_a_midpoint(real, moves: list[float]):
    """reference_attention with z's element nearest a midpoint of its int8 block (accuracy_level 4's rounding of the
    output projection's input) mirrored across it, where that move is within fp32's rule at z with no score term:
    what the kernel's own z, one float rounding away, does to y. `moves`: each move, relative to that rule."""
    from attnx.model.tolerance import ProblemSize, tolerance_for

    def moved(config, weights, *args, stages=None, **kw):
        out = real(config, weights, *args, stages=stages, **kw)
        if stages is None or "z" not in stages:
            return out
        z = stages["z"]
        rows = np.asarray(z, np.float32).reshape(-1, z.shape[-1] // 32, 32)
        step = np.abs(rows).max(axis=2, keepdims=True) / np.float32(127)
        levels = rows.astype(np.float64) / step
        margin = 0.5 - np.abs(levels - np.rint(levels))
        i = np.unravel_index(np.argmin(margin), margin.shape)
        mid = np.floor(levels[i]) + 0.5
        shift = 2 * (mid - levels[i]) * float(step[i[0], i[1], 0])  # mirrored across the midpoint
        rule = tolerance_for("fp32").atol(ProblemSize(config.d_model), float(np.sqrt(np.mean(np.square(z)))))
        if abs(shift) <= rule:
            flat = z.reshape(-1)  # a view of stages["z"]
            flat[np.ravel_multi_index(i, rows.shape)] += shift
            moves.append(abs(shift) / rule)
        return out

    return moved


def test_accuracy_level_4_holds_y_to_either_rounding_of_z_near_a_midpoint(monkeypatch):
    """The kernel computes z itself, within fp32's rule of the reference's z; where an element of z lies that close
    to a midpoint of its int8 block, the kernel may round it either way and y moves by one step times a column of
    out_proj (measured at Qwen2.5-0.5B's shape: 3.6e-4 to 9.4e-4 against fp32's 3e-5, in half its layers). The
    reference here rounds such an element the other way: the block passes by z's rounding slack and says so;
    without the slack (fp32's rule alone, the audit before it) the same blocks fail."""
    from attnx.model import tolerance
    from attnx.workflows.audit import compare

    path = str(GENAI / "llama/int4/model.onnx")
    moves: list[float] = []
    monkeypatch.setattr(compare, "reference_attention", _z_across_a_midpoint(compare.reference_attention, moves))
    report = audit_model(path, checkpoint=_checkpoint("llama/int4"))
    assert moves and max(moves) <= 1.0
    assert report.passed, [b.findings for b in report.blocks]
    noted = [b.index for b in report.blocks if b.notes]
    assert noted and all(len(b.notes) == 1 and "within the int8 rounding of z (MatMulNBits accuracy_level 4 "
                         "requantizes the output projection's input in blocks of 32)" in b.notes[0]
                         for b in report.blocks if b.notes)  # fmt: skip
    real = tolerance.requantization_slack

    def no_slack(*args):  # fp32's rule alone: the audit before z's rounding was in its error model
        found = real(*args)
        return dataclasses.replace(found, slack=np.zeros_like(found.slack))

    monkeypatch.setattr(compare, "requantization_slack", no_slack)
    unheld = audit_model(path, checkpoint=_checkpoint("llama/int4"))
    assert [b.index for b in unheld.blocks if not b.passed] == noted
    assert all("full sequence" in b.findings[0] for b in unheld.blocks if not b.passed)


def test_a_planted_scale_at_accuracy_level_4_fails_its_checks_past_z_s_rounding_slack(tmp_path):
    """A fault within the int8 rounding's reach is not hidden by it: layer 1's attention scale changed in the
    accuracy_level 4 model fails every check of its block, by many times the bound, and names the term."""
    path = _planted(tmp_path, "llama/int4", lambda p: _set_attr(_node(p, 1), "scale", 0.3))
    report = audit_model(path, checkpoint=_checkpoint("llama/int4"))
    ok, bad = report.blocks
    assert ok.passed and not bad.passed and not report.passed
    assert bad.findings[0] == "layer 1: scale 0.3 in the graph, 0.25 in the checkpoint"
    assert [f.split(" against")[0] for f in bad.findings[1:]] == [
        "block 1: full sequence (12 tokens)", "block 1: padded batch (rows of 12 and 9 tokens, right-padded)",
        "block 1: prefill 9 + 3 steps"]  # fmt: skip
    assert all(c.max_abs > 10 * c.atol for c in bad.checks)


def test_the_checkpoint_is_held_a_layer_at_a_time(monkeypatch):
    """Pairing reads a sample of each layer's projections, each alone and of it only the rows sampled; a block's
    layer is imported when that block is checked and dropped before the next one is (a checkpoint larger than
    memory is audited)."""
    import weakref

    from attnx.workflows.audit import sources

    events: list[str] = []
    alive: dict[int, weakref.ref] = {}

    def read(folder, layer, role="q", rows=None):
        events.append(f"{role} {layer} ({'whole' if rows is None else len(rows)} rows)")
        return read_projection(folder, layer, role, rows)

    def imported(folder, layer):
        events.append(f"import {layer} (layers still held: {sorted(i for i, r in alive.items() if r() is not None)})")
        result = import_weights(folder, layer=layer)
        alive[layer] = weakref.ref(result)
        return result

    monkeypatch.setattr(sources, "read_projection", read)
    monkeypatch.setattr(sources, "import_weights", imported)
    path, checkpoint = str(GENAI / "qwen3/fp32/model.onnx"), _checkpoint("qwen3/fp32")
    report = audit_model(path, checkpoint=checkpoint, progress=events.append)
    assert report.passed and [b.layer for b in report.blocks] == [0, 1]
    assert events == [f"{role} {layer} (32 rows)" for layer in (0, 1) for role in "qkvo"] + [
        "block 0: /model/layers.0/attn/GroupQueryAttention", "import 0 (layers still held: [])",
        "block 1: /model/layers.1/attn/GroupQueryAttention", "import 1 (layers still held: [])"]  # fmt: skip
    events.clear()
    assert audit_model(path, checkpoint=checkpoint, layers=[1]).blocks[0].layer == 1
    assert [e for e in events if e.startswith("import")] == ["import 1 (layers still held: [])"]


def test_pairing_on_sampled_rows_tells_tied_layers_apart_by_their_whole_q(monkeypatch):
    """Two layers whose sampled rows are equal and the rest of q differs: paired by the whole q projection."""
    from attnx.workflows.audit import sources

    folder = _checkpoint("llama/fp32")
    weights = [import_weights(folder, layer=i).weights for i in (0, 1)]
    monkeypatch.setattr(sources.CheckpointLayers, "SAMPLE_ROWS", 2)  # rows 0 and 63 of q's 64
    layers = sources.CheckpointLayers(folder)
    layers.samples[1] = layers.samples[0]  # layer 1 looks like layer 0 on every sampled row
    assert layers.pair(weights[0]) == 0 and layers.pair(weights[1]) == 1
    assert layers.pair({"q_proj.weight": np.zeros((8, 8), np.float32)}) is None  # no layer of that shape


def test_a_fault_in_one_projection_pairs_the_block_with_its_own_layer():
    """A layer whose q heads are permuted is nearer another layer's q by its largest difference; its k, v and o
    rows still match its own: paired with its own layer."""
    from attnx.workflows.audit import CheckpointLayers

    folder = _checkpoint("llama/fp32")
    layers = CheckpointLayers(folder)
    weights = dict(import_weights(folder, layer=1).weights)
    q = weights["q_proj.weight"].reshape(4, 16, 64)
    weights["q_proj.weight"] = np.concatenate([q[1:], q[:1]]).reshape(64, 64)
    assert layers.pair(weights) == 1


def test_blocks_are_read_with_the_graph_s_tensors_released():
    """iter_blocks unmaps the data file after each block it reads (onnx_ir keeps a read tensor mapped, its pages
    resident): when a block is yielded no external tensor is mapped, and its weights are its own copies."""
    import onnx_ir as ir

    from attnx.export._blocks import iter_blocks

    model = ir.load(str(GENAI / "llama/fp32/model.onnx"))
    external = [v.const_value for v in model.graph.initializers.values() if isinstance(v.const_value, ir.ExternalTensor)]
    assert len(external) > 10
    blocks = []
    for block in iter_blocks(model, []):
        assert not [t.name for t in external if t.raw is not None]
        blocks.append(block)
    assert len(blocks) == 2 and all(w.flags.owndata for b in blocks for w in b.weights.values())
    assert not np.array_equal(blocks[0].weights["q_proj.weight"], blocks[1].weights["q_proj.weight"])
    # --layers 1: block 0 is read for its index alone, its weights not copied out of the file
    skipped, asked = iter_blocks(ir.load(str(GENAI / "llama/fp32/model.onnx")), [], wanted=lambda i: i == 1)
    assert skipped.weights is None and skipped.config == blocks[0].config and asked.index == 1
    assert np.array_equal(asked.weights["q_proj.weight"], blocks[1].weights["q_proj.weight"])


def _float32_table(theta: float, dim: int = 128, positions: int = 8192, inv_freq=None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin as ONNX Runtime GenAI's builder computes them: float32 inv_freq, float32 position * inv_freq."""
    if inv_freq is None:
        inv_freq = 1.0 / np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    angles = np.outer(np.arange(positions, dtype=np.float32), np.asarray(inv_freq, np.float32))
    return np.cos(angles), np.sin(angles)


def test_llama_3_s_rotary_table_in_float32_is_read_and_another_theta_is_not():
    """Llama-3-8B's table (theta 500000, 8192 rows) as the builder writes it is off the exact cos/sin by up to
    5.8e-4 on its far rows (float32 angles): read as theta 500000; a theta 1e-4 away, or Llama 3.1's scaling,
    is not that table, and Llama 3.1's is read as itself."""
    from attnx.model.rope import Rope, parse_rope, rope_frequencies
    from attnx.model.rope_fit import rope_of_table as _rope_of
    from attnx.model.rope_fit import rope_table_error

    cos, sin = _float32_table(500000.0)
    rope, fit = _rope_of(cos, sin, False)
    assert rope is not None and abs(rope.theta / 500000.0 - 1) < 1e-6 and fit.error > 1e-4
    exact, _ = rope_frequencies(Rope(theta=500000.0, dim=128))
    assert rope_table_error(cos, sin, exact)[1] < 1
    assert rope_table_error(*_float32_table(500000.0 * (1 + 1e-4)), exact)[1] > 1
    scaled = parse_rope({"theta": 500000.0, "scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}, 128)  # fmt: skip
    table = _float32_table(0, inv_freq=rope_frequencies(scaled)[0])
    assert rope_table_error(*table, exact)[1] > 1
    read, fit = _rope_of(*table, False)  # no theta fits it: the named scaling it is, read from the table alone
    assert read == scaled and fit.matches == ("llama3, theta 500000, factor 8, low_freq_factor 1, "
                                              "high_freq_factor 4, original 8192")  # fmt: skip


# Planted faults -----------------------------------------------------------------------------------
def _planted(tmp_path: Path, model: str, change: Callable[[onnx.ModelProto], None]) -> str:
    proto = onnx.load(str(GENAI / model / "model.onnx"))
    change(proto)
    out = tmp_path / "model.onnx"
    onnx.save(proto, str(out), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    return str(out)


def _node(proto: onnx.ModelProto, layer: int, op: str = "GroupQueryAttention") -> onnx.NodeProto:
    return next(n for n in proto.graph.node if n.op_type == op and f"layers.{layer}/" in n.name)


def _set_attr(node: onnx.NodeProto, name: str, value) -> None:
    for a in node.attribute:
        if a.name == name:
            node.attribute.remove(a)
            break
    node.attribute.append(onnx.helper.make_attribute(name, value))


def _init(proto: onnx.ModelProto, name: str) -> tuple[onnx.TensorProto, np.ndarray]:
    t = next(i for i in proto.graph.initializer if i.name == name)
    return t, numpy_helper.to_array(t).copy()


def _put(proto: onnx.ModelProto, t: onnx.TensorProto, array: np.ndarray) -> None:
    t.CopyFrom(numpy_helper.from_array(array.astype(numpy_helper.to_array(t).dtype), t.name))


def _qkv(layer: int, kind: str = "MatMul.weight") -> str:
    return f"model.layers.{layer}.attn.qkv_proj.{kind}"


def _window(size):
    return lambda p: _set_attr(_node(p, 0), "local_window_size", size)


def _swap_k(p):  # packed qkv [64, q 64 | k 32 | v 32]: layer 0's k columns for layer 1's
    (t0, w0), (t1, w1) = _init(p, _qkv(0)), _init(p, _qkv(1))
    w0[:, 64:96], w1[:, 64:96] = w1[:, 64:96].copy(), w0[:, 64:96].copy()
    _put(p, t0, w0)
    _put(p, t1, w1)


def _permute_kv_heads(p):  # layer 1: its two k heads (16 columns each) swapped
    t, w = _init(p, _qkv(1))
    w[:, 64:80], w[:, 80:96] = w[:, 80:96].copy(), w[:, 64:80].copy()
    _put(p, t, w)


def _other_theta(p):
    t_cos, cos = _init(p, "cos_cache")
    t_sin, _ = _init(p, "sin_cache")
    angles = np.arange(cos.shape[0])[:, None] / 500000.0 ** (np.arange(0, 16, 2) / 16)
    _put(p, t_cos, np.cos(angles))
    _put(p, t_sin, np.sin(angles))


def _norm_of_layer_1(p):
    t0, _ = _init(p, "model.layers.0.attn.q_norm.layernorm.weight")
    _, w1 = _init(p, "model.layers.1.attn.q_norm.layernorm.weight")
    _put(p, t0, w1)


def _drop_sink(p):
    node = _node(p, 1)
    del node.input[11:]


def _double_int4_scale(p):
    t, scales = _init(p, _qkv(0, "MatMul.weight_scales"))
    scales[70, 0] *= 2  # column 70: a k column, its first block of 32 inputs
    _put(p, t, scales)


def _interleave_rotary_nodes(p):  # llama/fp16 layer 1: its q and k RotaryEmbedding nodes pair (2i, 2i+1)
    for n in p.graph.node:
        if n.op_type == "RotaryEmbedding" and "layers.1/" in n.name:
            _set_attr(n, "interleaved", 1)


FAULTS = {
    "window 8 -> 7": ("gemma2/fp32", _window(7), 0, "layer 0: window 7 in the graph (local_window_size 7), sliding_window 8 in the checkpoint"),
    "window 8 -> 9": ("gemma2/fp32", _window(9), 0, "layer 0: window 9 in the graph (local_window_size 9), sliding_window 8 in the checkpoint"),
    "rotary_interleaved flipped": ("llama/fp32", lambda p: _set_attr(_node(p, 1), "rotary_interleaved", 1), 1,
                                   "layer 1: rotary_interleaved 1 in the graph"),
    "cos/sin of another theta": ("llama/fp32", _other_theta, 0, "layer 0: rotary table differs from the checkpoint's"),
    "scale changed": ("llama/fp32", lambda p: _set_attr(_node(p, 1), "scale", 0.3), 1,
                      "layer 1: scale 0.3 in the graph, 0.25 in the checkpoint"),
    "softcap changed": ("gemma2/fp32", lambda p: _set_attr(_node(p, 1), "softcap", 30.0), 1,
                        "layer 1: softcap 30.0 in the graph, 50.0 in the checkpoint"),
    "softcap dropped": ("gemma2/fp32", lambda p: _set_attr(_node(p, 1), "softcap", 0.0), 1,
                        "layer 1: softcap None in the graph, 50.0 in the checkpoint"),
    "head_sink dropped": ("gpt-oss/fp32", _drop_sink, 1, "layer 1: sinks missing from the graph"),
    "another layer's q norm": ("qwen3/fp32", _norm_of_layer_1, 0, "layer 0: q_norm.weight differs"),
    "k projections swapped": ("llama/fp32", _swap_k, 0, "layer 0: k_proj.weight differs"),
    "kv heads permuted": ("qwen2/fp32", _permute_kv_heads, 1, "layer 1: k_proj.weight differs"),
    "fp16 RotaryEmbedding interleaved": ("llama/fp16", _interleave_rotary_nodes, 1,
                                         "layer 1: rotary_interleaved 1 in the graph"),
    "an int4 block's scale doubled": ("llama/int4-acc1", _double_int4_scale, 0,
                                      "layer 0: k_proj.weight differs from the checkpoint's by more than its 4-bit step "
                                      "in"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_planted_fault_is_found_in_its_layer_with_its_term(tmp_path, fault):
    model, change, layer, finding = FAULTS[fault]
    report = audit_model(_planted(tmp_path, model, change), checkpoint=_checkpoint(model))
    block = next(b for b in report.blocks if b.layer == layer)
    assert any(f.startswith(finding) for f in block.findings), block.findings
    others = [b for b in report.blocks if b is not block and b.findings]
    shared = fault in ("cos/sin of another theta", "k projections swapped")  # one table for all layers; a swap
    assert shared or others == [], [b.findings for b in others]
    assert not report.passed
    if fault in LOCALISED:  # the first stage the block's full sequence leaves its bound at
        assert block.localised.startswith(f"block {block.index}: localised to stage {LOCALISED[fault]} "), block.localised


LOCALISED = {"scale changed": "z", "k projections swapped": "k", "kv heads permuted": "k",
             "fp16 RotaryEmbedding interleaved": "q_rope", "another layer's q norm": "z"}


# Files it did not make ----------------------------------------------------------------------------
def _with_location(tmp_path: Path, location: str) -> str:
    proto = onnx.load(str(GENAI / "llama/fp32/model.onnx"), load_external_data=False)
    for t in proto.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    out = tmp_path / "model.onnx"
    onnx.save(proto, str(out))
    return str(out)


@pytest.mark.parametrize("location", ["../model.onnx.data", "/etc/passwd", "link.data"])
def test_external_data_outside_the_folder_is_refused_naming_it(tmp_path, capsys, location):
    inner = tmp_path / "m"
    inner.mkdir()
    shutil.copyfile(GENAI / "llama/fp32/model.onnx.data", tmp_path / "model.onnx.data")
    os.symlink(tmp_path / "model.onnx.data", inner / "link.data")
    path = _with_location(inner, location)
    assert main(["audit", path]) == 2
    err = capsys.readouterr().err
    assert location in err and "refused" in err and len(err.strip().splitlines()) == 1


def test_truncated_external_data_is_refused(tmp_path, capsys):
    shutil.copyfile(GENAI / "llama/fp32/model.onnx", tmp_path / "model.onnx")
    data = (GENAI / "llama/fp32/model.onnx.data").read_bytes()
    (tmp_path / "model.onnx.data").write_bytes(data[: len(data) // 2])
    assert main(["audit", str(tmp_path / "model.onnx")]) == 2
    assert "truncated external data" in capsys.readouterr().err


def test_a_graph_without_attention_is_refused(tmp_path, capsys):
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10)
    onnx.save(model, str(tmp_path / "relu.onnx"))
    assert main(["audit", str(tmp_path / "relu.onnx")]) == 2
    assert "no attention block found" in capsys.readouterr().err


def test_a_backend_asked_for_that_cannot_run_a_block_is_a_finding_and_one_not_here_a_skip():
    """OpenVINO 2026.4 converts GroupQueryAttention but refuses its softcap, and cannot run its cache input:
    both findings of the block, named; ort-cuda without a GPU is a skip, as in parity."""
    gemma = audit_model(str(GENAI / "gemma2/fp32/model.onnx"), backends=("ort-cpu", "openvino"))
    assert all(any("openvino cannot load" in f and "softcap is not supported" in f for f in b.findings)
               for b in gemma.blocks)  # fmt: skip
    # on two threads OpenVINO raises at run time; on one (ATTNX_THREADS=1, as under the suite's workers) it returns
    # an empty output: either is a finding of the block, never a pass
    llama = audit_model(str(GENAI / "llama/fp32/model.onnx"), layers=[0], backends=("openvino",))
    findings = llama.blocks[0].findings
    assert findings and not llama.passed and all(f.startswith("block 0: openvino: ") for f in findings), findings
    assert (findings[0].startswith("block 0: openvino: full sequence (12 tokens): /model/layers.0/attn/"
                                   "GroupQueryAttention fails to run as exported: ")
            or all("shape [0, 0, 64] differs" in f for f in findings)), findings  # fmt: skip
    from attnx.runtimes.ort_runner import ort_cuda_unavailable_reason

    if ort_cuda_unavailable_reason() is not None:
        cuda = audit_model(str(GENAI / "llama/fp32/model.onnx"), backends=("ort-cpu", "ort-cuda"))
        assert cuda.passed and cuda.skipped[0].startswith("ort-cuda: ")


def test_layers_outside_the_model_are_refused(capsys):
    assert main(["audit", str(GENAI / "llama/fp32/model.onnx"), "--layers", "1,5"]) == 2
    assert "--layers 5: the model has 2 block(s) read (0 to 1)" in capsys.readouterr().err


def test_the_cli_prints_a_line_per_block_and_writes_json(tmp_path, capsys):
    out = tmp_path / "a.json"
    rc = main(["audit", str(GENAI / "mistral/fp32/model.onnx"), "--checkpoint", _checkpoint("mistral/fp32"),
               "--json", str(out)])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert rc == 1
    assert lines[0].startswith("block 0 = checkpoint layer 0: FAIL") and lines[-1] == "audit FAILED: 0 of 2 block(s) pass"
    import json

    report = json.loads(out.read_text())
    assert report["passed"] is False and [b["layer"] for b in report["blocks"]] == [0, 1]


# attnx's own models ---------------------------------------------------------------------------------
LLM = {"d_model": 64, "n_heads": 4, "n_kv_heads": 2, "causal": True, "rope": {"theta": 10000.0}}


@pytest.mark.parametrize("attention", ["decomposed", "onnx", "ort-fused"])
def test_an_attnx_export_audits_as_parity_checks_it(tmp_path, attention):
    """The step model attnx writes (decomposed; opset-23 Attention; GroupQueryAttention after a RotaryEmbedding of
    its own; rotary tables computed from position_ids and masks computed from the cache's length, read by running
    them): the audit passes where `attnx parity` does, and both fail on the same planted scale."""
    import json

    config = tmp_path / "llm.json"
    config.write_text(json.dumps(LLM))
    model = tmp_path / "llm.onnx"
    assert main(["export", "--config", str(config), "--attention", attention, "--decode", "--out", str(model)]) == 0
    [block] = audit_model(str(model)).blocks
    assert block.passed and block.core == {"decomposed": "decomposed", "onnx": "attention23", "ort-fused": "gqa"}[attention]
    assert [c.name.split(" (")[0] for c in block.checks][-1] == "prefill 9 + 3 steps" and len(block.checks) >= 2
    assert main(["parity", "--model", str(model)]) == 0
    proto = onnx.load(str(model))
    node = next((n for n in proto.graph.node if n.op_type in ("Attention", "GroupQueryAttention")), None)
    if node is not None:
        _set_attr(node, "scale", 0.3)
    else:  # the decomposed core's scale: the constant its scores are multiplied by
        [scale] = [t for t in proto.graph.initializer if t.name == "scale"]
        scale.CopyFrom(numpy_helper.from_array(np.array(0.3, np.float32), "scale"))
    onnx.save(proto, str(model))
    [block] = audit_model(str(model)).blocks
    assert not block.passed and block.findings[0] == "layer 0: scale 0.3 in the graph, 0.25 in its attnx.config"
    assert main(["parity", "--model", str(model)]) == 1


# Models other tools exported: torch.onnx, Optimum, ONNX Runtime's transformers optimizer -------------------
EXPORTED = Path(__file__).resolve().parents[1] / "fixtures" / "exported"
AGREE = {  # (fixture, its core)
    "torch-dynamo/llama/sdpa-opset20": "decomposed", "torch-dynamo/llama/eager-opset20": "decomposed",
    "torch-dynamo/llama/sdpa-opset23": "attention23", "torch-dynamo/qwen3/sdpa-opset20": "decomposed",
    "torch-dynamo/qwen3/sdpa-opset23": "attention23", "torch-dynamo/gemma2/eager-opset20": "decomposed",
    "optimum/llama": "decomposed", "ort-optimizer/bert": "ms-attention",
    "torch-dynamo/gpt2/sdpa-opset20": "decomposed",  # q|k|v one addmm (a Gemm on flattened tokens), split
}


def _exported_checkpoint(fixture: str) -> str:
    import json

    folder = EXPORTED / fixture
    return str((folder / json.loads((folder / "fixture.json").read_text())["checkpoint"]).resolve())


@pytest.mark.parametrize("fixture", AGREE)
def test_a_model_another_tool_exported_agrees_term_by_term(fixture):
    """Each block read (the scale on the scores or as sqrt(scale) on q and k, a softcap, decomposed RMS norms and
    rotations, masks computed once for all layers, a fused BERT Attention with its bias in the next
    SkipLayerNormalization), paired with its checkpoint layer, no term differing, every check passing."""
    report = audit_model(str(EXPORTED / fixture / "model.onnx"), checkpoint=_exported_checkpoint(fixture))
    assert report.passed, [b.findings + b.not_checked for b in report.blocks] + report.unread + report.findings
    assert [b.layer for b in report.blocks] == [0, 1] and all(b.core == AGREE[fixture] for b in report.blocks)
    assert all(len(b.checks) == (2 if fixture.startswith("ort-optimizer") else 3) for b in report.blocks)


def test_optimum_s_gemma2_drops_the_softcap_and_the_audit_says_where():
    """optimum-onnx 0.1.0 exports through transformers 4.57, whose sdpa path for Gemma 2 leaves out
    attn_logit_softcapping: every layer is named with the term, the first position and the stage."""
    report = audit_model(str(EXPORTED / "optimum/gemma2/model.onnx"), checkpoint=_exported_checkpoint("optimum/gemma2"))
    for block in report.blocks:
        assert block.findings[0] == f"layer {block.index}: softcap None in the graph, 50.0 in the checkpoint"
        assert any(f.startswith(f"block {block.index}: full sequence (12 tokens) against the reference fails")
                   and f.endswith("first at position 1") for f in block.findings)  # fmt: skip
        assert block.localised.startswith(f"block {block.index}: localised to stage z ")
    assert not report.passed


# What a review found (each once a silent pass or an internal error) -------------------------------------------
def _mask_sub_two(p):  # the builder's seqlens_k = ReduceSum(attention_mask) - 1, made - 2: every row one key short
    sub = next(n for n in p.graph.node if n.name == "/model/attn_mask_reformat/attn_mask_subgraph/Sub")
    p.graph.initializer.append(numpy_helper.from_array(np.array([2], np.int64), "planted_two"))
    sub.input[1] = "planted_two"


def test_the_lengths_a_block_reads_are_computed_from_attention_mask_in_its_cut(tmp_path):
    """seqlens_k comes from the model's own attention_mask subgraph (shared by the layers), not fed by the audit: a
    fault there is every block's."""
    report = audit_model(_planted(tmp_path, "llama/fp32", _mask_sub_two), checkpoint=_checkpoint("llama/fp32"))
    assert all(any("full sequence (12 tokens) against the reference fails" in f for f in b.findings)
               for b in report.blocks) and not report.passed  # fmt: skip


def test_a_layer_held_twice_and_a_layer_left_out_are_findings(tmp_path):
    def copy_layer_0(p):
        for kind in ("qkv_proj", "o_proj"):
            src, dst = _init(p, f"model.layers.0.attn.{kind}.MatMul.weight"), _init(p, f"model.layers.1.attn.{kind}.MatMul.weight")
            _put(p, dst[0], src[1])

    report = audit_model(_planted(tmp_path, "llama/fp32", copy_layer_0), checkpoint=_checkpoint("llama/fp32"))
    assert report.findings == ["blocks 0, 1 all pair with checkpoint layer 0: the graph holds one layer's weights more "
                               "than once", "checkpoint layer(s) 1: no block of the graph pairs with them"]  # fmt: skip
    assert not report.passed


def test_nothing_run_is_not_a_pass(monkeypatch):
    from attnx.workflows.audit import run

    monkeypatch.setattr(run, "runner_for", lambda backend, cut: "not on this machine")
    report = audit_model(str(GENAI / "llama/fp32/model.onnx"), layers=[0])
    assert not report.passed and report.blocks[0].not_checked[-1].startswith("block 0: not run: no backend asked for")


def test_a_graph_whose_values_break_a_reader_is_named_not_an_internal_error(tmp_path, capsys):
    path = _planted(tmp_path, "llama/fp32", lambda p: _set_attr(_node(p, 0), "num_heads", 0))
    assert main(["audit", path]) == 1
    out = capsys.readouterr().out
    assert "not read: node /model/layers.0/attn/GroupQueryAttention: not read as attention: ConfigError: " in out


@pytest.mark.parametrize("terms", [{"sliding_window": 4, "softcap": 30.0, "rope": {"theta": 10000.0}},
                                   {"sinks": True}, {"key_padding_mask": True, "causal": False}])  # fmt: skip
def test_attnx_exports_with_more_terms_audit_as_parity_checks_them(tmp_path, terms):
    import json

    config = tmp_path / "c.json"
    config.write_text(json.dumps({"d_model": 64, "n_heads": 4, "n_kv_heads": 2, "causal": True, **terms}))
    for attention in ("decomposed", "onnx", "ort-fused"):
        model = tmp_path / f"{attention}.onnx"
        if main(["export", "--config", str(config), "--attention", attention, "--out", str(model)]) != 0:
            continue  # a lowering that refuses the config says so (sinks on opset-23 Attention)
        [block] = audit_model(str(model)).blocks
        assert block.passed, (attention, block.findings, block.not_checked)
