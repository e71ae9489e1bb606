"""What each term's graph half is built from: GraphTerm (its hooks), the operator attribute and input it may
be stated by, and the Context of a finding (attnx.export.terms's doc)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from attnx.model.config import AttentionConfig


@dataclasses.dataclass(frozen=True)
class Context:
    """Where a finding is: the layer ("layer N") and what the block is held to ("the checkpoint")."""

    where: str
    source: str

    def said(self, graph: str, source: str, why: str = "") -> str:
        return f"{self.where}: {graph} in the graph, {source} in {self.source}{why}"


# compares(graph, reading, source, ctx) -> [finding]: the graph's config, the term's reading (GraphTerm.reading)
Compare = Callable[[AttentionConfig, Any, AttentionConfig, Context], list[str]]


@dataclasses.dataclass(frozen=True)
class MaskReading:
    """What a block's reading says of its mask (Reading.mask), the mask terms' reading: how a computed mask was read
    (its grid said: "causal, window 4"; None: not read) and the local_window_size GroupQueryAttention states (None:
    no node states one)."""

    mask: str | None = None
    local_window_size: int | None = None


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
    compares: Compare
    attributes: Mapping[str, OpAttribute] = dataclasses.field(default_factory=dict)  # {core: its attribute}
    # from the scalings between q.k and a Softmax (ScoreChain.scalings, from the Softmax back): the term's value and
    # the scalings left; None where the term is not among them
    recognise: Callable[[list[tuple[Any, ...]]], tuple[Any, list[tuple[Any, ...]]]] | None = None
    # the decomposed core's operators for the term on the scores (a graph, the config, the scores) -> the scores
    emit_scores: Callable[[Any, AttentionConfig, str], str] | None = None
    # the config keys the graph's node states for the term (its CoreGraph.read -> config), for a term read from a node
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
    # weights, reading) -> the config's value (None: absent), its weights into `weights`, what else it reads into
    # the block's reading (attnx.export.terms.Reading: a norm's eps, a tensor the audit runs)
    read_paths: Callable[[Mapping[str, Any], dict[str, np.ndarray], Any], Any] | None = None
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
    # the part of the block's reading (attnx.export.terms.Reading, which this module cannot name: it collects the
    # terms' readings) that compares() takes, typed (Reading.rope, Reading.mask); None: it reads the configs alone
    reading: Callable[[Any], Any] = lambda reading: None

    def compare(self, graph: AttentionConfig, reading: Any, source: AttentionConfig, ctx: Context) -> list[str]:
        """The findings of the graph's value of the term against the source's, from a block's reading (Reading)."""
        return self.compares(graph, self.reading(reading), source, ctx)


def presence(name: str, graph: bool, source: bool, ctx: Context) -> list[str]:
    if graph == source:
        return []
    return [f"{ctx.where}: {name} {'in the graph' if graph else 'missing from the graph'}, "
            f"{'in' if source else 'not in'} {ctx.source}"]  # fmt: skip
