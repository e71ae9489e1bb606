"""What every subcommand shares: model arguments, progress, list parsing, output paths."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from types import ModuleType
from typing import Any

from attnx.errors import UsageError
from attnx.model import PRESETS, init_weights, load_config, load_weights, preset
from attnx.runtimes.localise import set_decomposed_writer

__all__ = [
    "add_model_args",
    "add_max_mem_arg",
    "load_config_arg",
    "load_weights_arg",
    "Progress",
    "int_arg",
    "float_arg",
    "int_list",
    "str_list",
    "workflows",
]

# The range of every numeric argument, checked by argparse (exit 2 naming the argument and the
# range) before any work; the ranges that depend on the lowering (--opset) are the contract's.
SEED_MAX = 2**64 - 1  # numpy's PCG64 takes any non-negative integer; a uint64 is what users pass
SIZE_MAX = 2**31 - 1  # batch and sequence lengths; what they need in memory is the estimator's to refuse

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


def exporter_for_localisation(command: str) -> None:
    """Let localisation look inside a fused operator (attnx.runtimes.localise): the exporter writes the
    decomposed form, imported only when a look inside needs it (a verify on a machine without torch
    imports nothing until then, and that look inside then says what is missing)."""
    def write(source, directory: str) -> str:
        return workflows(f"{command} (a look inside a fused operator)").write_decomposed_form(source, directory)

    set_decomposed_writer(write)


def add_model_args(parser: argparse.ArgumentParser, weights: bool = True, required: bool = True) -> None:
    """--preset or --config (one of them, when required; parity with --model reads the model's
    config), and --weights and --seed."""
    group = parser.add_mutually_exclusive_group(required=required)
    group.add_argument("--preset", help=f"a preset: {', '.join(PRESETS)}")
    group.add_argument("--config", metavar="C.json", help="an AttentionConfig JSON file")
    if weights:
        parser.add_argument("--weights", metavar="W.safetensors", help="weights (default: seeded, see --seed)")
        parser.add_argument("--seed", type=int_arg(0, SEED_MAX), default=0, help="seed of the generated weights (default 0)")


def add_max_mem_arg(parser: argparse.ArgumentParser, what: str = "refuse to start when the estimate exceeds it") -> None:
    parser.add_argument(
        "--max-mem-gb", type=float_arg(0.0, None), default=None, metavar="G",
        help=f"memory the command may use, GB: {what} (default: the memory available now)",
    )  # fmt: skip


def load_config_arg(args: argparse.Namespace) -> Any:
    """The AttentionConfig named by --preset or read from --config (None when neither was given)."""
    if args.preset:
        return preset(args.preset)
    return load_config(args.config) if args.config else None


def load_weights_arg(args: argparse.Namespace, config: Any, progress: Progress | None = None) -> Any:
    """The weights of --weights, or seeded ones (--seed), for the config of --preset/--config."""
    if getattr(args, "weights", None):
        return load_weights(args.weights, config)
    if progress:
        progress(f"drawing seeded weights (seed {args.seed}, {config.n_params:,} parameters)")
    return init_weights(config, args.seed)


class Progress:
    """One line per step on stderr, with the time since the command started."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"[{time.perf_counter() - self.start:7.1f}s] {message}", file=sys.stderr, flush=True)


def int_arg(minimum: int, maximum: int | None = None):
    """An argparse type: an integer in [minimum, maximum]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"from {minimum} to {maximum}" if maximum is not None else f"at least {minimum}"
            raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {text!r}")
        return value

    return parse


def float_arg(above: float, maximum: float | None = None):
    """An argparse type: a finite number greater than `above` (and at most maximum)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (math.isfinite(value) and value > above and (maximum is None or value <= maximum)):
            bound = f"greater than {above:g}" + (f" and at most {maximum:g}" if maximum is not None else "")
            raise argparse.ArgumentTypeError(f"expected a finite number {bound}, got {text!r}")
        return value

    return parse


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or any(not 1 <= v <= SIZE_MAX for v in values):
        raise argparse.ArgumentTypeError(f"expected integers from 1 to {SIZE_MAX}, got {text!r}")
    return values


def str_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


# Reduced precision (issue 12) ------------------------------------------------------------------
def add_quant_args(parser: argparse.ArgumentParser) -> None:
    """--block-size and --accuracy-level: int4's MatMulNBits parameters (attnx.export.passes.quantize;
    the values are listed here, not imported: the CLI starts without onnx-ir)."""
    parser.add_argument("--block-size", type=int, choices=(16, 32, 64, 128, 256), default=32,
                        help="with --dtype int4: weights per quantization block along K (default 32)")  # fmt: skip
    parser.add_argument("--accuracy-level", type=int, choices=(0, 1, 2, 3, 4), default=4,
                        help="with --dtype int4: 4 multiplies in int8 (default), 0 or 1 in float32")  # fmt: skip
