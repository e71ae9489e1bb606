"""attnx build: export, check and package the model into a folder to ship."""

from __future__ import annotations

import argparse
import os

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
    str_list,
    workflows,
)
from attnx.commands.optimize import WEIGHT_CHOICES, WHOLE_MODEL_CORES
from attnx.errors import UsageError
from attnx.model.contract import BUFFER_CORES, BUILD_ATTENTION, DECODE_FORMS, EXPORT_ATTENTIONS, MODEL_DTYPES, PROVIDERS
from attnx.model.cores import MEASURE, attention_help, buffer_core_help

HELP = COMMANDS["build"].help


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help=HELP, description=HELP)
    add_model_args(p, whole_model="a whole model another tool exported: optimized and proven (attnx optimize), "
                   "golden generations recorded, packaged for attnx verify and attnx generate")
    p.add_argument(
        "--attention",
        type=renamed("--attention"),
        choices=EXPORT_ATTENTIONS,
        default=BUILD_ATTENTION,
        help=attention_help(EXPORT_ATTENTIONS, BUILD_ATTENTION),
    )
    p.add_argument("--dtype", choices=(*MODEL_DTYPES, "bf16"), default="fp32", help="bf16: refused, saying where it runs")
    add_quant_args(p)
    add_decode_arg(p)
    p.add_argument("--decode-form", choices=DECODE_FORMS, default="growing",
                   help="with --decode (or a kv_cache config), the step model's form: growing (default) or buffer "
                   "(ort-fused, decomposed: one preallocated cache bound as past and present; runs on ONNX Runtime)")  # fmt: skip
    p.add_argument("--buffer-core", type=renamed("--buffer-core"), choices=BUFFER_CORES, help=buffer_core_help())
    p.add_argument(
        "--provider",
        type=str_list,
        default=None,
        help=f"providers the package is for, comma-separated (default {','.join(PROVIDERS)}; with --model one, "
        "default cpu, where its cores are measured and it is verified); each is verified here when it can run here",
    )
    p.add_argument(
        "--force", action="store_true",
        help="replace an existing package at --out (only one holding nothing but its manifest's files)",
    )  # fmt: skip
    add_max_mem_arg(p)
    p.add_argument("--out", required=True, metavar="DIR", help="the package folder to write (one there already: --force)")
    p.add_argument("--checkpoint", default=None, metavar="HF_DIR",
                   help="with --model: its Hugging Face checkpoint (each block written as its layer states it)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="with --model: the folder of its tokenizer files (tokenizer.json, tokenizer_config.json, "
                   "generation_config.json, chat_template.jinja), copied into the package and checked by verify "
                   "(default: --checkpoint's, where it holds tokenizer.json)")
    p.add_argument("--core", type=renamed("--core"), choices=WHOLE_MODEL_CORES, default=None,
                   help=f"with --model: the core each block is written as (default {MEASURE}: measured, as attnx "
                   "optimize)")
    p.set_defaults(run=run)


def run_model(args: argparse.Namespace) -> int:
    """--model: a whole model's package (attnx.workflows.build_model_package)."""
    quantize = args.weights if args.weights in WEIGHT_CHOICES else None  # --weights int4|int8: quantized first
    if args.weights is not None and quantize is None:
        raise UsageError(f"--weights {args.weights}: a whole model (--model) takes --weights int4 or int8 (its MatMul "
                         "weights quantized first); a weights file is for a layer's package (--preset, --config)")  # fmt: skip
    given = [f for f, v in (("--attention", args.attention != BUILD_ATTENTION),
                            ("--dtype", args.dtype != "fp32"), ("--decode", args.decode),
                            ("--decode-form", args.decode_form != "growing"), ("--max-mem-gb", args.max_mem_gb),
                            ("--buffer-core", args.buffer_core is not None)) if v]  # fmt: skip
    if given:
        raise UsageError(f"{given[0]} is for a layer's package (--preset, --config); a whole model (--model) is "
                         "optimized as attnx optimize writes it (--core, --checkpoint)")  # fmt: skip
    providers = args.provider or ["cpu"]
    if len(providers) != 1:
        raise UsageError(f"--provider {','.join(providers)}: a whole model's package is built for one provider, where "
                         "its cores are measured and it is verified")  # fmt: skip
    flows = workflows("build", needs=("onnx_ir", "onnxscript"))
    report = flows.build_model_package(args.model, args.out, checkpoint=args.checkpoint, provider=providers[0],
                                       core=args.core or MEASURE, force=args.force, weights=quantize,
                                       tokenizer=args.tokenizer, progress=Progress())  # fmt: skip
    print("\n".join(report.optimize.lines()))
    m = report.manifest
    rows = [(name, entry["size"], entry["sha256"][:16]) for name, entry in m["files"].items()]
    print(format_table(["file", "bytes", "sha256"], rows))
    rows = [(c.name, "pass" if c else "FAIL", c.detail) for c in report.verify.checks if c.name.startswith("generation ")]
    print(format_table(["golden generation", "status", "detail"], rows))
    text = [c for c in report.verify.checks if c.name == "text"]
    print(f"text: {text[0].detail}" if text else "text: none (no --tokenizer, and --checkpoint holds no tokenizer.json)")
    total = sum(e["size"] for e in m["files"].values())
    print(f"wrote {os.path.abspath(args.out)}: {len(m['files']) + 2} files, {total / 1e6:.1f} MB; "
          f"{m['generations']['requests']} golden generations of {m['generations']['steps']} tokens; verified on "
          f"{', '.join(m['verified_on'])}")  # fmt: skip
    return 0


def run(args: argparse.Namespace) -> int:
    if args.model is not None:
        return run_model(args)
    whole = [f for f, v in (("--checkpoint", args.checkpoint), ("--core", args.core), ("--tokenizer", args.tokenizer))
             if v]
    if whole:
        raise UsageError(f"{whole[0]} is for a whole model's package (--model)")
    build_package = workflows("build").build_package
    config = load_step_config_arg(args)
    progress = Progress()
    report = build_package(
        config,
        args.out,
        args.weights,  # a path: read inside, and released before onnxruntime loads the model
        seed=args.seed,
        attention=args.attention,
        dtype=args.dtype,
        providers=args.provider or list(PROVIDERS),
        force=args.force,
        max_mem_gb=args.max_mem_gb,
        progress=progress,
        block_size=args.block_size,
        accuracy_level=args.accuracy_level,
        int8_bits=args.int8_bits,
        decode_form=args.decode_form,
        buffer_core=args.buffer_core,
    )
    m = report.manifest
    for line in report.export_lines:
        print(line)
    rows = [(name, entry["size"], entry["sha256"][:16]) for name, entry in m["files"].items()]
    print(format_table(["file", "bytes", "sha256"], rows))
    rows = [
        (b, c["pass"], c["fail"], c["skipped"], m["parity"]["max_abs"].get(b)) for b, c in m["parity"]["cases"].items()
    ]
    print(format_table(["parity backend", "pass", "fail", "skipped", "max_abs"], rows))
    for provider, reason in m["not_verified"].items():
        print(f"not verified on {provider} here: {reason}")
        print(f"  (run `attnx verify {args.out} --provider {provider}` on the deployment machine)")
    text = [c for c in report.verify.checks if c.name == "text"]
    print(f"text: {text[0].detail}" if text else "text: none (no --tokenizer, and --checkpoint holds no tokenizer.json)")
    total = sum(e["size"] for e in m["files"].values())
    model = m["models"][0]
    print(
        f"wrote {os.path.abspath(args.out)}: {len(m['files']) + 2} files, {total / 1e6:.1f} MB; {model['lowering']} "
        f"attention, {m['dtype']}, IR {model['ir_version']}, opset {model['opsets'].get('ai.onnx')}; "
        f"verified on {', '.join(m['verified_on']) or 'nothing'}"
    )
    return 0
