"""The graph side of each term of the formula (attnx.model.terms declares them), one module a term, of the term's
name (attnx.export.terms.rope, ...), each holding its GraphTerm, GRAPH: how a graph's value of the term, as a reader
read it (the block's config and its reading, Reading: attnx.export._blocks), is compared with a source's (a checkpoint's layer
or a model's attnx.config), and how each core writes and reads it. Each entry's compare() returns the findings, one
line each, "layer N: ..."; compare_terms() runs them in the formula's order (TERMS) after the core's own (heads,
scale), so a new term is its module here and its entry there, never a branch in the audit.

    compares(graph, reading, source, ctx) -> [finding]  graph, source: AttentionConfig; reading: what the block's
                                                        reading holds of the term, typed (the entry's
                                                        reading(Reading): RopeReading, MaskReading; None where the
                                                        configs suffice)
    compare(graph, reading, source, ctx)                the same from a block's whole Reading

Why found by the term's name, not registered: the entry (attnx.model.terms) is the ground layer, which may not
import this one; the graph half is the module of the entry's name in this package, so adding one is writing the
module, and graph_of() is the one place that finds it. A term without a module here is not compared (NOT_COMPARED
says why each). A weight a term adds (its declaration's tensors) that one side lacks with the term is said by the
term's own finding (said_by_terms), not again by the weights' comparison. What a core calls to hide keys and bias
scores by these entries (visibility, score_bias) is attnx.export.visibility.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx_ir as ir

from attnx.export.passes.walk import NotRead
from attnx.export.terms._base import Context, GraphTerm, MaskReading, OpAttribute, OpInput
from attnx.export.terms._reading import ComputedTerm, Reading
from attnx.export.terms.rope import RopeReading
from attnx.model.config import AttentionConfig
from attnx.model.terms import TERMS, Term

__all__ = ["ComputedTerm", "Context", "GRAPH_TERMS", "GraphTerm", "MaskReading", "OpAttribute", "OpInput", "Reading",
           "RopeReading", "compare_terms", "emit_qk", "emit_scores", "emit_softmax", "fused_opset", "graph_of",
           "read_attributes", "read_inputs", "read_paths", "read_scores", "read_softmax", "said_by_terms",
           "stated_terms", "term_attributes", "term_inputs", "used_terms"]

_HALVES = frozenset(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def graph_of(term: Term) -> GraphTerm | None:
    """The graph half of a term's entry: GRAPH of the module of its name in this package, None without one."""
    return importlib.import_module(f"{__name__}.{term.name}").GRAPH if term.name in _HALVES else None


# The graph halves in the formula's order (TERMS), by name: a view over the entries for the callers that look one up.
GRAPH_TERMS: dict[str, GraphTerm] = {t.name: g for t in TERMS.values() if (g := graph_of(t)) is not None}
# the terms not compared here, and why: cross (the audit reads self-attention), kv_cache and key_padding_mask (the
# forms and inputs the audit feeds, not the formula: its reference is set without them), latent (no reader of an MLA
# block yet: the audit's blocks are read from q_proj, k_proj and v_proj)
NOT_COMPARED = {"cross", "kv_cache", "key_padding_mask", "latent"}
assert set(GRAPH_TERMS) | NOT_COMPARED == set(TERMS), set(TERMS) ^ (set(GRAPH_TERMS) | NOT_COMPARED)
assert all(g.name == n for n, g in GRAPH_TERMS.items()), "a graph half's name is its module's (its entry's)"
assert _HALVES <= set(TERMS), f"a graph half of no term (its module is named as its term): {_HALVES - set(TERMS)}"


def compare_terms(graph: AttentionConfig, reading: Reading, source: AttentionConfig, ctx: Context) -> list[str]:
    """Every difference between the formula a graph states and its source's: the core's own (the query heads, the
    head size, the scale), then each term's, in the formula's order."""
    found = [ctx.said(f"{key} {getattr(graph, key)}", str(getattr(source, key)))
             for key in ("n_heads", "head_dim") if getattr(graph, key) != getattr(source, key)]  # fmt: skip
    if not np.isclose(graph.softmax_scale, source.softmax_scale, rtol=1e-6):
        found.append(ctx.said(f"scale {graph.softmax_scale:.6g}", f"{source.softmax_scale:.6g}"))
    for name in TERMS:
        if name in GRAPH_TERMS:
            found += GRAPH_TERMS[name].compare(graph, reading, source, ctx)
    return found


def term_attributes(config: AttentionConfig, core: str) -> dict[str, Any]:
    """The attributes `core`'s operator states `config`'s terms by (an OpAttribute of the term's entry), in the
    formula's order; a term the config does not use writes none."""
    out: dict[str, Any] = {}
    for name, term in GRAPH_TERMS.items():
        attribute = term.attributes.get(core)
        if attribute is not None and TERMS[name].uses(config):
            out[attribute.name] = attribute.write(config)
    return out


def read_attributes(node: ir.Node, core: str) -> dict[str, Any]:
    """{config key: value} of the terms a node of `core` states by its attributes (None: the term absent)."""
    out: dict[str, Any] = {}
    for name, term in GRAPH_TERMS.items():
        attribute = term.attributes.get(core)
        if attribute is not None:
            found = node.attributes.get(attribute.name)
            (key,) = TERMS[name].keys
            out[key] = attribute.read(found.value if found is not None else None)
    return out


def read_scores(scalings: list[tuple[Any, ...]]) -> tuple[float, dict[str, Any]]:
    """(the scale, {config key: value} of the terms recognised) of the scalings between q.k and a Softmax
    (ScoreChain.scalings, from the Softmax back): each term's recognise() takes its own, the rest multiply into the
    scale. NotRead for a scaling no term explains (a tanh that is no softcap, a scaling of the capped scores)."""
    stated: dict[str, Any] = {}
    for name, term in GRAPH_TERMS.items():
        if term.recognise is not None:
            value, scalings = term.recognise(scalings)
            (key,) = TERMS[name].keys
            stated[key] = value
    scale = 1.0
    for entry in scalings:
        if entry[0] != "scale":
            raise NotRead(f"a {entry[0]} in the scores that no term of the formula is")
        scale *= entry[1]
    return scale, stated


def emit_qk(g: Any, config: AttentionConfig, q: str, k: str, step: bool) -> tuple[str, str]:
    """q and k [B, S, heads * head_dim] after each term of place "qk" written in standard ops (emit_qk: the norm
    after rope, the temperature), in the formula's order; the norms and the rotation before them are each style's
    own (attnx.export._llm)."""
    for term in used_terms(config, "emit_qk"):
        q, k = term.emit_qk(g, config, q, k, step)
    return q, k


def emit_scores(g: Any, config: AttentionConfig, scores: str) -> str:
    """The scores after each term of the decomposed core that acts on them by an emit_scores (a softcap), in the
    formula's order."""
    for name, term in GRAPH_TERMS.items():
        if term.emit_scores is not None and TERMS[name].uses(config):
            scores = term.emit_scores(g, config, scores)
    return scores


def read_paths(paths: Mapping[str, Any], weights: dict[str, np.ndarray], reading: Reading) -> dict[str, Any]:
    """{config key: value} of the terms read from q's and k's paths (each entry's read_paths: the norms), their
    weights into `weights`, what else they read into the block's `reading`; each absent without paths (a packed
    projection the core splits itself)."""
    out: dict[str, Any] = {}
    for name, term in GRAPH_TERMS.items():
        if term.read_paths is not None:
            (key,) = TERMS[name].keys
            out[key] = term.read_paths(paths, weights, reading) if paths else None
    return out


def fused_opset(config: AttentionConfig) -> int | None:
    """The default-domain opset the config's terms need beside a fused core (each entry's opset), or None."""
    needs = [t.opset for t in used_terms(config, "opset")]
    return max(needs) if needs else None


def stated_terms(stated: Mapping[str, Any]) -> dict[str, Any]:
    """Of the config keys a core's node states (its CoreGraph.read), those of the terms read from a node (each
    entry's `stated`), None where the node does not state one."""
    return {key: stated.get(key) for term in GRAPH_TERMS.values() for key in term.stated}


def said_by_terms(graph: AttentionConfig, source: AttentionConfig) -> frozenset[str]:
    """The weights a term adds (its declaration's tensors) where one side has the term and the other not: the term's
    own finding says so (sinks missing from the graph), not one per tensor."""
    out: set[str] = set()
    for name in GRAPH_TERMS:
        term = TERMS[name]
        if term.uses(graph) != term.uses(source):
            out |= set(term.tensors(graph if term.uses(graph) else source))
    return frozenset(out)


def used_terms(config: AttentionConfig, hook: str) -> list[GraphTerm]:
    """The entries of the terms `config` uses that have `hook`, in the formula's order."""
    return [t for name, t in GRAPH_TERMS.items() if getattr(t, hook) is not None and TERMS[name].uses(config)]


def emit_softmax(g: Any, config: AttentionConfig, weights: Mapping[str, np.ndarray], scores: str,
                 name: str) -> str:  # fmt: skip
    """The decomposed core's softmax over the last axis of scores [B, H, S, T], with each softmax term's column
    (a sink's logit) joined before it and dropped after; its output named `name`."""
    columns = [term.column(g, config, weights, scores) for term in used_terms(config, "column")]
    if not columns:
        return g.op("Softmax", scores, axis=-1, name=name)
    p = g.op("Softmax", g.op("Concat", scores, *columns, axis=-1), axis=-1)
    return g.op("Slice", p, g.ints("zero1", [0]), g.ints(f"minus{len(columns)}", [-len(columns)]),
                g.ints("axes_m1", [-1]), name=name)  # fmt: skip


def read_softmax(chain: Any, n_heads: int | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """({config key: value}, weights) of the softmax terms read from the column the walk found joined to the scores
    before the Softmax (ScoreChain.sink: a Concat of the scores and one more column), each absent without one."""
    stated: dict[str, Any] = {}
    weights: dict[str, np.ndarray] = {}
    for name, term in GRAPH_TERMS.items():
        if term.read_column is None:
            continue
        (key,) = TERMS[name].keys
        stated[key], found = term.read_column(chain.sink.outputs[0]) if chain.sink is not None else (False, {})
        for value in found.values():
            if n_heads is not None and value.size != n_heads:
                raise NotRead(f"a column of {value.size} logits ({name}) for {n_heads} heads")
        weights.update(found)
    return stated, weights


def term_inputs(g: Any, config: AttentionConfig, weights: Mapping[str, np.ndarray], core: str) -> dict[int, str]:
    """{slot: tensor} of the inputs `core`'s operator takes `config`'s terms by (an OpInput of the term's entry)."""
    out: dict[int, str] = {}
    for name, term in GRAPH_TERMS.items():
        entry = term.inputs.get(core)
        if entry is not None and TERMS[name].uses(config):
            out[entry.slot] = entry.write(g, config, weights)
    return out


def read_inputs(node: ir.Node, core: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """({config key: value}, weights) of the terms a node of `core` takes by its inputs (OpInput)."""
    stated: dict[str, Any] = {}
    weights: dict[str, np.ndarray] = {}
    for name, term in GRAPH_TERMS.items():
        entry = term.inputs.get(core)
        if entry is not None:
            value = node.inputs[entry.slot] if len(node.inputs) > entry.slot else None
            (key,) = TERMS[name].keys
            stated[key], found = entry.read(value)
            weights.update(found)
    return stated, weights

