"""A tiny ONNX graph builder shared by the hand-built graphs (the step model, the modern-LLM
full-sequence forms): nodes, initializers, unique names."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper

__all__ = ["Graph", "heads", "linear"]


class Graph:
    """Nodes, initializers and unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.n = 0

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", name: str | None = None,
           **attrs) -> str | list[str]:  # fmt: skip
        self.n += 1
        outs = [name] if name and outputs == 1 else [f"{op_type.lower()}_{self.n}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=f"{op_type}_{self.n}", domain=domain,
                                           **attrs))  # fmt: skip
        return outs[0] if outputs == 1 else outs

    def const(self, name: str, value: np.ndarray) -> str:
        if any(t.name == name for t in self.inits):  # one initializer per name
            return name
        self.inits.append(helper.make_tensor(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape,
                                             value.tobytes(), raw=True))  # fmt: skip
        return name

    def ints(self, name: str, values: list[int]) -> str:
        return self.const(name, np.asarray(values, dtype=np.int64))


def linear(g: Graph, x: str, weights: Mapping[str, np.ndarray], name: str, bias: bool, out: str | None = None) -> str:
    """x @ W^T (+ b) for the torch-convention weights `name`.weight/.bias."""
    w = g.const(f"{name}.weight_t", np.ascontiguousarray(np.asarray(weights[f"{name}.weight"], np.float32).T))
    y = g.op("MatMul", x, w, name=None if bias else out)
    if bias:
        y = g.op("Add", y, g.const(f"{name}.bias", np.asarray(weights[f"{name}.bias"], np.float32)), name=out)
    return y


def heads(g: Graph, x: str, n: int, d: int, label: str) -> str:
    """[B, S, n*d] -> [B, n, S, d]."""
    return g.op("Transpose", g.op("Reshape", x, g.ints(f"{label}_shape", [0, 0, n, int(d)])), perm=[0, 2, 1, 3])
