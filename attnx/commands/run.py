"""attnx run: run a model (or a package) on .npy inputs."""

from __future__ import annotations

import argparse
import os

import numpy as np

from attnx._io import write_npy_atomic
from attnx.errors import InputError, UsageError
from attnx.model.contract import PROVIDERS
from attnx.runtimes import ModelSource, create_runner
from attnx.runtimes.package import load

HELP = "run an ONNX model or a package on .npy inputs"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help=HELP, description=HELP)
    p.add_argument("model", metavar="DIR|MODEL.onnx")
    p.add_argument("--input", required=True, metavar="x.npy")
    p.add_argument("--memory", metavar="m.npy")
    p.add_argument("--key-padding-mask", metavar="k.npy")
    p.add_argument("--provider", choices=list(PROVIDERS), default="cpu")
    p.add_argument("--output", required=True, metavar="y.npy")
    p.set_defaults(run=run)


def load_npy(path: str, what: str) -> np.ndarray:
    """np.load without pickles: an object array in a .npy is refused, never executed."""
    if not os.path.isfile(path):
        raise InputError(f"{what} file {path!r} does not exist")
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as e:
        raise InputError(f"{what} file {path!r} is not a plain .npy array: {e}") from None
    except OSError as e:
        raise InputError(f"{what} file {path!r} cannot be read: {e}") from None


def open_runner(path: str, provider: str):
    """A loaded runner for a model file or a package folder."""
    if os.path.isdir(path):
        return load(path, provider=provider)
    if not os.path.isfile(path):
        raise UsageError(f"{path!r} is neither a model file nor a package folder")
    return create_runner(PROVIDERS[provider].backend, ModelSource(model_path=path)).load()


def run(args: argparse.Namespace) -> int:
    feeds = {"x": load_npy(args.input, "--input")}
    if args.memory:
        feeds["memory"] = load_npy(args.memory, "--memory")
    if args.key_padding_mask:
        feeds["key_padding_mask"] = load_npy(args.key_padding_mask, "--key-padding-mask")
    parent = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(parent):
        raise UsageError(f"output folder {parent!r} does not exist")
    runner = open_runner(args.model, args.provider)
    try:
        y = runner.run(feeds)["y"]
    finally:
        runner.close()
    write_npy_atomic(args.output, y)
    print(f"wrote {args.output}: y {list(y.shape)} {y.dtype}")
    return 0
