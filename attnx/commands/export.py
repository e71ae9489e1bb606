"""attnx export: torch -> ONNX with dynamic batch/seq, lowered, checked."""

from __future__ import annotations

import argparse

from attnx._text import format_table
from attnx.commands import COMMANDS
from attnx.commands._common import (
    Progress,
    add_decode_arg,
    add_max_mem_arg,
    add_model_args,
    add_quant_args,
    load_step_config_arg,
    renamed,
    workflows,
)
from attnx.model.contract import BUFFER_CORES, DECODE_FORMS, EXPORT_ATTENTIONS, MODEL_DTYPES
from attnx.model.cores import attention_help, buffer_core_help

HELP = COMMANDS["export"].help


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help=HELP, description=HELP)
    add_model_args(p)
    p.add_argument("--attention", type=renamed("--attention"), choices=EXPORT_ATTENTIONS, default="decomposed",
                   help=attention_help(EXPORT_ATTENTIONS, "decomposed"))  # fmt: skip
    p.add_argument("--dtype", choices=(*MODEL_DTYPES, "bf16"), default="fp32", help="bf16: refused, saying where it runs")
    add_quant_args(p)
    p.add_argument("--keep-io-fp32", action="store_true", help="with --dtype fp16: keep float32 inputs and output")
    p.add_argument("--opset", type=int, help="ONNX opset (default and lowest: 18; 23 for --attention onnx; at most 25)")
    p.add_argument("--no-validate", action="store_true", help="skip running the model against torch at new shapes")
    add_decode_arg(p)
    p.add_argument("--decode-form", choices=DECODE_FORMS, default="growing",
                   help="with --decode (or a kv_cache config), the step model's form: growing (past -> present, every "
                   "lowering) or buffer (ort-fused, decomposed: one preallocated cache bound as past and present)")  # fmt: skip
    p.add_argument("--buffer-core", type=renamed("--buffer-core"), choices=BUFFER_CORES, help=buffer_core_help())
    add_max_mem_arg(p)
    p.add_argument("--out", required=True, metavar="MODEL.onnx", help="the ONNX file to write, once its checks pass")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    export_model = workflows("export").export_model
    progress = Progress()
    config = load_step_config_arg(args)
    report = export_model(
        config,
        args.out,
        args.weights,  # a path (or None: seeded), so that export_model can drop the weights early
        seed=args.seed,
        attention=args.attention,
        dtype=args.dtype,
        opset=args.opset,
        keep_io_fp32=args.keep_io_fp32,
        validate=not args.no_validate,
        max_mem_gb=args.max_mem_gb,
        progress=progress,
        decode_form=args.decode_form,
        buffer_core=args.buffer_core,
        block_size=args.block_size,
        accuracy_level=args.accuracy_level,
        int8_bits=args.int8_bits,
    )
    for line in report.passes:
        print(line)
    if report.validation:
        rows = [(c.name, "pass" if c else "FAIL", c.max_abs, c.atol, c.cosine) for c in report.validation]
        print(format_table(["check vs torch", "status", "max_abs", "atol", "cosine"], rows))
    print(f"wrote {', '.join(report.files)} ({report.attention}, {report.dtype}, opset {report.opset})")
    return 0
