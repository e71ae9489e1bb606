"""The graph side of each term of the formula (attnx.model.terms declares them): how a graph's value of the term,
as a reader read it (the block's config and its facts: attnx.export._blocks), is compared with a source's: a
checkpoint's layer or a model's attnx.config. Each entry's compare() returns the findings, one line each, "layer N:
..."; compare_terms() runs them in the formula's order (TERMS) after the core's own (heads, scale), so a new term is
one entry here and its declaration there, never a branch in the audit.

    compare(graph, facts, source, ctx) -> [finding]     graph, source: AttentionConfig; facts: what the reader noted

A weight a term adds (its declaration's tensors) that one side lacks with the term is said by the term's own finding
(said_by_terms), not again by the weights' comparison. What a core calls to hide keys and bias scores by these entries
(visibility, score_bias) is attnx.export.visibility.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx import TensorProto

from attnx.export._graph import span
from attnx.export.passes._base import const_array
from attnx.export.passes.walk import NotRead, sink_logits
from attnx.model.alibi import alibi_slopes
from attnx.model.config import AttentionConfig
from attnx.model.rope import rope_frequencies
from attnx.model.rope_fit import rope_table_error
from attnx.model.terms import TERMS, QKNorm, Temperature

__all__ = ["Context", "GRAPH_TERMS", "GraphTerm", "OpAttribute", "OpInput", "compare_terms", "emit_qk", "emit_scores",
           "emit_softmax", "fused_opset", "read_attributes", "read_inputs", "read_paths", "read_scores", "read_softmax",
           "said_by_terms", "stated_terms", "term_attributes", "term_inputs", "used_terms"]


@dataclasses.dataclass(frozen=True)
class Context:
    """Where a finding is: the layer ("layer N") and what the block is held to ("the checkpoint")."""

    where: str
    source: str

    def said(self, graph: str, source: str, why: str = "") -> str:
        return f"{self.where}: {graph} in the graph, {source} in {self.source}{why}"


Compare = Callable[[AttentionConfig, dict[str, Any], AttentionConfig, Context], list[str]]


@dataclasses.dataclass(frozen=True)
class OpAttribute:
    """A term an operator states as an attribute: its name, its value for a config (None: not written), and the
    config's value its value states (None: the term absent)."""

    name: str
    write: Callable[[AttentionConfig], Any]
    read: Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class OpInput:
    """A term an operator takes as an input: its slot, the value written for a config (write(g, config, weights)
    -> a tensor name), and what a graph's value at that slot (None: the slot empty) states: read(value) -> (the
    config's value, the weights it holds). NotRead where a value is there but cannot be read."""

    slot: int
    write: Callable[[Any, AttentionConfig, Mapping[str, np.ndarray]], str]
    read: Callable[[Any], tuple[Any, dict[str, np.ndarray]]]


@dataclasses.dataclass(frozen=True)
class GraphTerm:
    """The graph side of one term (the module doc)."""

    name: str
    compare: Compare
    attributes: Mapping[str, OpAttribute] = dataclasses.field(default_factory=dict)  # {core: its attribute}
    # from the scalings between q.k and a Softmax (ScoreChain.scalings, from the Softmax back): the term's value and
    # the scalings left; None where the term is not among them
    recognise: Callable[[list[tuple[Any, ...]]], tuple[Any, list[tuple[Any, ...]]]] | None = None
    # the decomposed core's operators for the term on the scores (a graph, the config, the scores) -> the scores
    emit_scores: Callable[[Any, AttentionConfig, str], str] | None = None
    # the config keys the graph's reading states for the term (facts -> config), for a term read from a node
    stated: tuple[str, ...] = ()
    # a term of place "mask": the keys it hides, bool [B|1, 1, S, T], from this call's queries' token indices
    # qcol [1, 1, S, 1] and every key's krow [1, 1, 1, T] (int64), and the padding mask (None without):
    # hides(g, config, qcol, krow, kpm)
    hides: Callable[[Any, AttentionConfig, str, str, str | None], str] | None = None
    # a term added to the scores after the score terms, before the masks: bias(g, config, qcol, krow) -> float32
    # [1, H, S, T]; a core without a place for it on its scores takes it in its additive mask input
    bias: Callable[[Any, AttentionConfig, str, str], str] | None = None
    # a term of place "softmax": one more logit per query beside the scores, joining the decomposed core's softmax
    # and dropped after it: column(g, config, weights, scores [B, H, S, T]) -> [B, H, S, 1]; and its reading from
    # the Concat before a Softmax (the column's value) -> (the config's value, the weights it holds)
    column: Callable[[Any, AttentionConfig, Mapping[str, np.ndarray], str], str] | None = None
    read_column: Callable[[Any], tuple[Any, dict[str, np.ndarray]]] | None = None
    inputs: Mapping[str, OpInput] = dataclasses.field(default_factory=dict)  # {core: its input}
    # a mask term read from the grid a graph's mask computes for a prompt (allowed [tokens, tokens], True: query i
    # sees key j): fit_grid(allowed) -> (the config's value, how the mask is said, None without the term)
    fit_grid: Callable[[np.ndarray], tuple[Any, str | None]] | None = None
    # a term read from what the walk met on q's and k's paths (attnx.export.passes.walk.Path): read_paths(paths,
    # weights, facts) -> the config's value (None: absent), its weights into `weights`
    read_paths: Callable[[Mapping[str, Any], dict[str, np.ndarray], dict[str, Any]], Any] | None = None
    # the default-domain opset its operators need beside a fused core (the decomposed core writes it in older ops)
    opset: int | None = None
    # a term of place "qk" before rope written in its core's operators (attnx.export._llm, Core.term_ops), one head-split
    # tensor at a time: emit_styled(g, config, weights, u [B, S, heads, hd], "q" or "k", standard ops?, output name)
    emit_styled: Callable[[Any, AttentionConfig, Mapping[str, np.ndarray], str, str, bool, str | None], str] | None = None
    # a term the graph computes per token index, its values read by running the graph for a prompt (the audit) and
    # fitted: fit_values(values [tokens]) -> (the config's value or None, how it is said or why not)
    fit_values: Callable[[np.ndarray], tuple[Any, str]] | None = None
    # a term of place "qk" written in standard ops whatever the core (after the norms and rotation written per
    # style: attnx.export._llm): emit_qk(g, config, q, k, step) -> (q, k), each [B, S, heads * head_dim]
    emit_qk: Callable[[Any, AttentionConfig, str, str, bool], tuple[str, str]] | None = None


def _presence(name: str, graph: bool, source: bool, ctx: Context) -> list[str]:
    if graph == source:
        return []
    return [f"{ctx.where}: {name} {'in the graph' if graph else 'missing from the graph'}, "
            f"{'in' if source else 'not in'} {ctx.source}"]  # fmt: skip


def _grouped_heads(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    return [] if g.n_kv_heads == c.n_kv_heads else [ctx.said(f"n_kv_heads {g.n_kv_heads}", str(c.n_kv_heads))]


def _qk_norm(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    return _presence("q/k norm", g.qk_norm is not None, c.qk_norm is not None, ctx)


def _emit_qk_norm(g: Any, c: AttentionConfig, weights: Mapping[str, np.ndarray], u4: str, which: str,
                  standard: bool, name: str | None) -> str:  # fmt: skip
    """RMSNorm of each head times {which}_norm.weight: ReduceMean, Sqrt, Div, Mul (standard ops), else
    RMSNormalization-23 (GroupQueryAttention's q_norm_weight runs on CUDA only: measurements/facts.md)."""
    w = g.const(f"{which}_norm.weight", np.asarray(weights[f"{which}_norm.weight"], np.float32))
    if not standard:
        return g.op("RMSNormalization", u4, w, axis=-1, epsilon=c.qk_norm.eps, name=name)  # opset 23
    eps = g.const("qk_norm_eps", np.asarray(c.qk_norm.eps, np.float32))
    mean_sq = g.op("ReduceMean", g.op("Mul", u4, u4), g.ints("axes_last", [-1]), keepdims=1)
    return g.op("Mul", g.op("Div", u4, g.op("Sqrt", g.op("Add", mean_sq, eps))), w, name=name)


def _read_norms(paths: Mapping[str, Any], weights: dict[str, np.ndarray], facts: dict[str, Any]) -> QKNorm | None:
    """The per-head RMS norms met on q's and k's paths (their weights into `weights`), or None; one alone is not read."""
    q, k = paths["q"].norm, paths["k"].norm
    if q is None and k is None:
        return None
    if q is None or k is None:
        raise NotRead(f"a norm on {'q' if q is not None else 'k'} alone")
    (weights["q_norm.weight"], q_eps), (weights["k_norm.weight"], k_eps) = q, k
    facts["qk_norm_eps"] = [float(q_eps), float(k_eps)]
    return QKNorm(eps=float(q_eps))


def _rope(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    """The graph's rotary table against the source's rope, entry by entry within the bound of the table's own
    storage (rope_table_error); a table the graph computes is read at each prompt length (facts rope_tables_at), a
    constant one holds a row per position whatever the length. Then the pairing of the rotated dims."""
    if c.rope is None:
        return []
    tables = facts.get("rope_tables")
    if tables is None:
        return [f"{ctx.where}: no rotary in the graph, rope in {ctx.source}"]
    found = []
    at = facts.get("rope_tables_at") or {tables[0].shape[0]: tables}
    for tokens, (cos, sin) in sorted(at.items()):
        inv_freq, factor = rope_frequencies(c.rope, tokens)
        if cos.shape[1] != inv_freq.shape[0]:
            found.append(ctx.said(f"rotary on {2 * cos.shape[1]} of each head's dims", str(2 * inv_freq.shape[0])))
            break
        err, ratio = rope_table_error(cos, sin, inv_freq, factor)
        if ratio > 1:  # beyond float32's rounding of the angles (rope_table_error)
            prompt = f" for a prompt of {tokens} tokens" if "rope_tables_at" in facts else ""
            found.append(f"{ctx.where}: rotary table{prompt} differs from {ctx.source}'s rope ({c.rope.rope_type}, "
                         f"theta {c.rope.theta:g}) by {err:.3g}, {ratio:.3g} times its bound (graph theta fit "
                         f"{facts.get('rope_theta', float('nan')):.6g})")  # fmt: skip
    if facts.get("rotary_interleaved") != c.rope.interleaved:
        found.append(f"{ctx.where}: rotary_interleaved {int(facts.get('rotary_interleaved', 0))} in the graph, "
                     f"{ctx.source}'s rope pairs {'(2i, 2i+1)' if c.rope.interleaved else '(i, i+dim/2)'}")  # fmt: skip
    return found


def _softcap(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    if (g.softcap or None) == (c.softcap or None) or (g.softcap and c.softcap and np.isclose(g.softcap, c.softcap,
                                                                                             rtol=1e-6)):  # fmt: skip
        return []
    return [ctx.said(f"softcap {g.softcap}", str(c.softcap))]


def _recognise_softcap(scalings: list[tuple[Any, ...]]) -> tuple[float | None, list[tuple[Any, ...]]]:
    """c * tanh(s / c) in the order the graph computes it (the scalings run from the Softmax back): the cap c is the
    multiply after the tanh that undoes a divide before it (their product 1); the divide gone, the other scalings
    before the tanh are the scale's. A scaling after the tanh other than the cap's multiply (after the softcap,
    after the mask added to the capped scores, or between the tanh and the multiply) scales the capped scores, which
    no term does: NotRead naming it. A scaling by exactly 1 changes nothing and is read as none."""
    scalings = [entry for entry in scalings if not (entry[0] == "scale" and entry[1] == 1.0)]
    at = next((i for i, entry in enumerate(scalings) if entry[0] == "tanh"), None)
    if at is None:
        return None, scalings
    end = next((i for i in range(at + 1, len(scalings)) if scalings[i][0] != "scale"), len(scalings))
    inside = range(at + 1, end)  # the scalings before the tanh, up to any other tanh
    # the cap's multiply: the one nearest the tanh that a divide before it undoes
    pair = next(((i, j) for i in range(at - 1, -1, -1) for j in inside
                 if np.isclose(scalings[i][1] * scalings[j][1], 1.0, rtol=1e-5)), None)  # fmt: skip
    if pair is None:
        raise NotRead("a tanh in the scores that is not a softcap c * tanh(s / c): no multiply after it undoes a "
                      "divide before it")  # fmt: skip
    cap_at, divide_at = pair
    if at - 1 > cap_at:
        raise NotRead(f"{_scaling_said(scalings[at - 1])} between the tanh and the softcap's multiply by "
                      f"{scalings[cap_at][1]:g}: no term explains it")  # fmt: skip
    if cap_at > 0:
        raise NotRead(f"{_scaling_said(scalings[cap_at - 1])} after the softcap: no term explains it")
    return scalings[cap_at][1], [e for i, e in enumerate(scalings) if i not in (cap_at, at, divide_at)]


def _scaling_said(entry: tuple[Any, ...]) -> str:
    """'a Mul by 1.25', 'a Div by 0.8': a scaling of the scores as the graph writes it (ScoreChain.scalings)."""
    node, const = entry[2], const_array(entry[3])
    return f"a {node.op_type} by {float(const.ravel()[0]):g}"


def _emit_softcap(g: Any, c: AttentionConfig, scores: str) -> str:
    """c * tanh(s / c) as Div, Tanh, Mul, after the scale, before the masks."""
    cap = g.const("softcap", np.asarray(c.softcap, np.float32))
    return g.op("Mul", g.op("Tanh", g.op("Div", scores, cap)), cap)


_SOFTCAP = OpAttribute("softcap", lambda c: c.softcap, lambda value: value or None)
# local_window_size W is attnx's window: GroupQueryAttention shows key j to query p iff p - W < j <= p (measured
# against both conventions: measurements/facts.md); -1 is none
_WINDOW = OpAttribute("local_window_size", lambda c: c.sliding_window,
                      lambda value: value if value is not None and value > 0 else None)  # fmt: skip


def _alibi(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    return _presence("the ALiBi bias", g.alibi, c.alibi, ctx)


def _sinks(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    return _presence("sinks", g.sinks, c.sinks, ctx)


def _alibi_bias(g: Any, c: AttentionConfig, qcol: str, krow: str) -> str:
    """slope_h * (j - i) over token index, [1, H, S, T] float32: the slopes of attnx.model.alibi, the distance exact
    in float32 (below 2^24)."""
    distance = g.op("Cast", g.op("Sub", krow, qcol), to=TensorProto.FLOAT)  # [S, T]: j - i
    slopes = g.const("alibi_slopes", alibi_slopes(c.n_heads).astype(np.float32).reshape(1, -1, 1, 1))
    return g.op("Mul", slopes, g.op("Unsqueeze", distance, g.ints("axes_01", [0, 1])))


def _sink_column(g: Any, c: AttentionConfig, weights: Mapping[str, np.ndarray], scores: str) -> str:
    """The sink logit of each head, [B, H, S, 1] beside the scores."""
    shape = g.op("Concat", g.op("Shape", scores, start=0, end=3), g.ints("one1", [1]), axis=0)
    logits = np.asarray(weights["sinks"], np.float32).reshape(1, c.n_heads, 1, 1)
    return g.op("Expand", g.const("sinks", logits), shape)


def _read_sink_column(value: Any) -> tuple[bool, dict[str, np.ndarray]]:
    return True, {"sinks": sink_logits(value).ravel()}


def _write_head_sink(g: Any, c: AttentionConfig, weights: Mapping[str, np.ndarray]) -> str:
    return g.const("sinks", np.asarray(weights["sinks"], np.float32))  # a logit per head (measured: exp(sink))


def _read_head_sink(value: Any) -> tuple[bool, dict[str, np.ndarray]]:
    if value is None:
        return False, {}
    logits = const_array(value)
    if logits is None:
        raise NotRead("head_sink is not a constant")
    return True, {"sinks": np.array(logits)}


def _l2_norm(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    if (g.qk_l2_norm is None) != (c.qk_l2_norm is None):
        return _presence("the q/k norm after rope", g.qk_l2_norm is not None, c.qk_l2_norm is not None, ctx)
    if g.qk_l2_norm is not None and not np.isclose(g.qk_l2_norm, c.qk_l2_norm, rtol=1e-3):
        return [ctx.said(f"q/k norm after rope eps {g.qk_l2_norm:g}", f"{c.qk_l2_norm:g}")]
    return []


def _read_l2_norms(paths: Mapping[str, Any], weights: dict[str, np.ndarray], facts: dict[str, Any]) -> float | None:
    """The eps of the norms without weights met on q's and k's paths (Path.plain_norm), or None; one alone is not
    read."""
    q, k = paths["q"].plain_norm, paths["k"].plain_norm
    if (q is None) != (k is None):
        raise NotRead(f"a norm without weights on {'q' if q is not None else 'k'} alone")
    return q


def _per_head(g: Any, u: str, heads: int, hd: int, f: Callable[[str], str], name: str) -> str:
    """f over each head of u [B, S, heads * hd] ([B, S, heads, hd] inside), back to [B, S, heads * hd]."""
    u4 = g.op("Reshape", u, g.ints(f"{name}_4d", [0, 0, heads, hd]))
    return g.op("Reshape", f(u4), g.ints(f"{name}_3d", [0, 0, heads * hd]))


def _emit_l2_norm(g: Any, c: AttentionConfig, q: str, k: str, step: bool) -> tuple[str, str]:
    """x / sqrt(mean(x^2) + eps) over each head's head_dim: ReduceMean, Add, Sqrt, Div (any opset)."""
    eps = g.const("qk_l2_norm_eps", np.asarray(c.qk_l2_norm, np.float32))

    def norm(u4: str) -> str:
        mean_sq = g.op("ReduceMean", g.op("Mul", u4, u4), g.ints("axes_last", [-1]), keepdims=1)
        return g.op("Div", u4, g.op("Sqrt", g.op("Add", mean_sq, eps)))

    return (_per_head(g, q, c.n_heads, c.head_dim, norm, "q_l2"),
            _per_head(g, k, c.n_kv_heads, c.head_dim, norm, "k_l2"))  # fmt: skip


def _temperature(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    ours, theirs = g.attn_temperature, c.attn_temperature
    if (ours is None) != (theirs is None):
        return _presence("the attention temperature", ours is not None, theirs is not None, ctx)
    if ours is not None and not (np.isclose(ours.floor_scale, theirs.floor_scale, rtol=1e-6)
                                 and np.isclose(ours.attn_scale, theirs.attn_scale, rtol=1e-4)):  # fmt: skip
        return [ctx.said(f"temperature floor_scale {ours.floor_scale:g}, attn_scale {ours.attn_scale:g}",
                         f"{theirs.floor_scale:g}, {theirs.attn_scale:g}")]  # fmt: skip
    return []


def _read_temperature(paths: Mapping[str, Any], weights: dict[str, np.ndarray], facts: dict[str, Any]) -> None:
    """A factor the graph computes per position on q (Path.factor): named for the audit to run (facts["computed_terms"]),
    its value fitted after (fit_values); None until then."""
    if paths["k"].factor is not None:
        raise NotRead("a factor computed per position on k: not a temperature")
    if paths["q"].factor is not None:
        facts.setdefault("computed_terms", {})["attn_temperature"] = paths["q"].factor.name
    return None


def _fit_temperature(factors: np.ndarray) -> tuple[Temperature | None, str]:
    """The temperature whose factors, log1p(floor((i + 1) / F)) * A + 1 for token indices i = 0.., are `factors`
    [tokens]: F the first index + 1 where a factor is not 1, A from it; checked at every index. (None, why) where no
    temperature gives them, or where every factor is 1 (F beyond the prompt)."""
    tokens = np.arange(factors.shape[0])
    moved = np.flatnonzero(factors != 1.0)
    if moved.size == 0:
        return None, f"every factor 1 over {factors.shape[0]} tokens"
    floor_scale = float(moved[0] + 1)
    attn_scale = float((factors[moved[0]] - 1.0) / np.log(2.0))
    if not attn_scale > 0:
        return None, f"a factor {factors[moved[0]]:g} at token {moved[0]}: not a temperature"
    fitted = Temperature(floor_scale, attn_scale)
    error = np.abs(fitted.factors(tokens) - factors).max()
    if error > 4 * np.finfo(np.float32).eps * np.abs(factors).max():
        return None, f"no floor_scale and attn_scale give the factors (off by {error:.3g})"
    return fitted, f"floor_scale {floor_scale:g}, attn_scale {attn_scale:.6g}"


def _emit_temperature(g: Any, c: AttentionConfig, q: str, k: str, step: bool) -> tuple[str, str]:
    """q [B, S, D] times log1p(floor((i + 1) / floor_scale)) * attn_scale + 1 of its token index i ([S, 1]:
    past_seq + s in a step), in float32 (Log of 1 + an integer-valued float)."""
    past, total = span(g, step)
    one = g.const("one_i64", np.asarray(1, np.int64))
    tokens = g.op("Cast", g.op("Range", past, total, one), to=TensorProto.FLOAT)  # [S]
    t = c.attn_temperature
    f32 = {name: g.const(f"temperature_{name}", np.asarray(value, np.float32))
           for name, value in (("one", 1.0), ("floor", t.floor_scale), ("scale", t.attn_scale))}  # fmt: skip
    steps = g.op("Floor", g.op("Div", g.op("Add", tokens, f32["one"]), f32["floor"]))
    factor = g.op("Add", g.op("Mul", g.op("Log", g.op("Add", steps, f32["one"])), f32["scale"]), f32["one"])
    return g.op("Mul", q, g.op("Unsqueeze", factor, g.ints("axes_1", [1]))), k  # [B, S, D] * [S, 1]


def compare_causal(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    if g.causal == c.causal:
        return []
    mask = f" ({facts['mask']})" if "mask" in facts else ""
    return [ctx.said(f"{'a causal mask' if g.causal else 'no causal mask'}{mask}", "causal" if c.causal else "not causal")]


def compare_window(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    if g.sliding_window == c.sliding_window:
        return []
    how = (f"local_window_size {facts['local_window_size']}" if "local_window_size" in facts
           else f"its mask: {facts.get('mask', 'not read')}")  # fmt: skip
    graph = f"window {g.sliding_window}" if g.sliding_window else "no window"
    source = f"sliding_window {c.sliding_window}" if c.sliding_window else "no window"
    why = f": every query past {c.sliding_window} sees keys it must not" if c.sliding_window and not g.sliding_window else ""
    return [f"{ctx.where}: {graph} in the graph ({how}), {source} in {ctx.source}{why}"]


def hides_later(g: Any, c: AttentionConfig, qcol: str, krow: str, kpm: str | None) -> str:
    return g.op("Greater", krow, qcol)  # key j after query i


def hides_outside(g: Any, c: AttentionConfig, qcol: str, krow: str, kpm: str | None) -> str:
    start = g.op("Sub", qcol, g.const("window_i64", np.asarray(c.sliding_window, np.int64)))
    return g.op("LessOrEqual", krow, start)  # j <= i - W


def fit_causal(allowed: np.ndarray) -> tuple[bool, str | None]:
    grid = np.arange(allowed.shape[0])
    causal = bool(allowed.any(axis=1).all() and not (allowed & (grid[None, :] > grid[:, None])).any())
    return causal, "causal" if causal else None


def fit_window(allowed: np.ndarray) -> tuple[int | None, str | None]:
    """W where query i sees min(i + 1, W) keys (the last query sees fewer than every key), None otherwise (a chunked
    grid's rows start anew at each chunk)."""
    tokens = allowed.shape[0]
    width = int(allowed[-1].sum())  # the keys the last query sees
    if width >= tokens or not np.array_equal(allowed.sum(axis=1), np.minimum(np.arange(tokens) + 1, width)):
        return None, None
    return width, f"window {width}"


def compare_chunk(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    if g.attention_chunk == c.attention_chunk:
        return []
    graph = f"chunks of {g.attention_chunk}" if g.attention_chunk else "no chunks"
    source = f"attention_chunk {c.attention_chunk}" if c.attention_chunk else "no chunks"
    return [f"{ctx.where}: {graph} in the graph (its mask: {facts.get('mask', 'not read')}), {source} in "
            f"{ctx.source}"]  # fmt: skip


def hides_other_chunk(g: Any, c: AttentionConfig, qcol: str, krow: str, kpm: str | None) -> str:
    """(i - start) // C != (j - start) // C, start the row's leading padded keys ([B, 1, 1, 1]; 0 without
    padding). Div truncates: it differs from the floor only where i or j is before start, keys the padding hides
    and queries that see none (a chunked mask is causal)."""
    size = g.const("chunk_i64", np.asarray(c.attention_chunk, np.int64))
    if kpm is not None:
        kept = g.op("CumSum", g.op("Cast", g.op("Not", kpm), to=TensorProto.INT64), g.const("one_i64_axis",
                                                                                           np.asarray(1, np.int64)))
        leading = g.op("Cast", g.op("Equal", kept, g.const("zero_i64", np.asarray(0, np.int64))), to=TensorProto.INT64)
        start = g.op("Reshape", g.op("ReduceSum", leading, g.ints("axes_1", [1]), keepdims=1),
                     g.ints("b111", [-1, 1, 1, 1]))  # fmt: skip
        qcol, krow = g.op("Sub", qcol, start), g.op("Sub", krow, start)  # [B, 1, S, 1], [B, 1, 1, T]
    return g.op("Not", g.op("Equal", g.op("Div", qcol, size), g.op("Div", krow, size)))


def fit_chunk(allowed: np.ndarray) -> tuple[int | None, str | None]:
    """C where every query i sees exactly the keys of its chunk up to itself, [i - i % C, i], and some query a
    chunk starts at sees no earlier key; None otherwise."""
    tokens = allowed.shape[0]
    starts = [i for i in range(1, tokens) if allowed[i, i] and not allowed[i, i - 1]]
    if not starts:
        return None, None
    size = starts[0]
    grid = np.arange(tokens)
    chunked = (grid[None, :] <= grid[:, None]) & (grid[None, :] // size == grid[:, None] // size)
    return (size, f"chunks of {size}") if np.array_equal(allowed, chunked) else (None, None)


GRAPH_TERMS: dict[str, GraphTerm] = {
    t.name: t
    for t in (
        GraphTerm("grouped_heads", _grouped_heads),
        GraphTerm("qk_norm", _qk_norm, read_paths=_read_norms, opset=23, emit_styled=_emit_qk_norm),  # RMSNorm-23
        GraphTerm("rope", _rope),
        GraphTerm("qk_l2_norm", _l2_norm, emit_qk=_emit_l2_norm, read_paths=_read_l2_norms),
        GraphTerm("attn_temperature", _temperature, emit_qk=_emit_temperature, read_paths=_read_temperature,
                  fit_values=_fit_temperature),
        GraphTerm("softcap", _softcap, {"attention23": _SOFTCAP, "gqa": _SOFTCAP}, _recognise_softcap, _emit_softcap,
                  ("softcap",)),
        GraphTerm("alibi", _alibi, bias=_alibi_bias),
        GraphTerm("causal", compare_causal, hides=hides_later, fit_grid=fit_causal),
        GraphTerm("sliding_window", compare_window, {"gqa": _WINDOW}, stated=("sliding_window",),
                  hides=hides_outside, fit_grid=fit_window),
        GraphTerm("attention_chunk", compare_chunk, hides=hides_other_chunk, fit_grid=fit_chunk),
        GraphTerm("sinks", _sinks, column=_sink_column, read_column=_read_sink_column,
                  inputs={"gqa": OpInput(11, _write_head_sink, _read_head_sink)}),
    )
}
# the terms not compared here, and why: cross (the audit reads self-attention), kv_cache and key_padding_mask (the
# forms and inputs the audit feeds, not the formula: its reference is set without them), latent (no reader of an MLA
# block yet: the audit's blocks are read from q_proj, k_proj and v_proj)
NOT_COMPARED = {"cross", "kv_cache", "key_padding_mask", "latent"}
assert set(GRAPH_TERMS) | NOT_COMPARED == set(TERMS), set(TERMS) ^ (set(GRAPH_TERMS) | NOT_COMPARED)


def compare_terms(graph: AttentionConfig, facts: dict[str, Any], source: AttentionConfig, ctx: Context) -> list[str]:
    """Every difference between the formula a graph states and its source's: the core's own (the query heads, the
    head size, the scale), then each term's, in the formula's order."""
    found = [ctx.said(f"{key} {getattr(graph, key)}", str(getattr(source, key)))
             for key in ("n_heads", "head_dim") if getattr(graph, key) != getattr(source, key)]  # fmt: skip
    if not np.isclose(graph.softmax_scale, source.softmax_scale, rtol=1e-6):
        found.append(ctx.said(f"scale {graph.softmax_scale:.6g}", f"{source.softmax_scale:.6g}"))
    for name in TERMS:
        if name in GRAPH_TERMS:
            found += GRAPH_TERMS[name].compare(graph, facts, source, ctx)
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


def read_paths(paths: Mapping[str, Any], weights: dict[str, np.ndarray], facts: dict[str, Any]) -> dict[str, Any]:
    """{config key: value} of the terms read from q's and k's paths (each entry's read_paths: the norms), their
    weights into `weights`; each absent without paths (a packed projection the core splits itself)."""
    out: dict[str, Any] = {}
    for name, term in GRAPH_TERMS.items():
        if term.read_paths is not None:
            (key,) = TERMS[name].keys
            out[key] = term.read_paths(paths, weights, facts) if paths else None
    return out


def fused_opset(config: AttentionConfig) -> int | None:
    """The default-domain opset the config's terms need beside a fused core (each entry's opset), or None."""
    needs = [t.opset for t in used_terms(config, "opset")]
    return max(needs) if needs else None


def stated_terms(facts: dict[str, Any]) -> dict[str, Any]:
    """The config keys a reading stated for the terms read from a node (each entry's `stated`), as config values."""
    return {key: facts.get(key) for term in GRAPH_TERMS.values() for key in term.stated}


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

