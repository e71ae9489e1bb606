"""attnx optimize: graph passes on an exported model, checked against it before writing."""

from __future__ import annotations

import argparse
from typing import Any

from attnx._text import format_table
from attnx.commands import COMMANDS
from attnx.commands._common import Progress, add_quant_args, renamed, workflows
from attnx.errors import UsageError
from attnx.model.contract import LOWERINGS, MODEL_DTYPES, OPTIMIZE_ATTENTIONS, PROVIDERS
from attnx.model.cores import MEASURE, attention_help

HELP = COMMANDS["optimize"].help
WEIGHT_CHOICES = ("int4", "int8")  # --weights of a whole model (attnx.export.passes.quantize_weights.WEIGHT_BITS)
# what a whole model's blocks may be written as: measured (MEASURE), or one core of the ort-fused lowering (the
# growing form's switch core, an If of gqa and grouped-mha, among them)
WHOLE_MODEL_CORES = (MEASURE, *dict.fromkeys(c for form in ("full", "growing")
                                             for c in LOWERINGS["ort-fused"].cores[form]))  # fmt: skip


def _shape(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("optimize", help=HELP, description=HELP)
    p.add_argument("model", metavar="IN.onnx", help="a model written by attnx export, or a whole model another tool "
                   "exported (each attention block rewritten into a fused core, proven, the interface kept)")
    p.add_argument("--out", required=True, metavar="OUT.onnx", help="the ONNX file to write, once its parity check passes")
    p.add_argument(
        "--attention", type=renamed("--attention"), choices=OPTIMIZE_ATTENTIONS, default="ort-fused",
        help=attention_help(OPTIMIZE_ATTENTIONS, "ort-fused") + f" ({MEASURE} measures each on --provider)",
    )  # fmt: skip
    p.add_argument("--dtype", choices=(*MODEL_DTYPES, "bf16"), default=None, help="default: the input model's")
    add_quant_args(p)
    p.add_argument("--keep-io-fp32", action="store_true", help="with --dtype fp16: keep float32 inputs and output")
    p.add_argument("--provider", choices=list(PROVIDERS), default="cpu", help=f"where parity is checked and {MEASURE} times")
    p.add_argument("--auto-seq", type=_shape, default=None, help=f"sequence length {MEASURE} times at (default 512)")
    p.add_argument("--checkpoint", default=None, metavar="HF_DIR",
                   help="a whole model's Hugging Face checkpoint: each block written as its layer states it, each "
                        "difference a named repair")  # fmt: skip
    p.add_argument("--json", default=None, metavar="REPORT.json", help="a whole model's report as JSON")
    p.add_argument("--weights", choices=WEIGHT_CHOICES, default=None,
                   help="a whole model exported in fp32: its MatMul weights quantized first with ONNX Runtime's "
                        "MatMulNBits quantizer (symmetric blocks of 32, accuracy_level 4; at int4 the embeddings too, as "
                        "GatherBlockQuantized), each "
                        "block proven with its quantized weights, the distance from the fp32 model said")  # fmt: skip
    p.add_argument("--core", type=renamed("--core"), choices=WHOLE_MODEL_CORES, default=None,
                   help=f"a whole model: the core each block is written as (default {MEASURE}: the fastest that "
                        "computes the block, measured on --provider, the switch core's If among them, or the block "
                        "kept where the graph's own is faster); a core named is written wherever it computes the "
                        "block")  # fmt: skip
    p.set_defaults(run=run)


def run_model(args: argparse.Namespace, flows: Any, model: Any) -> int:
    """A whole model another tool exported (attnx.workflows.optimize_model), opened once (`model`)."""
    given = [f for f, v in (("--attention", args.attention != "ort-fused"), ("--dtype", args.dtype),
                            ("--auto-seq", args.auto_seq)) if v]  # fmt: skip
    if given:
        raise UsageError(f"{given[0]} is for a model attnx wrote; a whole model is rewritten into the ort-fused "
                         "lowering's cores (--core)")  # fmt: skip
    report = flows.optimize_model(model, args.out, checkpoint=args.checkpoint, json_path=args.json,
                                  provider=args.provider, core=args.core or MEASURE, weights=args.weights,
                                  progress=Progress())  # fmt: skip
    print("\n".join(report.lines()))
    return 0 if report.passed else 1


def run(args: argparse.Namespace) -> int:
    flows = workflows("optimize", needs=("onnx_ir", "onnxscript"))
    model = flows.open_whole_model(args.model)  # checked as untrusted input and parsed, once
    if model.written_by_another_tool:
        return run_model(args, flows, model)
    whole = [f for f, v in (("--checkpoint", args.checkpoint), ("--json", args.json), ("--core", args.core),
                            ("--weights", args.weights)) if v]  # fmt: skip
    if whole:
        raise UsageError(f"{whole[0]} is for a whole model another tool exported; this one was written by attnx "
                         "export")  # fmt: skip
    progress = Progress()
    auto_shape = flows.AUTO_SHAPE if args.auto_seq is None else (flows.AUTO_SHAPE[0], args.auto_seq, args.auto_seq)
    result = flows.optimize_file(
        args.model, args.out, attention=args.attention, dtype=args.dtype, keep_io_fp32=args.keep_io_fp32,
        block_size=args.block_size, accuracy_level=args.accuracy_level, int8_bits=args.int8_bits,
        provider=args.provider, auto_shape=auto_shape, raise_on_failure=False, progress=progress, opened=model,
    )  # fmt: skip
    lowering = result.lowering
    print("\n".join(lowering.lines()))  # auto's measurements, the core written, the precision
    rows = [(c.name, "pass" if c else "FAIL", c.max_abs, c.atol, c.cosine) for c in result.parity]
    print(format_table([f"check vs {args.model}", "status", "max_abs", "atol", "cosine"], rows))
    if not result.passed:
        for failure in result.failures():
            print(f"FAIL {failure}")
        print(f"nothing written: {args.out} disagrees with {args.model} on {PROVIDERS[args.provider].backend}")
        return 1
    print(f"wrote {', '.join(result.files)} ({lowering.lowering}, {result.dtype})")
    return 0
