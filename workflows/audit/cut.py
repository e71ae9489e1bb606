"""A block cut out of its model at its own tensors (AuditGraph, cut_block), with the graph inputs its mask, lengths
and rotary are computed from, written to a file (cut_file) and loaded on a backend of the runner registry
(runner_for); what the graph computes for a block (its rotary tables, its mask) read by running that subgraph
(read_computed_terms); the feeds of those graph inputs as transformers makes them (graph_feeds)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from attnx.errors import ProviderUnavailable
from attnx.export.cores import Unread, UnreadKind
from attnx.export.terms import GRAPH_TERMS
from attnx.export.visibility import read_mask_grid
from attnx.model.config import AttentionConfig
from attnx.model.contract import PROVIDERS, provider_of_backend
from attnx.model.rope import Rope, RopeScaling, rope_frequencies, rope_said
from attnx.model.rope_fit import RopeFit, half_table, rope_of_table
from attnx.model.terms import TERMS
from attnx.runtimes._untrusted import check_cut_fits
from attnx.runtimes.base import ModelSource, Runner, backend_unavailable_reason, create_runner
from attnx.workflows.audit.shapes import AUDIT_SHAPE, Shapes

__all__ = ["AuditGraph", "NotFed", "cut_block", "cut_file", "evaluate", "graph_feeds", "graph_inputs_needed",
           "read_computed_terms", "runner_for"]

# an additive mask's entry at or below this hides its key (-1e4: BERT's and ONNX Runtime's mask_filter_value; -inf,
# finfo.min and -65504 in other exports); a visible key's entry is 0 (or a position bias, far above it)
# (full-sequence tokens, prefill tokens, single steps): past an 8-token window, within a 128-row rope table;
# the padded batch's second row is `padding` tokens shorter
# an additive mask's entry at or below this hides its key (-1e4: BERT's and ONNX Runtime's mask_filter_value; -inf,
# finfo.min and -65504 in other exports); a visible key's entry is 0 (or a position bias, far above it)
MASKED = -1000.0


# the longest prompt a computed mask is read at (a [tokens, tokens] grid): windows up to it are read
MASK_PROBE_MAX = 8194


# the longest prompt a computed rotary table is read at (a [tokens, dim/2] table): a source's original length past it
# is not probed
ROPE_PROBE_MAX = 65537


BOUNDARY = ("x", "seqlens_k", "total_sequence_length", "mask_index", "past_key", "past_value")


def graph_inputs_needed(model: Any, block: Any, outputs: Sequence[str], within: bool = True) -> list[str]:
    """The graph inputs the block's outputs depend on (attention_mask, position_ids, the shape of input_ids: what a
    mask or a rotary computed once for all layers reads), in the graph's order; within: not through its boundary."""
    boundary = {block.inputs[k] for k in BOUNDARY if k in block.inputs} if within else set()
    values = {v.name: v for node in model.graph for v in node.outputs}
    graph_inputs = {v.name for v in model.graph.inputs}
    needed, seen, todo = set(), set(), list(outputs)
    while todo:
        name = todo.pop()
        if name in seen or name in boundary:
            continue
        seen.add(name)
        if name in graph_inputs:
            needed.add(name)
            continue
        value = values.get(name)
        producer = value.producer() if value is not None else None
        if producer is None:
            continue  # an initializer
        todo += [i.name for i in producer.inputs if i is not None]
        for attr in producer.attributes.values():  # an If's branches read outer values
            if attr.type == ir.AttributeType.GRAPH:
                todo += [i.name for n in attr.value for i in n.inputs if i is not None]
    return [v.name for v in model.graph.inputs if v.name in needed]


FED = ("attention_mask", "position_ids", "input_ids", "token_type_ids", "key_padding_mask")  # graph inputs the audit feeds (run_block)


def compute_in_cut(model: Any, block: Any) -> None:
    """The block's lengths (GroupQueryAttention's seqlens_k and total_sequence_length, Attention's mask_index) computed
    in its cut from the graph inputs they come from, as the model computes them from attention_mask, rather than fed:
    a fault in that subgraph is the block's. Fed where they come from something else (the node that also makes the
    hidden state, as BERT's EmbedLayerNormalization; a graph input the audit does not feed)."""
    x = block.inputs["x"]
    for role in ("seqlens_k", "total_sequence_length", "mask_index"):
        name = block.inputs.get(role)
        if name is None:
            continue
        needed = graph_inputs_needed(model, block, [name], within=False)
        if needed and all(n in FED or n.startswith("past") for n in needed) and not made_with(model, name, x):
            block.computed_inputs.append(role)
            del block.inputs[role]


def made_with(model: Any, name: str, other: str) -> bool:
    """Whether a node on the way to `name` also makes `other`."""
    values = {v.name: v for node in model.graph for v in node.outputs}
    seen, todo = set(), [name]
    while todo:
        v = values.get(todo.pop())
        node = v.producer() if v is not None else None
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if any(o.name == other for o in node.outputs):
            return True
        todo += [i.name for i in node.inputs if i is not None]
    return False


def graph_value(model: Any, name: str) -> Any:
    """The graph's value of that name (a graph input or a node's output), or None."""
    for value in model.graph.inputs:
        if value.name == name:
            return value
    return next((v for node in model.graph for v in node.outputs if v.name == name), None)


@dataclasses.dataclass
class AuditGraph:
    """The model under audit as each step reads it: its graph (onnx-ir, external data read as a block reaches it),
    the structure blocks are cut from (onnx's Extractor over the graph without its data, typed once), the folder its
    data lies in, and the shapes its own dims allow."""

    model: Any
    extractor: Any
    base_dir: str
    shapes: Shapes


def cut_extractor(model: Any) -> Any:
    """onnx's Extractor over `model` (a ModelProto, typed), which also follows what a node's subgraphs (an If's
    branches: the auto core's) read from the graph around them: its search walks each node's inputs alone, and the
    cut would lack the nodes and initializers a branch reads."""
    import onnx
    from onnx.utils import Extractor

    class _Extractor(Extractor):
        def __init__(self, model: Any) -> None:
            super().__init__(model)
            self.implicit = {i: outer_names(node) for i, node in enumerate(self.graph.node)
                             if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                    for a in node.attribute)}  # fmt: skip

        def _dfs_search_reachable_nodes(self, node_output_name: str, graph_input_names: set[str],
                                        reachable: set[int]) -> None:  # fmt: skip
            stack = [node_output_name]
            while stack:
                name = stack.pop()
                if name in graph_input_names or name not in self.outmap:
                    continue
                index = self.outmap[name]
                if index not in reachable:
                    reachable.add(index)
                    stack += [i for i in self.graph.node[index].input if i] + sorted(self.implicit.get(index, ()))

        def _collect_reachable_tensors(self, nodes: list[Any]) -> tuple[list[Any], list[Any]]:
            initializer, value_info = super()._collect_reachable_tensors(nodes)
            implicit = set().union(*(self.implicit.get(self.outmap[n.output[0]], ()) for n in nodes if n.output))
            have = {t.name for t in initializer}
            initializer += [self.initializers[t] for t in sorted(implicit - have) if t in self.initializers]
            return initializer, value_info

    return _Extractor(model)


def outer_names(node: Any) -> set[str]:
    """The names a node's subgraphs (at any depth) read from outside them."""
    import onnx

    names: set[str] = set()
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            made = {i.name for i in sub.input} | {t.name for t in sub.initializer}
            made |= {o for n in sub.node for o in n.output}
            for n in sub.node:
                names |= {i for i in n.input if i and i not in made}
                names |= outer_names(n) - made
    return names


def cut_block(graph: AuditGraph, block: Any, outputs: Sequence[str] | None = None, boundary: bool | None = None,
              inputs: Sequence[str] = ()) -> bytes:  # fmt: skip
    """The block as a model of its own: the graph's nodes between its boundary tensors and the graph inputs its
    outputs read (onnx's Extractor over the whole graph, typed once), with only their own tensors' external data
    read (the graph has none); `outputs`: others than the block's own (its mask, read by running it); `inputs`:
    tensors inside it cut at too (its projections' outputs, to run its core alone)."""
    import onnx
    from onnx.external_data_helper import load_external_data_for_model

    model, extractor = graph.model, graph.extractor
    outs = list(outputs) if outputs is not None else [block.outputs[k] for k in ("y", "present_key", "present_value")
                                                        if k in block.outputs]  # fmt: skip
    within = outputs is None if boundary is None else boundary  # at the block's boundary, or from the graph's inputs
    names = [block.inputs[k] for k in BOUNDARY if k in block.inputs] + list(inputs) if within else []
    names += graph_inputs_needed(model, block, outs, within=within)
    int32 = {block.inputs.get(k) for k in ("seqlens_k", "total_sequence_length", "mask_index")} - {None}
    for name in names + outs:  # a value shape inference left untyped (the output of a contrib op): typed by its dtype
        if name not in extractor.value_infos and name not in extractor.initializers:
            value = graph_value(model, name)
            elem = (value.dtype.value if value is not None and value.dtype is not None else
                    onnx.TensorProto.INT32 if name in int32 else onnx.TensorProto.FLOAT)  # fmt: skip
            extractor.value_infos[name] = onnx.helper.make_tensor_value_info(name, elem, None)
    cut = extractor.extract_model(list(dict.fromkeys(names)), outs)
    for value in cut.graph.input:  # a scalar (GroupQueryAttention's schema); shape inference may leave it unranked
        if value.name == block.inputs.get("total_sequence_length"):
            value.type.tensor_type.shape.Clear()
    free_symbolic_dims(cut)
    check_cut_fits(cut, graph.base_dir, f"block {block.index} ({block.node})")  # before its data is read
    load_external_data_for_model(cut, graph.base_dir)
    return cut.SerializeToString()


def free_symbolic_dims(cut: Any) -> None:
    """The cut's named dims made its own, in place: each input's named dim a name of its own (its fixed sizes kept),
    the inner values' and the outputs' shapes left to the runtime's inference. An exporter's names may say two dims are
    one where a step makes them differ (torch.onnx's attention_mask [batch_size, sequence_length], as position_ids,
    where a step's mask also covers the past), and ONNX Runtime plans buffers by those names: one value's buffer
    handed to another of the same named shape, which fails where the sizes differ ("Shape mismatch attempting to
    re-use buffer"). The audit feeds each block at the shapes a step has, not at those the names claim."""
    for value in cut.graph.input:
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.HasField("dim_param"):
                dim.dim_param = f"{value.name}/{axis}"
    for value in list(cut.graph.value_info) + list(cut.graph.output):
        if value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape"):
            value.type.tensor_type.ClearField("shape")


@contextlib.contextmanager
def cut_file(cut: bytes) -> Iterator[str]:
    """A cut (cut_block) written to a file of its own, removed after: what every backend of the runner registry loads
    a model from (ModelSource.model_path; OpenVINO reads ONNX from a file)."""
    with tempfile.TemporaryDirectory(prefix="attnx-audit-") as folder:
        path = os.path.join(folder, "block.onnx")
        with open(path, "wb") as f:
            f.write(cut)
        yield path


# ONNX Runtime's own error lines off: the audit reports each error the runtime raises (its first_line)
QUIET_LOG = 4


def runner_for(backend: str, path: str) -> Runner | str:
    """The model at `path` (a cut block, or the whole model) loaded on `backend` through the runner registry
    (attnx.runtimes.create_runner: a backend means there what it means in parity, its checks included), or why the
    backend is unavailable on this machine (a str: a skip). A backend that is here but cannot read or compile the
    model raises: a finding (the runner's error chains the runtime's own: first_line says that one)."""
    reason = backend_unavailable_reason(backend)
    if reason is not None:
        return reason
    options: dict[str, Any] = {}
    if provider_of_backend(backend) is not None:  # an ONNX Runtime session
        import onnxruntime as ort

        options["session_options"] = ort.SessionOptions()
        options["session_options"].log_severity_level = QUIET_LOG
    return create_runner(backend, ModelSource(model_path=path), **options).load()


class NotFed(Exception):
    """A graph input the block reads that the audit does not know how to feed."""


NP_DTYPES = {"fp32": np.float32, "fp16": np.float16}


def graph_feeds(names: Sequence[str], mask: np.ndarray, past_len: int, cache: np.ndarray | None,
                specs: Sequence[Any] = ()) -> dict[str, np.ndarray]:  # fmt: skip
    """The graph inputs a block's cut reads besides its boundary, as transformers makes them for a batch whose
    attention_mask is `mask` [batch, past_len + tokens] (position_ids counted from each row's first token, ids read
    for their shape, attnx's key_padding_mask True where a key is hidden); `cache`: what a cache input is fed (read
    for its length), None where the block has none to give; `specs`: the runner's inputs (TensorSpec), whose static
    heads and size a cache input of another shape than `cache` is fed at (MLA's two latent parts)."""
    batch, tokens = mask.shape[0], mask.shape[1] - past_len
    positions = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 1)[:, past_len:]
    feeds: dict[str, np.ndarray] = {}
    for name in names:
        if name == "attention_mask":
            feeds[name] = mask
        elif name == "position_ids":
            feeds[name] = positions.astype(np.int64)
        elif name in ("input_ids", "token_type_ids"):  # read for their shape (the hidden state is the block's input)
            feeds[name] = np.zeros((batch, tokens), np.int64)
        elif name == "key_padding_mask":  # attnx's own: True hides a key
            feeds[name] = mask == 0
        elif name.startswith("past") and cache is not None:
            spec = next((s for s in specs if s.name == name and len(s.shape) == 4), None)
            heads, size = (spec.shape[1], spec.shape[3]) if spec is not None else (None, None)
            if isinstance(heads, int) and isinstance(size, int) and cache.ndim == 4:
                feeds[name] = np.zeros((cache.shape[0], heads, cache.shape[2], size), cache.dtype)
            else:
                feeds[name] = np.zeros_like(cache)
        else:
            raise NotFed(f"the block reads graph input {name!r}, which the audit does not feed (it feeds "
                         "attention_mask, position_ids, input_ids and token_type_ids as transformers makes them, and "
                         "attnx's key_padding_mask)")  # fmt: skip
    return feeds


@contextlib.contextmanager
def evaluator(graph: AuditGraph, block: Any, names: Sequence[str]) -> Iterator[Callable[[int], list[np.ndarray]]]:
    """Tensors of the graph that the block's terms are computed from (its mask, its rotary tables), cut out with
    what they read once, and a function that runs them on ONNX Runtime's CPU for one prompt of `tokens` tokens at
    positions 0.. (in each row of a batch the model's dims fix), as often as asked."""
    dtype = NP_DTYPES.get(block.dtype, np.float32)
    batch = graph.shapes.batch if "batch" in graph.shapes.fixed else 1
    with cut_file(cut_block(graph, block, outputs=names)) as path:
        runner = runner_for(PROVIDERS["cpu"].backend, path)
        if isinstance(runner, str):
            raise ProviderUnavailable(runner)
        with runner:
            inputs = [s.name for s in runner.inputs]
            x = block.inputs.get("x")

            def run(tokens: int) -> list[np.ndarray]:
                feeds = {x: np.zeros((batch, tokens, block.config.d_model), dtype)} if x in inputs else {}  # its shape
                empty = np.zeros((batch, block.config.n_kv_heads, 0, block.config.head_dim), dtype)  # no past
                feeds.update(graph_feeds([n for n in inputs if n != x], np.ones((batch, tokens), np.int64), 0, empty,
                                           runner.inputs))  # fmt: skip
                return [np.asarray(a) for a in runner.run(feeds).values()]

            yield run


def evaluate(graph: AuditGraph, block: Any, names: Sequence[str], tokens: int) -> list[np.ndarray]:
    """evaluator's tensors, run once for a prompt of `tokens` tokens."""
    with evaluator(graph, block, names) as run:
        return run(tokens)


def probe_tokens(graph: AuditGraph, wanted: int) -> int:
    """The tokens a computed term is read at: `wanted`, or the sequence the model's dims fix."""
    return graph.shapes.tokens if "sequence" in graph.shapes.fixed else wanted


class _NotOneTable(Exception):
    """q's and k's tables differ, or the tables change with the length otherwise than one switch."""


def _read_rope_tables(graph: AuditGraph, block: Any, original: int) -> None:
    """The rotary tables a block's graph computes from position_ids (RopeReading.tensors), read by running them at
    several prompt lengths (RopeReading.tables_at), and the Rope they are (rope_of_table). With the source's original
    length `original` (a checkpoint's hint; 0: none): read on each side of it. Without: where the tables at 2 tokens
    and at ROPE_PROBE_MAX differ, the length at which they switch is found by bisection (longrope's rule: one table up
    to it, the other past it), and the rope holds both tables and the switch; tables that change more than once (a
    dynamic rope) are not read."""
    positions = probe_tokens(graph, AUDIT_SHAPE["rope_positions"])
    read = block.reading.rope
    names = list(read.tensors) + list(read.k_tensors or ())
    interleaved = read.interleaved
    at: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    try:
        with evaluator(graph, block, names) as run:

            def table(tokens: int) -> tuple[np.ndarray, np.ndarray]:
                if tokens not in at:
                    tables = [a.reshape(-1, a.shape[-1])[:tokens] for a in run(tokens)]
                    at[tokens] = half_table(*tables[:2])
                    if len(tables) == 4 and not all(np.array_equal(a, b) for a, b in zip(half_table(*tables[2:]),
                                                                                         at[tokens])):  # fmt: skip
                        raise _NotOneTable("q and k rotated by different tables")
                return at[tokens]

            # at the probe's length, and on each side of the source's original length, where a rope that switches
            # on the prompt's length (longrope's short and long factors) changes tables
            around = (original, original + 1) if original else ()
            wanted = list(dict.fromkeys(probe_tokens(graph, n) for n in (positions, *around) if n <= ROPE_PROBE_MAX))
            for tokens in wanted:
                table(tokens)
            switch = None
            if not original and "sequence" not in graph.shapes.fixed:
                switch = _rope_switch(table, positions)
    except NotFed as e:
        block.unread = Unread(f"its rotary tables not read: {e}", term="rope")
        return
    except _NotOneTable as e:
        block.unread = Unread(str(e))
        return
    cos, sin = at[positions]
    if switch is None:
        rope, fit = rope_of_table(cos, sin, interleaved)
        at = {n: at[n] for n in wanted}  # the lengths the source's rope is held to (the bisection's probes are not)
    else:
        rope, fit = _switching_rope(at, switch, interleaved)
        at = {n: at[n] for n in dict.fromkeys((positions, switch, switch + 1))}
    block.reading.rope = dataclasses.replace(read, tables=(cos, sin), tables_at=at, fit=fit)
    block.config = dataclasses.replace(block.config, rope=rope)
    if rope is None:
        block.unread = Unread(f"rope {fit.unread}", UnreadKind.UNFIT_TABLE, "rope")


def _rope_switch(table: Callable[[int], tuple[np.ndarray, np.ndarray]], positions: int) -> int | None:
    """The prompt length past which the graph's tables switch (None: one table for every length): position 1's row
    at 2 tokens against ROPE_PROBE_MAX's, then bisected between them."""

    def row(tokens: int) -> np.ndarray:
        cos, sin = table(tokens)
        return np.concatenate([cos[1], sin[1]])

    short = row(2)
    try:
        longest = ROPE_PROBE_MAX
        long = row(longest)
    except Exception:  # noqa: BLE001 - a table of fewer rows (a constant one, gathered): read up to the probe
        longest, long = positions, row(positions)
    if np.array_equal(short, long):
        if not np.array_equal(row(positions), short):
            raise _NotOneTable("its rotary tables change with the prompt's length more than once (a dynamic rope): "
                               "not read")  # fmt: skip
        return None
    low, high = 2, longest  # row(low) is the short table's, row(high) the long one's
    while high - low > 1:
        mid = (low + high) // 2
        found = row(mid)
        if np.array_equal(found, short):
            low = mid
        elif np.array_equal(found, long):
            high = mid
        else:
            raise _NotOneTable("its rotary tables change with the prompt's length more than once (a dynamic rope): "
                               "not read")  # fmt: skip
    table(low + 1)
    return low


def _switching_rope(at: dict[int, tuple[np.ndarray, np.ndarray]], switch: int,
                    interleaved: bool) -> tuple[Any, RopeFit]:  # fmt: skip
    """The rope of two tables the graph switches between past `switch` tokens (longrope's rule): each read as the
    table it is (rope_of_table), held as the graph's own tables with the switch; None (and why: RopeFit.unread) where
    either is not read or their attention factors differ. The fit is the short table's."""
    short_rope, fit = rope_of_table(*at[switch], interleaved)
    long_rope, long_fit = rope_of_table(*at[max(at)], interleaved)
    if short_rope is None or long_rope is None:
        return None, dataclasses.replace(fit, unread=(fit if short_rope is None else long_fit).unread)
    (short, factor), (long, long_factor) = rope_frequencies(short_rope), rope_frequencies(long_rope)
    if abs(factor - long_factor) > 1e-6 * abs(factor):
        return None, dataclasses.replace(fit, unread=f"not read: its tables switch past {switch} tokens with attention "
                                                     f"factors {factor:.6g} and {long_factor:.6g} (one factor for "
                                                     "both is read)")  # fmt: skip
    scaling = RopeScaling("table", (("attention_factor", factor), ("inv_freq", tuple(map(float, short))),
                                    ("long_inv_freq", tuple(map(float, long))),
                                    ("original_max_position_embeddings", switch)))  # fmt: skip
    rope = Rope(short_rope.theta, short_rope.dim, interleaved, scaling)
    said = f"{rope_said(rope)}: {fit.matches} up to {switch} tokens, {long_fit.matches} past it"
    return rope, dataclasses.replace(fit, matches=said, switch=switch)


def read_computed_terms(graph: AuditGraph, block: Any, reach: int = 0, rope_original: int = 0) -> None:
    """The terms of a block that the graph computes rather than states, read by running what computes them into its
    Reading: its rotary tables (from position_ids), its mask's (causal, a window), each computed term's values (a
    temperature). reach, rope_original: how far the source says its terms reach (a window, a chunk; 0: not said) and
    its rope's original length (where a scaled rope switches tables; 0: none), from a checkpoint's layers."""
    if block.reading.rope.tensors is not None:
        _read_rope_tables(graph, block, rope_original)
    if block.mask is not None:
        try:
            block.config = read_mask_terms(graph, block, reach)
        except NotFed as e:
            block.unread = Unread(f"its mask {block.mask} not read: {e}")
    for name, term in block.reading.computed.items():  # each term's values per token (a temperature)
        tensor = term.tensor
        tokens = probe_tokens(graph, max(AUDIT_SHAPE["rope_positions"], min(reach, ROPE_PROBE_MAX)))
        try:
            (values,) = evaluate(graph, block, [tensor], tokens)
        except NotFed as e:
            block.unread = Unread(f"its {name} ({tensor}) not read: {e}", term=name)
            continue
        # [.., tokens, ..]: the first axis of the prompt's length, the first entry of every other
        axis = next((i for i, n in enumerate(values.shape) if n == tokens), None)
        if axis is None:
            block.unread = Unread(f"its {name} ({tensor}) is {list(values.shape)}: no axis of the prompt's {tokens} "
                                  "tokens", term=name)  # fmt: skip
            continue
        value, said = GRAPH_TERMS[name].fit_values(np.moveaxis(values, axis, 0).reshape(tokens, -1)[:, 0])
        term.said = said
        if value is None:
            block.unread = Unread(f"its {name} ({tensor}) not read: {said}", term=name)
            continue
        block.config = dataclasses.replace(block.config, **{TERMS[name].keys[0]: value})


def read_mask_terms(graph: AuditGraph, block: Any, reach: int = 0) -> AttentionConfig:
    """The block's config with the mask terms of the mask the graph computes for its core (each term's fit_grid:
    causal, a window), run for a full prompt past any mask's reach (the source's `reach`, the graph's window); how
    the mask was read into the block's Reading.mask."""
    # past the farthest reach the graph or the source states (a window wider than the prompt reads as none): GQA's
    # local_window_size, the checkpoint's sliding_window
    window = block.reading.mask.local_window_size
    hint = max(window if window is not None else -1, reach)
    tokens = probe_tokens(graph, max(AUDIT_SHAPE["tokens"], min(hint + 2, MASK_PROBE_MAX)))
    masks = block.masks or [(block.mask, "the core's input")]  # float: added; boolean or integer: keeps where true
    allowed = np.ones((tokens, tokens), bool)
    for (name, how), mask in zip(masks, evaluate(graph, block, [m for m, _ in masks], tokens)):
        # a float mask is added to the scores (a large negative hides); a boolean one keeps where True (ONNX's
        # Attention, a Where(keep, scores, lowest)) or hides where True (a Where(hide, lowest, scores))
        kept = mask > MASKED if mask.dtype.kind == "f" else mask.astype(bool) ^ (how == "where-masked")
        while kept.ndim > 2:  # [batch, heads, queries, keys]: the first row's first head
            kept = kept[0]
        rows = block.rows_per_token  # the grouped core: a row per query head of a group
        if kept.ndim == 2 and rows > 1 and kept.shape[0] == rows * tokens:
            kept = kept[::rows]  # row s*G + j is token s
        if kept.ndim == 1 or kept.shape[0] == 1:  # a mask of the keys alone ([batch, keys], [.., 1, keys])
            kept = np.broadcast_to(kept.reshape(1, -1), (tokens, kept.shape[-1]))
        if kept.shape != (tokens, tokens):
            raise NotFed(f"{name} is {list(mask.shape)}, not a [{tokens}, {tokens}] grid of a prompt")
        allowed &= kept
    if block.config.causal:  # the op hides later keys itself (GroupQueryAttention's causal): its mask input need not
        allowed &= np.tri(tokens, dtype=bool)
    try:  # with what the op itself states (GroupQueryAttention's causal and local_window_size, Attention's is_causal)
        config, said = read_mask_grid(allowed, block.config)
    except ValueError as e:
        raise NotFed(str(e)) from None
    block.reading.mask = dataclasses.replace(block.reading.mask, mask=said)
    return config
