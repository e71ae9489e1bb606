"""The buffer form of a whole model whose caches attnx's GroupQueryAttention cores read (attnx optimize's growing form):
every cache one buffer [batch, kv_heads, max_sequence_length, head_dim] that the core writes in place, bound as both
its past input and its present output, and each row its own length.

    growing form (attnx optimize)                      buffer form (this pass)
    past_key_values.N.* [B, Hkv, past, hd] in          the same names, [B, Hkv, max_sequence_length, hd]: the buffer
    present.N.* = past + new, a new tensor             present.N.*: the same buffer, the new keys written in place
    attention_mask [B, total]: left padding            none: row b's keys are its first seqlens_k[b] + 1 positions
    seqlens_k, total from the cache's length           seqlens_k int32 [B] (positions filled after the call, minus 1)
                                                       and total_sequence_length int32 [] (their largest), as inputs
    position_ids [B, S]                                the same (token i of a row is at position i: no padding)

GroupQueryAttention reads and writes each row's own positions (seqlens_k: its CPU kernel computes a row over its own
keys alone), so rows of any lengths share a call without padding, and a row's tokens cannot depend on its batch-mates.
A core that rotates q and k itself (do_rotary: the GenAI builder's) takes its positions from those lengths, which
here are each row's token indices; the rows of its cos/sin caches are recorded (metadata attnx.rope_positions).
A call of several tokens (a prompt) is one row's, starting at position 0 (the op's rule: sequence_length >
1 only where it equals total_sequence_length, or with batch 1).

What the pass rewrites, per core: its seqlens_k and total_sequence_length inputs (the graph's, in place of what the
growing form computed from the cache's length), its attention_bias dropped where it was the padding's alone, the
zeroing of fully padded rows after it dropped (no row is padded). What does not fit raises NotBufferable, saying
why: a cache read by anything else, a core attnx did not write, an attention_bias holding
more than the padding (found before anything is changed), attention_mask still read elsewhere (found once the cores
are rewritten: run the pass on a model loaded for it).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from attnx.export.passes._base import AttnxPass, const_array
from attnx.export.passes.walk import is_op
from attnx.model.contract import DECODE_KEY, MS_DOMAIN, ROPE_POSITIONS_KEY
from attnx.model.rope import rope_table

__all__ = ["BufferForm", "NotBufferable", "PackedQkv", "RotateInCore", "CAPACITY_DIM", "MASK", "SEQLENS", "TOTAL"]

SEQLENS, TOTAL, MASK = "seqlens_k", "total_sequence_length", "attention_mask"
CAPACITY_DIM = "max_sequence_length"
CACHE_IN, CACHE_OUT = "past_key_values", "present"
_MS = (MS_DOMAIN,)
_ATTNX = "attnx/"  # the prefix of every node attnx optimize spliced in


class NotBufferable(Exception):
    """A whole model the buffer form cannot be written for; the message says why."""


def _padding_bias(bias: ir.Value) -> bool:
    """Whether an attention_bias is the padding's alone, as attnx's growing GroupQueryAttention writes it:
    Expand(Where(Unsqueeze(key_padding_mask), lowest, 0), [B, 1, S, T]), the mask computed from attention_mask."""
    expand = bias.producer()
    where = expand.inputs[0].producer() if is_op(expand, "Expand") else None
    unsqueeze = where.inputs[0].producer() if is_op(where, "Where") else None
    if not is_op(unsqueeze, "Unsqueeze") or const_array(where.inputs[2]) is None:
        return False
    equal = unsqueeze.inputs[0].producer()
    return is_op(equal, "Equal") and any(v is not None and v.name == MASK and v.is_graph_input() for v in equal.inputs)


def _zeroing(z: ir.Value) -> ir.Node | None:
    """The Where that sets fully padded rows of the core's output to 0 (Where(visible, z, 0)), when it is z's one
    consumer."""
    uses = list(z.uses())
    if len(uses) != 1:
        return None
    node = uses[0].node
    zero = const_array(node.inputs[2]) if is_op(node, "Where") and len(node.inputs) == 3 else None
    return node if zero is not None and zero.size == 1 and float(zero) == 0.0 and node.inputs[1] is z else None


class BufferForm(AttnxPass):
    """The module doc, in place; raises NotBufferable where it does not apply."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from onnx_ir.passes.common import RemoveUnusedNodesPass

        g = model.graph
        inputs = {v.name: v for v in g.inputs}
        outputs = {v.name: v for v in g.outputs}
        caches = [v for v in g.inputs if v.name.startswith(CACHE_IN)]
        if not caches:
            raise NotBufferable("the model takes no cache (past_key_values.*)")
        if SEQLENS in inputs or TOTAL in inputs:
            raise NotBufferable(f"the model already takes {SEQLENS} / {TOTAL}")
        cores: dict[int, ir.Node] = {}
        for past in caches:
            # the growing form also reads the cache's length (Shape nodes, dead once the core takes the graph's lengths)
            readers = [use.node for use in past.uses() if not is_op(use.node, "Shape")]
            core = readers[0] if len(readers) == 1 else None
            if core is None or not is_op(core, "GroupQueryAttention", _MS) or not (core.name or "").startswith(_ATTNX):
                said = ", ".join(f"{n.op_type} {n.name}" for n in readers) or "nothing"
                raise NotBufferable(f"the cache input {past.name} is read by {said}, not by one GroupQueryAttention "
                                    "attnx wrote")  # fmt: skip
            cores[id(core)] = core
        plans = []
        rows = None  # the rows of the cos/sin caches the cores that rotate themselves read
        for core in cores.values():
            ins = list(core.inputs) + [None] * (11 - len(core.inputs))
            if core.attributes.get_int("do_rotary", 0):  # its positions are its lengths: a row's token indices here
                table = const_array(ins[7]) if ins[7] is not None else None
                if table is not None:
                    rows = min(rows, int(table.shape[0])) if rows is not None else int(table.shape[0])
            present = [v.name for v in core.outputs[1:3]]
            if [p.name[len(CACHE_IN):] for p in ins[3:5]] != [n[len(CACHE_OUT):] for n in present] \
                    or not all(n in outputs for n in present):  # fmt: skip
                raise NotBufferable(f"{core.name} does not write its past into the present of the same name")
            bias = ins[10]
            if bias is not None and not _padding_bias(bias):
                raise NotBufferable(f"{core.name}'s attention_bias holds more than the padding (made by "
                                    f"{bias.producer().op_type if bias.producer() else 'a graph input'})")  # fmt: skip
            plans.append((core, _zeroing(core.outputs[0])))
        seqlens = ir.Value(name=SEQLENS, type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([caches[0].shape[0]]))
        total = ir.Value(name=TOTAL, type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([]))
        for core, zeroing in plans:
            core.replace_input_with(5, seqlens)
            core.replace_input_with(6, total)
            if len(core.inputs) > 10:
                core.resize_inputs(10)  # the padding's bias: no row is padded
            while core.inputs and core.inputs[-1] is None:
                core.resize_inputs(len(core.inputs) - 1)
            if zeroing is not None:
                zeroing.outputs[0].replace_all_uses_with(core.outputs[0])
            self.notes.append(f"{core.name}: the cache written in place, each row its own length"
                              + (", the padding's bias and zeroing dropped" if zeroing is not None else ""))  # fmt: skip
        for past in caches:  # the buffer: the same dims in and out
            shape = list(past.shape)
            shape[2] = CAPACITY_DIM
            past.shape = ir.Shape(shape)
            out = outputs[CACHE_OUT + past.name[len(CACHE_IN):]]
            out.shape = ir.Shape(shape)
        g.inputs.extend([seqlens, total])
        RemoveUnusedNodesPass()(model)
        for past in caches:
            left = [f"{use.node.op_type} {use.node.name}" for use in past.uses() if use.node.op_type != "GroupQueryAttention"]
            if left:
                raise NotBufferable(f"the cache input {past.name}'s length is still read by {', '.join(left)}")
        mask = inputs.get(MASK)
        if mask is not None:
            readers = [use.node for use in mask.uses()]
            if readers:
                raise NotBufferable(f"{MASK} is still read by {', '.join(f'{n.op_type} {n.name}' for n in readers)}: "
                                    "the buffer form takes no padding mask")  # fmt: skip
            g.inputs.remove(mask)
        model.metadata_props[DECODE_KEY] = "buffer"
        if rows is not None:  # a run past the table is refused before its first call (generate's _SharedCache)
            model.metadata_props[ROPE_POSITIONS_KEY] = str(rows)
        return ir.passes.PassResult(model, modified=True)


def _rope_of(rotary: ir.Node) -> tuple[np.ndarray, float] | None:
    """(inv_freq, attention_factor) of a com.microsoft.RotaryEmbedding as attnx writes it (attnx.export._llm: its cos
    input Reshape(Mul(Cos(Mul(positions, inv_freq)), factor))), both constants; None for anything else (a longrope's
    switch, a table the graph reads)."""
    cos = rotary.inputs[2] if len(rotary.inputs) > 2 else None
    reshape = cos.producer() if cos is not None else None
    scaled = reshape.inputs[0].producer() if is_op(reshape, "Reshape") else None
    if not is_op(scaled, "Mul"):
        return None
    cosine = next((v.producer() for v in scaled.inputs if is_op(v.producer(), "Cos")), None)
    factor = next((const_array(v) for v in scaled.inputs if const_array(v) is not None), None)
    angle = cosine.inputs[0].producer() if cosine is not None else None
    inv_freq = next((const_array(v) for v in angle.inputs if const_array(v) is not None), None) \
        if is_op(angle, "Mul") else None  # fmt: skip
    if factor is None or factor.size != 1 or inv_freq is None:
        return None
    return np.asarray(inv_freq, np.float32).reshape(-1), float(factor)


class RotateInCore(AttnxPass):
    """After BufferForm: each GroupQueryAttention rotates q and k itself (do_rotary) from a cos/sin table of
    `positions` rows, in place of the two RotaryEmbedding nodes and the cos/sin the graph computed each call from
    position_ids. In the buffer form a row's positions are its token indices, which are the op's own (from
    seqlens_k), so the rotation is the same up to the table's rounding (its angle in float32, as the graph's; its
    cos and sin in float64). The table's rows are recorded (metadata attnx.rope_positions): a run that reaches past
    them is refused before its first call. A core whose rotation is not attnx's with constant frequencies (a
    longrope, whose factors switch with the call's largest position) keeps its nodes."""

    def __init__(self, positions: int) -> None:
        super().__init__()
        self.positions = positions

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        tables: dict[bytes, tuple[ir.Value, ir.Value]] = {}  # one table for the cores of one rope
        rotated = kept = 0
        for core in list(model.graph):
            if not is_op(core, "GroupQueryAttention", _MS) or not (core.name or "").startswith(_ATTNX):
                continue
            if core.attributes.get_int("do_rotary", 0) or core.inputs[1] is None:
                continue  # it rotates itself already (the builder's, whose q, k, v come packed)
            q, k = (core.inputs[i].producer() for i in (0, 1))
            rotaries = [n for n in (q, k) if is_op(n, "RotaryEmbedding", _MS)]
            if not rotaries:
                continue
            ropes = [_rope_of(n) for n in rotaries]
            attrs = {(n.attributes.get_int("interleaved", 0), n.attributes.get_int("rotary_embedding_dim", 0))
                     for n in rotaries}  # fmt: skip
            head = core.inputs[3].shape[3] if core.inputs[3] is not None and core.inputs[3].shape is not None else None
            if len(rotaries) != 2 or None in ropes or len(attrs) != 1 or not np.array_equal(ropes[0][0], ropes[1][0]) \
                    or ropes[0][1] != ropes[1][1] or core.attributes.get_int("do_rotary", 0) \
                    or ropes[0][0].size % 8 or not isinstance(head, int) or head % 16:  # fmt: skip
                kept += 1  # the op's own rule: a table of a multiple of 8 columns, a head of a multiple of 16
                continue
            (inv_freq, factor), ((interleaved, _dim),) = ropes[0], attrs
            key = inv_freq.tobytes() + np.float32(factor).tobytes()
            if key not in tables:
                arrays = rope_table(inv_freq, factor, self.positions)  # the table export/_llm writes
                tables[key] = tuple(ir.Value(name=f"attnx/rope{len(tables)}_{w}_cache", const_value=ir.tensor(a))
                                    for w, a in zip(("cos", "sin"), arrays))  # fmt: skip
                for value in tables[key]:
                    model.graph.register_initializer(value)
            for i, rotary in ((0, q), (1, k)):
                core.replace_input_with(i, rotary.inputs[0])
            core.resize_inputs(max(9, len(core.inputs)))  # cos_cache and sin_cache: its inputs 7 and 8
            for i, value in ((7, tables[key][0]), (8, tables[key][1])):
                core.replace_input_with(i, value)
            core.attributes["do_rotary"] = ir.AttrInt64("do_rotary", 1)
            core.attributes["rotary_interleaved"] = ir.AttrInt64("rotary_interleaved", interleaved)
            rotated += 1
        if rotated:
            from onnx_ir.passes.common import RemoveUnusedNodesPass

            RemoveUnusedNodesPass()(model)
            model.metadata_props[ROPE_POSITIONS_KEY] = str(self.positions)
            self.notes.append(f"{rotated} GroupQueryAttention(s) rotate q and k themselves (do_rotary, a table of "
                              f"{self.positions} positions)" + (f"; {kept} keep their rotation nodes" if kept else ""))
        return ir.passes.PassResult(model, modified=bool(rotated))


class PackedQkv(AttnxPass):
    """After the packing of sibling MatMuls (attnx.export.passes.serve.PackMatMuls): a GroupQueryAttention whose q,
    k and v are the three outputs, in order, of a Split it alone reads takes the Split's input as its packed query
    (key and value empty): the op splits it itself, with no copy."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        packed = 0
        for core in list(model.graph):
            if not is_op(core, "GroupQueryAttention", _MS) or len(core.inputs) < 3 or core.inputs[1] is None:
                continue
            split = core.inputs[0].producer()
            if not is_op(split, "Split") or len(split.outputs) != 3 \
                    or [core.inputs[i] for i in range(3)] != list(split.outputs) \
                    or any(len(list(v.uses())) != 1 for v in split.outputs):  # fmt: skip
                continue
            core.replace_input_with(0, split.inputs[0])
            core.replace_input_with(1, None)
            core.replace_input_with(2, None)
            packed += 1
        if packed:
            from onnx_ir.passes.common import RemoveUnusedNodesPass

            RemoveUnusedNodesPass()(model)
            self.notes.append(f"{packed} GroupQueryAttention(s) take the packed q/k/v projection")
        return ir.passes.PassResult(model, modified=bool(packed))
