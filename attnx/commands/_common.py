"""What every subcommand shares: model arguments, progress, list parsing, output paths."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from types import ModuleType
from typing import Any

from attnx.errors import ConfigError, UsageError
from attnx.model import PRESETS, AttentionConfig, init_weights, load_config, load_weights, preset
from attnx.model.cores import OLD_SPELLINGS
from attnx.model.int8 import INT8_BITS_CHOICES, INT8_BITS_FLAG
from attnx.runtimes.localise import set_decomposed_writer

__all__ = [
    "add_model_args",
    "add_decode_arg",
    "add_max_mem_arg",
    "load_config_arg",
    "load_weights_arg",
    "model_flag",
    "step_config",
    "load_step_config_arg",
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


def add_model_args(parser: argparse.ArgumentParser, weights: bool = True, required: bool = True,
                   whole_model: str | None = None) -> None:  # fmt: skip
    """--preset or --config (one of them, when required; parity with --model reads the model's
    config), and --weights and --seed; whole_model: --model MODEL.onnx as a third choice, with that help."""
    group = parser.add_mutually_exclusive_group(required=required)
    group.add_argument("--preset", help=f"a preset: {', '.join(PRESETS)}")
    group.add_argument("--config", metavar="C.json", help="an AttentionConfig JSON file")
    if whole_model is not None:
        group.add_argument("--model", metavar="MODEL.onnx", help=whole_model)
    if weights:
        parser.add_argument("--weights", metavar="W.safetensors", help="weights (default: seeded, see --seed)")
        parser.add_argument("--seed", type=int_arg(0, SEED_MAX), default=0, help="seed of the generated weights (default 0)")


def add_decode_arg(parser: argparse.ArgumentParser) -> None:
    """--decode of export and build (load_step_config_arg reads it)."""
    parser.add_argument("--decode", action="store_true",
                        help="the step model of the causal self-attention config ('kv_cache': true: past keys and "
                        "values in, present out), as attnx bench --decode and parity --decode take it "
                        "(docs/concepts/step-forms.md)")  # fmt: skip


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


def model_flag(args: argparse.Namespace) -> str:
    """How the command line named the config: "--preset P" or "--config C.json" (for messages)."""
    return f"--preset {args.preset}" if args.preset else f"--config {args.config}"


def _step_model(config: AttentionConfig, what: str) -> AttentionConfig:
    """`config` with 'kv_cache': true, or one UsageError: "{what} has no step model: " and the
    config's own rule (AttentionConfig: a cache is of causal self-attention)."""
    try:
        return AttentionConfig.from_dict({**config.to_dict(), "kv_cache": True})
    except ConfigError as e:
        raise UsageError(f"{what} has no step model: {e}") from None


def step_config(config: AttentionConfig, what: str, *, as_decoder: bool = False,
                kv_heads: int | None = None) -> AttentionConfig:
    """--decode: the step model of `config` ('kv_cache': true: past keys and values in, present out;
    docs/concepts/step-forms.md), the one reading of the flag by export, build, parity and bench.

    export, build and parity write or check the config's own attention, and only causal
    self-attention has a step model: another config is one UsageError saying why (`what` names it,
    "--preset tiny"). bench times the step of a decoder layer of the config's sizes (as_decoder): any
    config, made causal self-attention without key padding (its rows are one unpadded sequence),
    with `kv_heads` key/value heads when given."""
    if not as_decoder:
        return _step_model(config, f"--decode: {what}")
    changes = {"causal": True, "cross": False, "key_padding_mask": False, "kv_cache": True}
    if kv_heads is not None:
        changes["n_kv_heads"] = kv_heads
    return AttentionConfig.from_dict({**config.to_dict(), **changes})  # validated (n_kv_heads must divide n_heads)


def load_step_config_arg(args: argparse.Namespace) -> AttentionConfig:
    """export's and build's config: --preset or --config, its step model with --decode (step_config).
    --decode-form names a form of the step model: given for a config without 'kv_cache', it is one
    error that says to add --decode, or why the config has no step model."""
    config = load_config_arg(args)
    what = model_flag(args)
    if args.decode:
        return step_config(config, what)
    if not config.kv_cache and args.decode_form != "growing":
        flag = f"--decode-form {args.decode_form}"
        _step_model(config, f"{flag}: {what}")  # raises when it has none
        raise UsageError(f"{flag} is a form of the step model: add --decode for the step model of {what} "
                         "(docs/concepts/step-forms.md)")  # fmt: skip
    return config


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


def renamed(flag: str) -> Any:
    """An argparse type for `flag` that takes an old spelling (attnx.model.cores.OLD_SPELLINGS) as its new one,
    with one deprecation line on stderr; any other value as given (argparse's choices check it)."""

    def parse(text: str) -> str:
        if (flag, text) not in OLD_SPELLINGS:
            return text
        new, means = OLD_SPELLINGS[flag, text]
        print(f"attnx: warning: {flag} {text} is deprecated: say {flag} {new} ({means}); the old spelling will be "
              "refused in a later version", file=sys.stderr)  # fmt: skip
        return new

    return parse


# Reduced precision (issue 12) ------------------------------------------------------------------
def add_quant_args(parser: argparse.ArgumentParser) -> None:
    """--block-size and --accuracy-level: int4's MatMulNBits parameters (attnx.export.passes.quantize;
    the values are listed here, not imported: the CLI starts without onnx-ir); --int8-bits: int8's
    weight width (attnx.model.int8)."""
    parser.add_argument("--block-size", type=int, choices=(16, 32, 64, 128, 256), default=32,
                        help="with --dtype int4: weights per quantization block along K (default 32)")  # fmt: skip
    parser.add_argument("--accuracy-level", type=int, choices=(0, 1, 2, 3, 4), default=4,
                        help="with --dtype int4: 4 multiplies in int8 (default), 0 or 1 in float32")  # fmt: skip
    parser.add_argument(INT8_BITS_FLAG, choices=INT8_BITS_CHOICES, default="auto",
                        help="with --dtype int8: the weights' width; 7 runs right on every CPU, 8 is more accurate "
                        "and runs only on a CPU with VNNI (AVX-512 VNNI, AVX-VNNI or AMX), where ONNX Runtime's "
                        "int8 GEMM does not saturate; auto (default): 8 on such a CPU, else 7")  # fmt: skip
