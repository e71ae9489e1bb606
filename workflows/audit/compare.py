"""A block's terms and weights against its source's layer (the audit's findings), and the float64 reference it is
run against (of the model as MatMulNBits computes at accuracy_level 4, where it does)."""

from __future__ import annotations

from typing import Any

import numpy as np

from attnx.model.config import AttentionConfig
from attnx.model.reference import reference_attention
from attnx.model.rope import rope_frequencies
from attnx.model.rope_fit import rope_table_error
from attnx.model.tolerance import stored_bound

__all__ = ["blocks_of", "compare_terms", "int8_blocks", "reference_of"]


def compare_terms(block: Any, config: AttentionConfig, weights: dict[str, np.ndarray], layer: int,
                   source: str = "the checkpoint") -> list[str]:
    """Every difference between the formula the graph states and the checkpoint layer's, by term."""
    g, facts, found = block.config, block.facts, []
    where = f"layer {layer}"
    for key in ("n_heads", "n_kv_heads", "head_dim"):
        if getattr(g, key) != getattr(config, key):
            found.append(f"{where}: {key} {getattr(g, key)} in the graph, {getattr(config, key)} in {source}")
    if g.causal != config.causal:
        found.append(f"{where}: {'a causal mask' if g.causal else 'no causal mask'} in the graph"
                     f"{' (' + facts['mask'] + ')' if 'mask' in facts else ''}, {'causal' if config.causal else 'not causal'} "
                     f"in {source}")  # fmt: skip
    if not np.isclose(g.softmax_scale, config.softmax_scale, rtol=1e-6):
        found.append(f"{where}: scale {g.softmax_scale:.6g} in the graph, {config.softmax_scale:.6g} in {source}")
    if (g.softcap or None) != (config.softcap or None) and not (
        g.softcap and config.softcap and np.isclose(g.softcap, config.softcap, rtol=1e-6)
    ):
        found.append(f"{where}: softcap {g.softcap} in the graph, {config.softcap} in {source}")
    if g.sliding_window != config.sliding_window:
        how = (f"local_window_size {facts['local_window_size']}" if "local_window_size" in facts
               else f"its mask: {facts.get('mask', 'not read')}")  # fmt: skip
        graph_says = f"window {g.sliding_window} in the graph ({how})" if g.sliding_window else f"no window in the graph ({how})"
        ckpt = f"sliding_window {config.sliding_window}" if config.sliding_window else "no window"
        found.append(f"{where}: {graph_says}, {ckpt} in {source}"
                     + (f": every query past {config.sliding_window} sees keys it must not"
                        if config.sliding_window and not g.sliding_window else ""))  # fmt: skip
    if g.sinks != config.sinks:
        found.append(f"{where}: sinks {'in the graph' if g.sinks else 'missing from the graph'}, "
                     f"{'in' if config.sinks else 'not in'} {source}")  # fmt: skip
    if (g.qk_norm is None) != (config.qk_norm is None):
        found.append(f"{where}: q/k norm {'in the graph' if g.qk_norm else 'missing from the graph'}, "
                     f"{'in' if config.qk_norm else 'not in'} {source}")  # fmt: skip
    if config.rope is not None:
        tables = facts.get("rope_tables")
        if tables is None:
            found.append(f"{where}: no rotary in the graph, rope in {source}")
        else:
            # a table the graph computes, read at each prompt length (its rows for that call); a constant one,
            # whatever the length: its rows are the positions
            at = facts.get("rope_tables_at") or {tables[0].shape[0]: tables}
            for tokens, (cos, sin) in sorted(at.items()):
                inv_freq, factor = rope_frequencies(config.rope, tokens)
                if cos.shape[1] != inv_freq.shape[0]:
                    found.append(f"{where}: rotary on {2 * cos.shape[1]} of each head's dims in the graph, "
                                 f"{2 * inv_freq.shape[0]} in {source}")  # fmt: skip
                    break
                err, ratio = rope_table_error(cos, sin, inv_freq, factor)
                if ratio > 1:  # beyond float32's rounding of the angles (rope_table_error)
                    prompt = f" for a prompt of {tokens} tokens" if "rope_tables_at" in facts else ""
                    found.append(f"{where}: rotary table{prompt} differs from {source}'s rope ({config.rope.rope_type}, "
                                 f"theta {config.rope.theta:g}) by {err:.3g}, {ratio:.3g} times its bound (graph theta "
                                 f"fit {facts.get('rope_theta', float('nan')):.6g})")  # fmt: skip
            if block.facts.get("rotary_interleaved") != config.rope.interleaved:
                found.append(f"{where}: rotary_interleaved {int(block.facts.get('rotary_interleaved', 0))} in the graph, "
                             f"{source}'s rope pairs {'(2i, 2i+1)' if config.rope.interleaved else '(i, i+dim/2)'}")  # fmt: skip
    # weights: the graph's (dequantized where quantized) against the source's; a bias the source has not is zero there
    quantized = block.quantization is not None
    for name in sorted(set(block.weights) - set(weights)):
        if name.endswith(".bias") and np.any(block.weights[name]):
            found.append(f"{where}: {name} in the graph (largest |value| {float(np.abs(block.weights[name]).max()):.3g}), "
                         f"none in {source}")  # fmt: skip
    for name, theirs in weights.items():
        ours = block.weights.get(name)
        if ours is None:
            if name == "sinks" and not g.sinks:
                continue  # said above, as the term
            if np.any(theirs):
                found.append(f"{where}: {name} is in {source}, not in the graph")
            continue
        if ours.shape != theirs.shape:
            found.append(f"{where}: {name} shape {list(ours.shape)} in the graph, {list(theirs.shape)} in {source}")
            continue
        ref = np.asarray(theirs, np.float64)
        diff = np.abs(ours - ref)
        if quantized and name.endswith("_proj.weight"):
            # b-bit blocks along the input: each weight within one step of its block (|w| max of the block / levels)
            n, bits = int(block.quantization.get("block_size", 32)), int(block.quantization.get("bits", 4))
            levels = 2 ** (bits - 1) - 1
            step = np.repeat(blocks_of(np.abs(ref), n).max(axis=2) / levels, n, axis=1)[:, : ref.shape[1]]
            bad = diff > step * (1 + 1e-3) + 1e-12
            if bad.any():
                r, k = np.argwhere(bad)[0]
                found.append(f"{where}: {name} differs from {source}'s by more than its {bits}-bit step in "
                             f"{int(bad.sum())} weight(s), first [{r}, {k}] (block {k // n})")  # fmt: skip
            continue
        err = float(diff.max() / max(np.abs(ref).max(), 1e-30))
        if err > stored_bound(block.weight_dtype):  # the source's values stored in the graph's dtype
            found.append(f"{where}: {name} differs from {source}'s by {err:.3g} of its largest value")
    return found


def int8_blocks(a: np.ndarray, block: int) -> np.ndarray:
    """`a` as MatMulNBits at accuracy_level 4 computes with it: each row's blocks of `block` values along the last
    axis quantized to int8, symmetric, scale = max |a| / 127, rounded to nearest even, and back (float64)."""
    a = np.asarray(a, np.float32)
    rows = blocks_of(a, block)
    amax = np.abs(rows).max(axis=2, keepdims=True)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.clip(np.rint(rows * inverse), -127, 127)
    back = (q * (amax / np.float32(127))).reshape(rows.shape[0], -1)[:, : a.shape[-1]]
    return back.reshape(a.shape).astype(np.float64)


def blocks_of(a: np.ndarray, n: int) -> np.ndarray:
    """a [..., k] as [rows, ceil(k / n), n], zero-padded along k: the blocks MatMulNBits quantizes along its input."""
    k = a.shape[-1]
    return np.pad(a.reshape(-1, k), ((0, 0), (0, (-k) % n))).reshape(-1, -(-k // n), n)


def reference_of(config: AttentionConfig, weights: dict[str, np.ndarray], feeds: dict[str, np.ndarray],
               block_size: int | None) -> np.ndarray:  # fmt: skip
    """The float64 reference; with block_size, of the model as MatMulNBits computes at accuracy_level 4: the
    projections' inputs (x, and the heads' output z before out_proj) in int8 blocks (int8_blocks)."""
    if block_size is None:
        return np.asarray(reference_attention(config, weights, **feeds))
    stages: dict[str, np.ndarray] = {}
    reference_attention(config, weights, **{**feeds, "x": int8_blocks(feeds["x"], block_size)}, stages=stages,
                        core_stages=False)  # fmt: skip
    z = int8_blocks(stages["z"].astype(np.float32), block_size)
    bias = weights.get("out_proj.bias")  # a config without biases has none
    return z @ np.asarray(weights["out_proj.weight"], np.float64).T + (0.0 if bias is None else np.asarray(bias, np.float64))
