"""What every subcommand shares: model arguments, progress, tables, list parsing."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from attnx.errors import UsageError

__all__ = ["add_model_args", "load_config_arg", "load_model_args", "Progress", "format_table", "int_list", "str_list"]


def add_model_args(parser: argparse.ArgumentParser, weights: bool = True) -> None:
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--preset", help="a preset: tiny, base, large, gpt3")
    group.add_argument("--config", metavar="C.json", help="an AttentionConfig JSON file")
    if weights:
        parser.add_argument("--weights", metavar="W.safetensors", help="weights (default: seeded, see --seed)")
        parser.add_argument("--seed", type=int, default=0, help="seed of the generated weights (default 0)")


def load_config_arg(args: argparse.Namespace) -> Any:
    """The AttentionConfig named by --preset or read from --config."""
    from attnx.model import load_config, preset

    return preset(args.preset) if args.preset else load_config(args.config)


def load_model_args(args: argparse.Namespace, progress: Progress | None = None) -> tuple[Any, Any]:
    """(config, weights) from --preset/--config and --weights/--seed."""
    from attnx.model import init_weights, load_weights

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


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Aligned columns: numbers right, text left."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) and rows for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


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
