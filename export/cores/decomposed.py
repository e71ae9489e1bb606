"""The decomposed core: MatMul, Softmax, MatMul, in standard ops (attnx, torch.onnx and Optimum write it)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from attnx.export._latent import Heads, absorbed, expanded, latent_heads, latent_parts, prompt_expands
from attnx.export.cores._absorbed_block import absorbed_latents, read_absorbed_block
from attnx.export.cores._block import Block, hidden_state, keep, output_projection, path_cache
from attnx.export.cores._emit import Emit, branches_of, cache_heads
from attnx.export.cores._latent_block import read_latent_block
from attnx.export.cores._registry import CoreGraph, register
from attnx.export.passes._masks import classify_hidden
from attnx.export.passes.walk import (
    NotRead,
    find_projection,
    head_dim,
    projection,
    projection_node,
    reaches_matmul,
    score_chain,
)
from attnx.export.terms import RopeReading, emit_scores, emit_softmax, read_paths, read_scores, read_softmax
from attnx.export.visibility import score_bias, visibility
from attnx.model.config import AttentionConfig


def _decomposed(e: Emit) -> str:
    """MatMul, Softmax, MatMul. Grouped heads without a copy of the keys: the query heads of a group
    stacked along the query axis ([B, Hkv, G*S, hd]) multiply their one key head. softcap as
    Div/Tanh/Mul, ALiBi's bias added, the masks as a Where over a boolean grid (token index), a sink as one more
    logit column dropped after the softmax (each term's entry in attnx.export.terms). The buffer form: each row's
    positions from seqlens_k (Emit.buffer_span), its new tokens written into the cache buffer by TensorScatter-24 and
    the buffer's first total_sequence_length positions read (Emit.cached), the masks at each row's
    own positions. A latent step: the cache written once, then an If on the call between the expanded heads (a
    prompt) and the absorbed ones (a step), attnx.export._latent."""
    c, g = e.c, e.g
    span = e.buffer_span() if e.form == "buffer" else None  # before the rope, which reads its positions
    latent_step = c.latent is not None and e.step
    if latent_step:
        q, latents = latent_parts(e)
        latents = e.cached("past_latent", latents, "present_latent")  # growing: joined; buffer: written in place
    elif c.latent is not None:  # the full-sequence graph: the expanded heads (attnx.export._latent)
        heads = latent_heads(e)
    else:
        q, k, v = e.projections()
        q, k = e.scored(q, k)
        present_k, present_v = cache_heads(e, k, v)
        heads = Heads(q, present_k, present_v, c.n_kv_heads, c.head_dim, c.v_head_dim)
    seen = visibility(g, c, e.kpm, e.step, indices=span[2:] if span is not None else None)
    if not latent_step:
        return _attend(e, heads, seen)
    expands = prompt_expands(e, latents)
    if expands is None:
        return _attend(e, absorbed(e, q, latents), seen)
    # the absorbed branch is the If's else_branch, which a reader meets first (attributes in name order)
    made = branches_of(e, {"expanded": lambda: _attend(e, expanded(e, q, latents), seen),
                           "absorbed": lambda: _attend(e, absorbed(e, q, latents), seen)}, ())  # fmt: skip
    return g.op("If", expands, then_branch=made["expanded"], else_branch=made["absorbed"], name=g.stage("z"))


def _attend(e: Emit, heads: Heads, seen: tuple[str | None, str | None]) -> str:
    """z [B, S, H*vhd] of q scored against the keys and values `heads` holds (per-head, or the latent's), the masks'
    grid `seen` (hidden, visible: attnx.export.visibility)."""
    c, g = e.c, e.g
    q, present_k, present_v, Hkv, hd, vhd, finish = heads
    H, G = c.n_heads, c.n_heads // Hkv
    hidden, visible = seen
    # q [B, S, H*hd] -> [B, S, Hkv, G, hd] -> [B, Hkv, G, S, hd] -> [B, Hkv, G*S, hd]
    q5 = g.op("Transpose", g.op("Reshape", q, g.ints(f"q_shape_{Hkv}_{hd}", [0, 0, Hkv, G, hd])), perm=[0, 2, 3, 1, 4])
    qg = g.op("Reshape", q5, g.ints(f"qg_shape_{hd}", [0, 0, -1, hd]))
    scores = g.op("MatMul", qg, g.op("Transpose", present_k, perm=[0, 1, 3, 2]))  # [B, Hkv, G*S, T]
    scores = g.op("Mul", scores, g.const("scale", np.asarray(c.softmax_scale, np.float32)))
    scores = emit_scores(g, c, scores)  # the terms on the scores after the scale, before the masks (a softcap)
    bias = score_bias(g, c, e.step)  # the terms' bias (ALiBi's slope_h * (j - i)), after the softcap
    scores = g.op("Reshape", scores, g.ints("bhst", [0, H, -1, 0]),
                  name=None if bias else g.stage("scores", "b h t s"))  # [B, H, S, T]  # fmt: skip
    if bias is not None:
        scores = g.op("Add", scores, bias, name=g.stage("scores", "b h t s"))
    if hidden is not None:
        scores = g.op("Where", hidden, e.lowest(), scores)
    p = emit_softmax(g, c, e.weights, scores, g.stage("probs", "b h t s"))  # with a sink's column, dropped after
    p = g.op("Reshape", p, g.ints(f"bkgst_{Hkv}", [0, Hkv, -1, 0]))  # [B, Hkv, G*S, T]
    z = g.op("Reshape", g.op("MatMul", p, present_v), g.ints(f"bhsv_{vhd}", [0, H, -1, vhd]))  # [B, H, S, vhd]
    if finish is not None:
        z = finish(z)  # [B, H, S, v_head_dim]
    if visible is not None:
        z = g.op("Where", visible, z, e.zero())  # all-hidden rows: 0
    z_shape = g.ints("z_shape", [0, 0, c.v_dim])
    return g.op("Reshape", g.op("Transpose", z, perm=[0, 2, 1, 3]), z_shape, name=g.stage("z"))


def _read_decomposed(node: ir.Node) -> dict[str, Any]:
    """From the Softmax back to q.k (the one walk, score_chain): the scale, a softcap c * tanh(s / c), the masks of
    a Where(hidden, lowest, scores), a sink's column (a Concat before the Softmax)."""
    chain = score_chain(node)
    try:
        stated: dict[str, Any] = dict(read_softmax(chain)[0])  # a sink's column
    except NotRead:  # a column whose logits are not read: those terms not stated
        stated = {}
    for where, hidden, how in chain.masks:
        if how == "where-masked":
            stated.update(_read_mask(hidden, where.outputs[0]))
    try:
        scale, scored = read_scores(chain.scalings)
    except NotRead:  # a scaling no term explains: the scale and those terms not stated
        return stated
    stated.update({key: value for key, value in scored.items() if value is not None})
    if any(entry[0] == "scale" for entry in chain.scalings):
        stated["scale"] = scale
    return stated


def _read_mask(hidden: ir.Value, scores: ir.Value) -> dict[str, Any]:
    """The masks a decomposed core's Where(hidden, lowest, scores) applies (attnx.export.passes._masks:
    the causal grid and the key padding input, never guessed at), or why they are not read."""
    shape = scores.shape
    q_len, kv_len = (shape[-2], shape[-1]) if shape is not None and len(shape) == 4 else (None, None)
    try:
        mask = classify_hidden(hidden, q_len, kv_len)
    except NotRead as e:
        return {"mask": f"not read: {e}"}
    return {"causal": mask.causal, "key_padding_mask": mask.key_padding is not None}


def _read_decomposed_block(index: int, node: ir.Node, keep_weights: bool = True) -> Block:
    """A Softmax between MatMul(q, k^T) and MatMul(p, v): the projections found above each side (through the heads'
    layout, a GQA repeat, a decomposed rotary and the cache's Concat), the scale and softcap as the reader of attnx's
    core reads them, each mask tensor named for the audit to read by running it."""
    chain = score_chain(node)
    if chain.constant_bias:
        raise NotRead("a constant added to the scores (a folded mask or a position bias): not read in this version")
    if chain.qk is None:
        maker = chain.end.producer()
        raise NotRead(f"{chain.end.name}: the Softmax's scores are not traced back to MatMul(q, k^T) "
                      f"(made by {maker.op_type if maker is not None else 'a graph input'})")  # fmt: skip
    qk, pv = chain.qk, chain.pv
    if (written := _written_in_place(qk.inputs[1])) is not None:
        raise NotRead(f"{written.name}: the keys read from a cache written in place by TensorScatter (the decomposed "
                      "core's buffer form): not read as a block in this version")  # fmt: skip
    masks = [(tensor.name, how) for _, tensor, how in chain.masks]
    scale, stated = read_scores(chain.scalings)
    if pv is None:
        raise NotRead(f"{node.outputs[0].name}: the probabilities are not multiplied by values")
    block = Block(index, node.name or node.op_type, "decomposed")
    latents = absorbed_latents(qk, pv)
    if latents is not None:  # q.k and p.v read one tensor: attnx's absorbed step of multi-head latent attention
        block.masks, block.mask = masks, masks[0][0] if masks else None
        return read_absorbed_block(block, latents, qk, pv, scale, keep_weights)
    weights: dict[str, np.ndarray] = {}
    paths = {}
    for role, value in (("q", qk.inputs[0]), ("k", qk.inputs[1]), ("v", pv.inputs[1])):
        found, paths[role] = find_projection(value)
        proj = projection(found)
        if proj is None:
            raise NotRead(f"{role} {found.name}: not read as a projection")
        w, b = proj
        weights[f"{role}_proj.weight"] = w.T
        weights[f"{role}_proj.bias"] = b if b is not None else np.zeros(w.shape[1])
    for role in "qkv":
        block.stages[role] = (paths[role].projection.name, None)
    hd = head_dim(qk.inputs[0])
    if hd is None:
        raise NotRead(f"{qk.inputs[0].name}: the head size is neither a static dimension nor a constant Reshape")
    n_heads, n_kv = weights["q_proj.weight"].shape[0] // hd, weights["k_proj.weight"].shape[0] // hd
    softmax_terms, term_weights = read_softmax(chain, n_heads)  # a sink's column before the Softmax
    weights.update(term_weights)
    scale *= paths["q"].scale * paths["k"].scale
    path_terms = read_paths(paths, weights, block.reading)  # the terms met on q's and k's paths (the norms)
    proj_node = projection_node(paths["q"].projection)
    kv_node = projection_node(paths["v"].projection)
    if kv_node is not proj_node and 2 * weights["v_proj.weight"].shape[1] < weights["v_proj.weight"].shape[0]:
        # v's projection widens a low-rank input into more than twice its width (into both k and v: k's path may
        # end there, or at the rope key's projection beside it): DeepSeek's MLA, kv_b_proj over the latent, where a
        # cross attention's v keeps about its input's width
        block.masks, block.mask = masks, masks[0][0] if masks else None
        return read_latent_block(block, paths["q"].projection, kv_node, pv, hd, scale, keep_weights)
    if any(projection_node(paths[r].projection).inputs[0] is not proj_node.inputs[0] for r in "kv"):
        raise NotRead("q, k and v projected from different tensors (a cross attention): not read in this version")
    hidden_state(block, proj_node)
    block.outputs["y"] = output_projection(pv.outputs[0], weights, block).name
    path_cache(block, paths)
    if (paths["q"].rotary is None) != (paths["k"].rotary is None):
        raise NotRead(f"a rotary on {'q' if paths['q'].rotary is not None else 'k'} alone")
    if paths["q"].rotary is not None:
        tables = paths["q"].rotary
        if set(tables) != {"Cos", "Sin"}:
            raise NotRead("a rotary with a cos or a sin table alone")
        # rotate_half's (i, i + dim/2) pairs, or (2i, 2i + 1) read apart (Llama 4's complex product, attnx's Slice)
        block.reading.rope = RopeReading(interleaved=paths["q"].interleaved,
                                         tensors=(tables["Cos"].name, tables["Sin"].name))  # fmt: skip
    block.masks = masks
    block.mask = masks[0][0] if masks else None
    config = AttentionConfig(
        d_model=weights["q_proj.weight"].shape[1], n_heads=n_heads, head_dim=hd, n_kv_heads=n_kv, bias=True,
        causal=False, scale=scale, **path_terms, **stated, **softmax_terms,
    )  # fmt: skip
    return keep(block, config, weights, keep_weights)


def _written_in_place(keys: ir.Value | None) -> ir.Node | None:
    """The TensorScatter the scored keys are read from (the buffer form: through the Slice of the positions read and
    the keys' Transpose), or None."""
    node = keys.producer() if keys is not None else None
    for _ in range(4):
        if node is None or node.op_type == "TensorScatter":
            return node
        if node.op_type not in ("Transpose", "Slice", "Reshape") or node.inputs[0] is None:
            return None
        node = node.inputs[0].producer()
    return None


def _of_qk(node: ir.Node) -> bool:
    """A Softmax whose input comes from a MatMul of two computed operands (q.k): attention, not a router's."""
    return reaches_matmul(node.inputs[0], depth=16)


register(CoreGraph("decomposed", _decomposed, _read_decomposed, _read_decomposed_block, is_attention=_of_qk))
