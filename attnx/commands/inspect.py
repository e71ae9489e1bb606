"""attnx inspect: what a model (or a package) is, from the file alone."""

from __future__ import annotations

import argparse
import json
import os

from attnx._graph import op_counts
from attnx.errors import ModelFileError, UsageError

HELP = "describe a model or a package: config, inputs, outputs, opset, operators"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help=HELP, description=HELP)
    p.add_argument("model", metavar="DIR|MODEL.onnx")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=run)


def describe_model(path: str) -> dict:
    """A JSON-able description of an ONNX file, read without its external data."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        proto = onnx.load(path, load_external_data=False)
    except (DecodeError, OSError, ValueError) as e:
        raise ModelFileError(f"{path!r} is not an ONNX model: {str(e).strip()[:200]}") from None
    if not proto.graph.node and not proto.graph.input:
        raise ModelFileError(f"{path!r} is not an ONNX model (no graph)")

    def io(values) -> list[dict]:
        return [
            {
                "name": v.name,
                "dtype": onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name,
                "shape": [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim],
            }
            for v in values
        ]

    meta = {p.key: p.value for p in proto.metadata_props}
    config = json.loads(meta["attnx.config"]) if "attnx.config" in meta else None
    ops = op_counts(proto.graph.node)
    external = sorted({e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"})
    return {
        "path": path,
        "ir_version": proto.ir_version,
        "opsets": {o.domain or "ai.onnx": o.version for o in proto.opset_import},
        "producer": f"{proto.producer_name} {proto.producer_version}".strip(),
        "config": config,
        "metadata": {k: v for k, v in meta.items() if k != "attnx.config"},
        "inputs": io(proto.graph.input),
        "outputs": io(proto.graph.output),
        "nodes": sum(ops.values()),
        "operators": dict(sorted(ops.items())),
        "initializers": len(proto.graph.initializer),
        "external_data": external,
        "file_bytes": os.path.getsize(path),
    }


def run(args: argparse.Namespace) -> int:
    path = args.model
    if os.path.isdir(path):
        from attnx.runtimes.package import describe_package

        info = describe_package(path)
    elif os.path.isfile(path):
        info = describe_model(path)
    else:
        raise UsageError(f"{path!r} does not exist")
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        if isinstance(value, (dict, list)):
            value = json.dumps(value)
        print(f"{key:>14}: {value}")
    return 0
