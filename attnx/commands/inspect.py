"""attnx inspect: what a model (or a package) is, from the file alone."""

from __future__ import annotations

import argparse
import json
import os

from attnx._io import not_a_file
from attnx.commands import COMMANDS
from attnx.errors import UsageError
from attnx.model.contract import describe
from attnx.runtimes.package import describe_package

HELP = COMMANDS["inspect"].help


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help=HELP, description=HELP)
    p.add_argument("model", metavar="DIR|MODEL.onnx", help="a package folder (attnx build) or an ONNX model file")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    path = args.model
    if os.path.isdir(path):
        info = describe_package(path)
    elif os.path.isfile(path):
        info = describe(path).to_dict()
    else:
        raise UsageError(f"{path!r} {not_a_file(path)}")
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        if isinstance(value, (dict, list)):
            value = json.dumps(value)
        print(f"{key:>14}: {value}")
    return 0
