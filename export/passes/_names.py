"""NameStages: one naming scheme for every graph attnx writes, after the formula's terms (docs/reference/onnx-graph.md, "Names").

    stage tensors   named exactly the stage (attnx.model.stages: q, k, v, q_norm, ..., z, y, present_key)
                    where the graph holds the stage's value; metadata STAGES_KEY = {stage: layout}
    weights         their safetensors names; stored transposed for MatMul ([in, out]): `<name>.T`
                    (q_proj.weight.T, the packed qkv_proj.weight.T, qkv_proj.bias)
    constants       what they are (scale, softcap, the sink logits, mask_fill) or `<stage>/<Op>.<input>`: the stage
                    they lead to, the operator and the operator's own name for that input (q/Reshape.shape)
    nodes           `<stage>/<Op>` for the node producing a stage, `<role>_proj/<Op>` for a projection's
                    MatMul, else `<next stage downstream>/<Op>`, a counter after the first (scores/Mul_2)
    intermediates   `<next stage downstream>/<op>`, unique the same way (scores/matmul)

Graph inputs and outputs keep their contract names. The hand-built graphs (attnx.export._step) name
their stages, weights and constants as they build them and call name_graph() for the rest; the
torch exporter's graphs and what the graph passes make of them are named by NameStages, which finds
the stages from the graph's structure (the projections as QuantizeProjections finds them, the core
from its Softmax, MatMul or fused operator). A stage whose value the graph does not hold (inside a
fused operator, a projection whose bias is folded into MultiHeadAttention) is not named; a
structure NameStages does not recognise gets fewer names, never a wrong one. Renaming only: no
node is added or changed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

import onnx
import onnx_ir as ir

from attnx.export.passes._base import AttnxPass, const_array, fresh_name
from attnx.export.passes.walk import score_chain, strip_layout
from attnx.model.config import AttentionConfig
from attnx.model.contract import CONFIG_KEY, MS_DOMAIN
from attnx.model.stages import STAGES, STAGES_KEY, stage_layouts, stages_of
from attnx.model.weights import weight_shapes

__all__ = ["NameStages", "name_graph", "find_stages", "fresh_name", "stages_json"]

logger = logging.getLogger(__name__)

_STD = ("", "ai.onnx")
_ORDER = {s.name: i for i, s in enumerate(STAGES)}
_PROJECTIONS = ("q", "k", "v", "qkv", "out")


def _is(node: ir.Node | None, op_type: str, domain: tuple[str, ...] = _STD) -> bool:
    return node is not None and node.op_type == op_type and node.domain in domain


def _users(value: ir.Value) -> list[ir.Node]:
    return [use.node if hasattr(use, "node") else use[0] for use in value.uses()]


def _input_label(node: ir.Node, index: int, opset: int) -> str:
    """The operator's own name for input `index` (Reshape's 1 is "shape"), else in<index>."""
    if node.domain in _STD:
        try:
            schema = onnx.defs.get_schema(node.op_type, opset, "")
            if index < len(schema.inputs):
                return schema.inputs[index].name
        except Exception:  # noqa: BLE001 - an op the installed onnx does not know: its index will do
            pass
    return f"in{index}"


def name_graph(
    model: ir.Model,
    stages: Mapping[str, tuple[ir.Value, str]],
    projections: Mapping[ir.Node, str] | None = None,
    names: Mapping[ir.Value, str] | None = None,
) -> None:
    """Name every node, intermediate value and unnamed constant of `model` after the stage it leads
    to, the stage values `stages` ({stage: (value, layout)}) after their stage, the constants in
    `names` as given; record {stage: layout} in the metadata (STAGES_KEY)."""
    graph = model.graph
    projections = dict(projections or {})
    names = dict(names or {})
    io = {v for v in [*graph.inputs, *graph.outputs]}
    stage_of = {value: stage for stage, (value, _) in stages.items()}
    nodes = list(graph)
    # A node in a subgraph (an If's branch) reads a value for the main-graph node that holds it.
    holder = {inner: node for node in nodes for attr in node.attributes.values() if attr.type == ir.AttributeType.GRAPH
              for inner in ir.traversal.RecursiveGraphIterator(attr.value)}  # fmt: skip
    # The stage each node leads to: its own output's, else its nearest consumer's (fewest nodes
    # between), ties in the formula's order.
    lead: dict[ir.Node, tuple[int, int, str]] = {}
    for node in reversed(nodes):
        own = [stage_of[o] for o in node.outputs if o in stage_of]
        if own:
            lead[node] = (0, _ORDER[own[0]], own[0])
            continue
        best = None
        for out in node.outputs:
            for user in (holder.get(u, u) for u in _users(out)):
                if user in lead:
                    d, o, s = lead[user]
                    best = min(best, (d + 1, o, s)) if best is not None else (d + 1, o, s)
        lead[node] = best if best is not None else (0, _ORDER["y"], "y")

    taken: set[str] = {v.name for v in io if v.name}
    taken |= set(stages) | set(names.values())

    value_names: dict[ir.Value, str] = {}
    for stage, (value, _) in stages.items():
        if value not in io:
            value_names[value] = stage
    value_names.update(names)
    opset = model.opset_imports.get("", 18)
    # Constants (initializers and Constant nodes' outputs): after their first user.
    for node in nodes:
        for index, value in enumerate(node.inputs):
            if value is None or value in value_names or value in io:
                continue
            producer = value.producer()
            if value.const_value is None and not _is(producer, "Constant"):
                continue
            label = _input_label(node, index, opset)
            value_names[value] = fresh_name(f"{lead[node][2]}/{node.op_type}.{label}", taken)
    for value in graph.initializers.values():  # an initializer nothing reads
        if value not in value_names and value not in io:
            value_names[value] = fresh_name(f"unused/{value.name or 'initializer'}", taken)
    node_names: set[str] = set()
    for node in nodes:
        stage = lead[node][2]
        prefix = f"{projections[node]}_proj" if node in projections else stage
        node.name = fresh_name(f"{prefix}/{node.op_type}", node_names)
        for out in node.outputs:
            if out not in value_names and out not in io:
                value_names[out] = fresh_name(f"{stage}/{node.op_type.lower()}", taken)
    # Two steps, so that no new name meets an old one still in use.
    renamed = [v for v in value_names if v.name != value_names[v]]
    for i, value in enumerate(renamed):
        value.name = f"__attnx_renaming_{i}"
    for value in renamed:
        value.name = value_names[value]
    layouts = {stage: layout for stage, (_, layout) in stages.items()}
    model.metadata_props[STAGES_KEY] = stages_json(layouts, [out.name for out in graph.outputs])


def _layout_heads(value: ir.Value, heads: int) -> bool:
    """value is 4-D with `heads` on axis 1 (as far as its shape is known)."""
    shape = value.shape
    if shape is None:
        return True
    return len(shape) == 4 and (not isinstance(shape[1], int) or shape[1] == heads)


def _ancestors_reach(value: ir.Value, name: str) -> bool:
    """Whether graph input `name` is among what `value` is computed from."""
    seen, pending = set(), [value]
    while pending:
        v = pending.pop()
        if v.name == name and v.is_graph_input():
            return True
        node = v.producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        pending += [i for i in node.inputs if i is not None]
    return False


def stages_json(layouts: dict[str, str], outputs: list[str]) -> str:
    """STAGES_KEY's value: {stage: layout} in the formula's order, the graph's outputs that are stages
    (y, a step model's cache) by their contract names."""
    layouts = dict(layouts)
    for out in outputs:
        if out in _ORDER and out not in layouts:
            layouts[out] = next(s.layout for s in STAGES if s.name == out)
    return json.dumps(dict(sorted(layouts.items(), key=lambda kv: _ORDER[kv[0]])), separators=(", ", ": "))


_CACHE_ROLES = {"present_key": "k", "present_value": "v"}  # a step model's cache outputs


def _matmul_of(value: ir.Value | None) -> ir.Node | None:
    """The projection MatMul behind a core input: through head-split layout ops and a bias Add."""
    if value is None:
        return None
    value = strip_layout(value)
    node = value.producer()
    if node is not None and node.op_type == "Add" and node.domain in _STD:
        for operand in node.inputs:
            inner = operand.producer() if operand is not None else None
            if inner is not None and inner.op_type == "MatMul":
                return inner
    if node is not None and node.op_type == "Split":
        return _matmul_of(node.inputs[0])
    return node if node is not None and node.op_type == "MatMul" else None


def _projection_behind(value: ir.Value) -> tuple[ir.Node, bool] | None:
    """(the one projection MatMul a core input is computed from, whether a Split lies between) by a
    walk back through every producer (layout, bias, q/k norms, rotation: RotaryEmbedding or its
    arithmetic, whose cos/sin come from position_ids and reach no projection), stopping at each
    MatMul with a constant 2-D weight; None unless exactly one is found."""
    found: dict[int, ir.Node] = {}
    split, seen, pending = False, set(), [value]
    while pending:
        node = pending.pop().producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type == "MatMul" and node.domain in _STD:
            w = const_array(node.inputs[1])
            if w is not None and w.ndim == 2:
                found[id(node)] = node
                continue
        split |= node.op_type == "Split"
        pending += [i for i in node.inputs if i is not None and const_array(i) is None]
    return (next(iter(found.values())), split) if len(found) == 1 else None


def _roles(model: ir.Model) -> dict[int, str]:
    """{id(MatMul node): "q" | "k" | "v" | "qkv"} for the projections feeding the core; the rest
    (the output projection) are "out"."""
    roles: dict[int, str] = {}

    def mark(value: ir.Value | None, role: str) -> None:
        node = _matmul_of(value)
        if node is not None:
            roles[id(node)] = "qkv" if strip_layout(value).producer().op_type == "Split" else role
        elif value is not None and (behind := _projection_behind(value)) is not None:
            # a modern-LLM graph: q and k reach the core through their norms and rotation
            roles[id(behind[0])] = "qkv" if behind[1] else role

    for node in ir.traversal.RecursiveGraphIterator(model.graph):  # an If's branches too (the buffer form's auto core)
        if node.op_type == "MultiHeadAttention" and node.domain == MS_DOMAIN or node.op_type == "Attention":
            for value, role in zip(node.inputs[:3], ("q", "k", "v")):
                mark(value, role)
        elif node.op_type == "GroupQueryAttention" and node.domain == MS_DOMAIN:
            # the step model's ort-fused grouped form; the buffer form packs q/k/v into its query input
            if len(node.inputs) > 1 and node.inputs[1] is not None:
                for value, role in zip(node.inputs[:3], ("q", "k", "v")):
                    mark(value, role)
            elif (qkv := _matmul_of(node.inputs[0])) is not None:
                roles[id(qkv)] = "qkv"
        elif node.op_type == "Concat" and node.domain in _STD and node.outputs[0].name in _CACHE_ROLES:
            # the decomposed step model: present = Concat(past, the new tokens' heads)
            mark(node.inputs[-1], _CACHE_ROLES[node.outputs[0].name])
        elif node.op_type == "Softmax" and node.domain in _STD:
            chain = score_chain(node)  # back to q.k through the masks, scalings and a sink; on to p.v
            if chain.qk is not None:
                mark(chain.qk.inputs[0], "q")
                mark(chain.qk.inputs[1], "k")
            if chain.pv is not None:
                mark(chain.pv.inputs[1], "v")
    return roles


def find_stages(model: ir.Model, config: AttentionConfig) -> tuple[dict[str, tuple[ir.Value, str]], dict[ir.Node, str],
                                                                   dict[ir.Value, str]]:  # fmt: skip
    """({stage: (value, layout)}, {projection MatMul: role}, {constant: name}) of a torch-exported
    graph, or of what the graph passes made of it (float32 or float16)."""
    c = config
    graph = model.graph
    stages: dict[str, tuple[ir.Value, str]] = {}
    projections: dict[ir.Node, str] = {}
    names: dict[ir.Value, str] = {}
    roles = _roles(model)
    folded = any(
        (_is(n, "MultiHeadAttention", (MS_DOMAIN,)) and len(n.inputs) > 3 and n.inputs[3] is not None) for n in graph
    )

    def stage(name: str, value: ir.Value, layout: str = "b t (h d)") -> None:
        if name not in stages and not value.is_graph_input():
            stages[name] = (value, layout)

    matmuls = [n for n in graph if _is(n, "MatMul") and (w := const_array(n.inputs[1])) is not None and w.ndim == 2]
    found = [roles.get(id(n), "out") for n in matmuls]
    unique = {r for r in found if found.count(r) == 1}  # a role found twice: neither is named
    for node in graph:
        if node in matmuls:
            role = roles.get(id(node), "out")
            if role not in unique:
                continue
            projections[node] = role
            names[node.inputs[1]] = f"{role}_proj.weight.T"
            out = node.outputs[0]
            users = _users(out)
            if len(users) == 1 and _is(users[0], "Add"):
                add = users[0]
                bias = next((i for i in add.inputs if i is not out and i is not None), None)
                b = const_array(bias) if bias is not None else None
                if b is not None and b.ndim == 1:
                    names[bias] = f"{role}_proj.bias"
                    out = add.outputs[0]
            if role == "out":
                stage("z", node.inputs[0])
            elif role in ("q", "k", "v") and not folded:
                stage(role, out)
            elif role == "qkv" and not folded:
                split = _users(out)
                if len(split) == 1 and _is(split[0], "Split") and len(split[0].outputs) == 3:
                    for r, v in zip("qkv", split[0].outputs):
                        stage(r, v)
        elif _is(node, "MultiHeadAttention", (MS_DOMAIN,)) and len(node.inputs) > 3 and node.inputs[3] is not None:
            names[node.inputs[3]] = "qkv_proj.bias"  # the q, k and v biases, folded into the op
        elif _is(node, "Attention", (MS_DOMAIN,)):
            names[node.inputs[1]] = "qkv_proj.weight.T"
            if len(node.inputs) > 2 and node.inputs[2] is not None:
                names[node.inputs[2]] = "qkv_proj.bias"
    held = {s.name for s in stages_of(c)}
    if {"q_norm", "q_rope"} <= held:  # a norm's output before the rotation, held per head [B, T, heads, hd]
        for label, heads in (("q", c.n_heads), ("k", c.n_kv_heads)):
            weight = f"{label}_norm.weight"
            muls = [n for n in graph if _is(n, "Mul") and any(i is not None and i.name == weight for i in n.inputs)]
            shape = muls[0].outputs[0].shape if len(muls) == 1 else None
            if shape is not None and len(shape) == 4 and list(shape[2:]) == [heads, c.head_dim]:
                stage(f"{label}_norm", muls[0].outputs[0], "b t h d")
    softmaxes = [n for n in graph if _is(n, "Softmax")]
    if len(softmaxes) == 1:
        _core_stages(softmaxes[0], c, stage, names)
    # the weights the exporter already names after the module's parameters (q_norm.weight, ...) keep them
    for name, value in graph.initializers.items():
        if name in weight_shapes(c) and value not in names:
            names[value] = name
    return stages, projections, {v: n for v, n in names.items() if v.const_value is not None or
                                 _is(v.producer(), "Constant")}  # fmt: skip


def _core_stages(softmax: ir.Node, c: AttentionConfig, stage, names: dict[ir.Value, str]) -> None:
    """scores, probs and the per-head q/k after their norm or rotation, from the decomposed core as the one walker
    reads it (score_chain): the torch module records scores where its mask's Where takes them (scale * q.k and the
    score terms after it: a softcap's Div, Tanh and Mul, a bias added to the scores), probs where the MatMul with v
    reads them. Any other step between q.k and the Softmax, and nothing is named."""
    chain = score_chain(softmax)
    qk = chain.qk
    if qk is None or any(const_array(i) is not None for i in qk.inputs):
        return
    # probs: the softmax, or (a sink's column joined before it) the Slice that drops the column; read by p.v alone
    probs = softmax.outputs[0]
    if chain.sink is not None:
        users = _users(probs)
        if not (len(users) == 1 and _is(users[0], "Slice")):
            return
        probs = users[0].outputs[0]
    if chain.pv is None or chain.probs is not probs or len(_users(probs)) != 1:
        return
    steps = list(chain.steps)  # from the Softmax back to q.k
    # scores: the softmax's input, before the sink's column joins and before the mask's Where; the column's logits
    # are named as the weight they are (the sink's)
    if chain.sink is not None:
        if steps[0] is not chain.sink:
            return
        expand = chain.sink.inputs[1].producer()
        if _is(expand, "Expand") and const_array(expand.inputs[0]) is not None:
            names[expand.inputs[0]] = "sinks"
        steps = steps[1:]
    if steps and _is(steps[0], "Where"):
        if const_array(steps[0].inputs[1]) is None:
            return  # a mask NameStages does not know (not the module's masked_fill)
        names[steps[0].inputs[1]] = "mask_fill"
        steps = steps[1:]
    scores = steps[0].outputs[0] if steps else qk.outputs[0]
    # back from scores to q.k: the scale's Mul, the softcap's Mul, Tanh and Div, a bias added (ALiBi's)
    additive = {id(node) for node, _, how in chain.masks if how == "additive"}
    consts = []
    for node in steps:
        if node.op_type in ("Mul", "Div"):
            const = next((i for i in node.inputs if i is not None and const_array(i) is not None), None)
            if const is None:
                return
            consts.append((node.op_type, const))
        elif node.op_type != "Tanh" and id(node) not in additive:
            return
    expected = (["Mul", "Div"] if c.softcap is not None else []) + ["Mul"]  # from the scores back: cap * tanh(s / cap)
    if [op for op, _ in consts] != expected or not _layout_heads(scores, c.n_heads):
        return
    stage("scores", scores, "b h t s")
    stage("probs", probs, "b h t s")
    # A constant is named for its term only when that term alone reads it (the exporter shares equal
    # constants: a softcap of 2 is also the norm's exponent).
    if c.softcap is not None and consts[0][1] is consts[1][1] and len(_users(consts[0][1])) == 2:
        names[consts[0][1]] = "softcap"
    if len(_users(consts[-1][1])) == 1:
        names[consts[-1][1]] = "scale"
    # q and k per head [B, heads, T, d] as scored: after the rotation (q_rope) or the norm (q_norm)
    held = {s.name for s in stages_of(c)}
    rotated_stage = "q_rope" in held  # else the norm's stage
    if not rotated_stage and "q_norm" not in held:
        return
    stage_name = "rope" if rotated_stage else "norm"
    for label, operand, heads in (("q", qk.inputs[0], c.n_heads), ("k", qk.inputs[1], c.n_kv_heads)):
        value = operand
        while (p := value.producer()) is not None and p.domain in _STD and p.op_type in (
            "Transpose", "Reshape", "Expand", "Unsqueeze"
        ):  # fmt: skip
            perm = p.attributes.get_ints("perm", None) if p.op_type == "Transpose" else None
            if perm is not None and list(perm) == [0, 2, 1, 3] and _layout_heads(value, heads):
                rotated = _ancestors_reach(value, "position_ids")
                normed = _is(p.inputs[0].producer(), "Mul")  # times the norm's weight
                if rotated if rotated_stage else not rotated and normed:
                    stage(f"{label}_{stage_name}", value, "b h t d")
                break
            value = p.inputs[0]


class NameStages(AttnxPass):
    """Name a torch-exported graph (or what the graph passes made of it) after the formula's terms:
    the module docstring's scheme, the stages found from the graph's structure. Runs last in every
    pipeline that writes a float model (the quantization pass after it keeps the names)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        text = model.metadata_props.get(CONFIG_KEY)
        if not text:
            self.notes.append("not named: the model has no attnx config in its metadata")
            return ir.passes.PassResult(model, False)
        config = AttentionConfig.from_json(text)
        stages, projections, names = find_stages(model, config)
        name_graph(model, stages, projections, names)
        held = ", ".join(stage_layouts(model.metadata_props))
        self.notes.append(f"stages named: {held}")
        return ir.passes.PassResult(model, True)
