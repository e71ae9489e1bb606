"""The decomposed full-sequence graph has two builders (docs/concepts/lowerings.md, "Why two builders of the
decomposed graph"): the torch module traced by torch.onnx (export_onnx: what `attnx export --attention decomposed`
writes) and the registry's emitter (build_decomposed_model: what localisation runs). Both give the same graph, for
every term the decomposed core takes: the same inputs and outputs (names, dtypes, dims), the same stages named, and
the same y at two shapes within the tolerance table."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from attnx.export import build_decomposed_model, export_onnx
from attnx.model import AttentionConfig, init_weights
from attnx.model.config import preset
from attnx.model.inputs import make_inputs
from attnx.model.stages import stage_layouts
from attnx.model.tolerance import problem_size, tolerance_for
from attnx.runtimes.compare import compare_arrays
from tests.conftest import CONFIGS, LLM_CONFIGS

# The configs test_names.py traces with the same weights (one trace each in a run, through the trace cache), and
# between them every term: plain self-attention; causal, a key padding mask and a custom scale; cross-attention with
# another v head size; grouped heads, rope (partial, interleaved, yarn), a window, a softcap, q/k norms and sinks;
# ALiBi; Llama 4's chunked rope layer (the norm after rope, chunks under left padding) and its NoPE layer (the
# temperature).
CASES = {
    "tiny": preset("tiny"),
    "causal_kpm": CONFIGS["causal_kpm"],
    "cross": CONFIGS["cross"],
    "llm": LLM_CONFIGS["llm"],
    "alibi": AttentionConfig(d_model=32, n_heads=4, causal=True, key_padding_mask=True, alibi=True),
    "llama4": LLM_CONFIGS["llama4"],
    "llama4-nope": LLM_CONFIGS["llama4-nope"],
}
SHAPES = ((1, 3, 4), (3, 9, 7))  # (batch, seq, mem_seq): neither the trace's example (2, 5, 6)


def _io(model: onnx.ModelProto) -> list[tuple[str, int, list[int | str]]]:
    return [(v.name, v.type.tensor_type.elem_type, [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim])
            for v in [*model.graph.input, *model.graph.output]]  # fmt: skip


def _stages(model: onnx.ModelProto) -> set[str]:
    """The stages the graph names: listed in its metadata, each a tensor of the graph."""
    named = set(stage_layouts({p.key: p.value for p in model.metadata_props}))
    tensors = {o for n in model.graph.node for o in n.output} | {o.name for o in model.graph.output}
    assert named <= tensors, sorted(named - tensors)
    return named


@pytest.mark.parametrize("name", CASES)
def test_the_trace_and_the_emitter_give_the_same_graph(name):
    config = CASES[name]
    weights = init_weights(config, 1)
    traced = ir.to_proto(export_onnx(config, weights))
    emitted = build_decomposed_model(config, weights)
    assert _io(traced) == _io(emitted)
    # the same stages; where each holds a rotated q/k differs (the trace rotates after the split into heads)
    assert _stages(traced) == _stages(emitted)
    sessions = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]) for m in (traced, emitted)]
    for i, (batch, seq, mem_seq) in enumerate(SHAPES):
        feeds = make_inputs(config, batch, seq, mem_seq if config.cross else None, seed=20 + i)
        y_traced, y_emitted = (s.run(["y"], feeds)[0] for s in sessions)
        c = compare_arrays(f"{name} {batch}x{seq}", y_traced, np.asarray(y_emitted, np.float64), tolerance_for("fp32"),
                           problem_size(config, weights, feeds))  # fmt: skip
        assert c, c
