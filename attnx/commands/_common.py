"""What every subcommand shares: model arguments, progress, list parsing, output paths."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from types import ModuleType
from typing import Any

from attnx.errors import UsageError
from attnx.model import PRESETS, init_weights, load_config, load_weights, preset

__all__ = [
    "add_model_args",
    "load_config_arg",
    "load_model_args",
    "Progress",
    "int_list",
    "str_list",
    "check_output_path",
    "workflows",
]

# The distributions of the `export` extra, by the module each installs.
EXPORT_EXTRA = {"torch": "torch", "onnxscript": "onnxscript", "onnx_ir": "onnx-ir", "safetensors": "safetensors"}


def workflows(command: str, needs: tuple[str, ...] = tuple(EXPORT_EXTRA)) -> ModuleType:
    """attnx.workflows (export, optimize, build), or one UsageError naming what is missing:
    the deployment side installs without the libraries that build models."""
    missing = [EXPORT_EXTRA[m] for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(
            f"attnx {command} needs {', '.join(missing)}, which this installation lacks: pip install 'attnx[export]'"
        )
    import attnx.workflows  # onnx-ir and onnxscript at module level: imported when a command needs them

    return attnx.workflows


def add_model_args(parser: argparse.ArgumentParser, weights: bool = True) -> None:
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--preset", help=f"a preset: {', '.join(PRESETS)}")
    group.add_argument("--config", metavar="C.json", help="an AttentionConfig JSON file")
    if weights:
        parser.add_argument("--weights", metavar="W.safetensors", help="weights (default: seeded, see --seed)")
        parser.add_argument("--seed", type=int, default=0, help="seed of the generated weights (default 0)")


def load_config_arg(args: argparse.Namespace) -> Any:
    """The AttentionConfig named by --preset or read from --config."""
    return preset(args.preset) if args.preset else load_config(args.config)


def load_model_args(args: argparse.Namespace, progress: Progress | None = None) -> tuple[Any, Any]:
    """(config, weights) from --preset/--config and --weights/--seed."""
    config = load_config_arg(args)
    if getattr(args, "weights", None):
        weights = load_weights(args.weights, config)
    else:
        if progress:
            progress(f"drawing seeded weights (seed {args.seed}, {config.n_params:,} parameters)")
        weights = init_weights(config, args.seed)
    return config, weights


class Progress:
    """One line per step on stderr, with the time since the command started."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"[{time.perf_counter() - self.start:7.1f}s] {message}", file=sys.stderr, flush=True)


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def str_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def check_output_path(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"output folder {parent!r} does not exist")
