"""What each block of a whole model becomes: the config and weights it is written from (the graph's, or with a
checkpoint its paired layer's, each difference a repair) and the core that computes them, or why it is kept."""

from __future__ import annotations

import dataclasses
from typing import Any

from attnx.errors import UsageError
from attnx.model.cores import core_for
from attnx.workflows.audit.compare import compare_terms
from attnx.workflows.audit.cut import AuditGraph
from attnx.workflows.rewrite.report import BlockRewrite

__all__ = ["LOWERING", "plan_block"]

LOWERING = "ort-fused"


def plan_block(block: Any, rewrite: BlockRewrite, source: Any, graph: AuditGraph) -> tuple | None:
    """(block, config, weights) of a block to rewrite (rewrite.written: its core), or None with rewrite.kept saying
    why."""
    # a table no theta fits (a scaled rope) is held to the checkpoint's rope (the audit's rule)
    if block.unread and not (source is not None and block.unread == f"rope {block.facts.get('rope')}"):
        rewrite.kept = f"not read: {block.unread}"
        return None
    if block.dtype != "fp32" or block.quantization is not None:
        rewrite.kept = (f"its projections are {block.quantization['op']} {block.quantization['bits']}-bit"
                        if block.quantization else f"a {block.dtype} block") + ": kept in this version"  # fmt: skip
        return None
    config, weights = block.config, block.weights
    if source is not None:
        rewrite.layer = source.pair(block.weights)
        if rewrite.layer is None:
            rewrite.kept = "no checkpoint layer has a projection of its shapes"
            return None
        paired = source.layer(rewrite.layer)
        rewrite.repairs = [f"{f}: written as the checkpoint states" for f in
                           compare_terms(block, paired.config, paired.weights, rewrite.layer)]  # fmt: skip
        config, weights = paired.config, paired.weights
    inputs = {v.name for v in graph.model.graph.inputs}
    cached = "past_key" in block.inputs
    config = dataclasses.replace(config, kv_cache=cached, key_padding_mask="attention_mask" in inputs)
    if config.rope is not None and "position_ids" not in inputs:
        rewrite.kept = "a rotary block in a model without a position_ids input: kept in this version"
        return None
    try:
        core = core_for(LOWERING, config, form="growing" if cached else "full")
    except UsageError as e:
        rewrite.kept = str(e)
        return None
    rewrite.written = core.name
    return block, config, weights
