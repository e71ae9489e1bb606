"""How attnx names an ONNX operator, and counts a graph's: one spelling for every report
(pass reports, ORT's offline optimization, `attnx inspect`, the CUDA placement check)."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

__all__ = ["op_label", "op_counts"]

DEFAULT_DOMAINS = ("", "ai.onnx")


def op_label(domain: str, op_type: str) -> str:
    """'MatMul' for the default domain, 'com.microsoft.MultiHeadAttention' for any other."""
    return op_type if domain in DEFAULT_DOMAINS else f"{domain}.{op_type}"


def op_counts(nodes: Iterable[Any]) -> dict[str, int]:
    """{op_label: count} over `nodes`: onnx NodeProtos (graph.node) or onnx-ir nodes (a
    graph), anything with .domain and .op_type; subgraphs are not entered."""
    return dict(collections.Counter(op_label(n.domain, n.op_type) for n in nodes))
