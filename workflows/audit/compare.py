"""A block's terms and weights against its source's layer (the audit's findings), and the float64 reference it is
run against (of the model as MatMulNBits computes at accuracy_level 4, where it does)."""

from __future__ import annotations

from typing import Any

import numpy as np

from attnx.export import terms as graph_terms
from attnx.model.config import AttentionConfig
from attnx.model.reference import reference_attention
from attnx.model.tolerance import ProblemSize, Requantization, Tolerance, requantization_slack, stored_bound

__all__ = ["blocks_of", "compare_terms", "compare_weights", "int8_blocks", "reference_of"]


def compare_terms(block: Any, config: AttentionConfig, weights: dict[str, np.ndarray], layer: int,
                  source: str = "the checkpoint") -> list[str]:  # fmt: skip
    """Every difference between the formula the graph states and the source layer's: each term's
    (attnx.export.terms, in the formula's order), then each weight's."""
    found = graph_terms.compare_terms(block.config, block.reading, config, graph_terms.Context(f"layer {layer}", source))
    return found + list(compare_weights(block, config, weights, layer, source).values())


def is_projection_weight(name: str) -> bool:
    """A projection's weight, which a quantized graph holds in MatMulNBits blocks (the latent's kv_a_proj_with_mqa
    among them)."""
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def compare_weights(block: Any, config: AttentionConfig, weights: dict[str, np.ndarray], layer: int,
                    source: str = "the checkpoint") -> dict[str, str]:  # fmt: skip
    """Each weight of the graph (dequantized where quantized) that differs from the source layer's, by name, with
    its finding; a bias the source has not is zero there."""
    where = f"layer {layer}"
    said = graph_terms.said_by_terms(block.config, config)
    found: dict[str, str] = {}
    quantized = block.quantization is not None
    for name in sorted(set(block.weights) - set(weights)):
        if name.endswith(".bias") and np.any(block.weights[name]):
            found[name] = (f"{where}: {name} in the graph (largest |value| {float(np.abs(block.weights[name]).max()):.3g}), "
                           f"none in {source}")  # fmt: skip
    for name, theirs in weights.items():
        ours = block.weights.get(name)
        if ours is None:
            if name in said:
                continue  # said above, as the term
            if np.any(theirs):
                found[name] = f"{where}: {name} is in {source}, not in the graph"
            continue
        if ours.shape != theirs.shape:
            found[name] = f"{where}: {name} shape {list(ours.shape)} in the graph, {list(theirs.shape)} in {source}"
            continue
        ref = np.asarray(theirs, np.float64)
        diff = np.abs(ours - ref)
        if quantized and is_projection_weight(name):
            # b-bit blocks along the input: each weight within one step of its block (|w| max of the block / levels)
            n, bits = int(block.quantization.get("block_size", 32)), int(block.quantization.get("bits", 4))
            levels = 2 ** (bits - 1) - 1
            step = np.repeat(blocks_of(np.abs(ref), n).max(axis=2) / levels, n, axis=1)[:, : ref.shape[1]]
            bad = diff > step * (1 + 1e-3) + 1e-12
            if bad.any():
                r, k = np.argwhere(bad)[0]
                found[name] = (f"{where}: {name} differs from {source}'s by more than its {bits}-bit step in "
                               f"{int(bad.sum())} weight(s), first [{r}, {k}] (block {k // n})")  # fmt: skip
            continue
        err = float(diff.max() / max(np.abs(ref).max(), 1e-30))
        if err > stored_bound(block.weight_dtype):  # the source's values stored in the graph's dtype
            found[name] = f"{where}: {name} differs from {source}'s by {err:.3g} of its largest value"
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
                 block_size: int | None, tol: Tolerance | None = None,
                 size: ProblemSize | None = None) -> tuple[np.ndarray, Requantization | None]:  # fmt: skip
    """The float64 reference, and None; with block_size, of the model as MatMulNBits computes at accuracy_level 4:
    the projections' inputs (x, and the heads' output z before out_proj) in int8 blocks (int8_blocks), and what the
    int8 rounding of z may change in y where the kernel's own z (within `tol`'s bound at `size`) lies that close to
    a rounding midpoint (attnx.model.tolerance.requantization_slack). x is the audit's own feed, rounded alike on
    both sides (measured exact), so only z's rounding is uncertain."""
    if block_size is None:
        return np.asarray(reference_attention(config, weights, **feeds)), None
    stages: dict[str, np.ndarray] = {}
    reference_attention(config, weights, **{**feeds, "x": int8_blocks(feeds["x"], block_size)}, stages=stages,
                        core_stages=False)  # fmt: skip
    z = int8_blocks(stages["z"].astype(np.float32), block_size)
    w = np.asarray(weights["out_proj.weight"], np.float64)
    bias = weights.get("out_proj.bias")  # a config without biases has none
    y = z @ w.T + (0.0 if bias is None else np.asarray(bias, np.float64))
    if tol is None or size is None:
        return y, None
    return y, requantization_slack(tol, size, stages["z"], w, block_size)
