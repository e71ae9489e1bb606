"""attnx optimize: one optimizer for every model (attnx.workflows.optimize_model), proven before it is written: a model
attnx wrote is a whole model with one block. The flags for a model attnx wrote (--attention, --dtype, ...) and for a
whole model another tool exported (--checkpoint, --weights) are each refused (exit 2) for the other kind."""

from __future__ import annotations

import argparse

from attnx.commands import COMMANDS
from attnx.commands._common import Progress, add_quant_args, renamed, workflows
from attnx.model.contract import LOWERINGS, MODEL_DTYPES, OPTIMIZE_ATTENTIONS, PROVIDERS
from attnx.model.cores import MEASURE, attention_help

HELP = COMMANDS["optimize"].help
WEIGHT_CHOICES = ("int4", "int8")  # --weights of a whole model (attnx.export.passes.quantize_weights.WEIGHT_BITS)
# what a whole model's blocks may be written as: measured (MEASURE), or one core of the ort-fused lowering (the
# growing form's switch core, an If of gqa and grouped-mha, among them)
WHOLE_MODEL_CORES = (MEASURE, *dict.fromkeys(c for form in ("full", "growing")
                                             for c in LOWERINGS["ort-fused"].cores[form]))  # fmt: skip
# and a model attnx wrote: one core of its --attention lowering
CORE_CHOICES = (*WHOLE_MODEL_CORES, *dict.fromkeys(c for lowering in LOWERINGS.values()
                                                   for c in lowering.cores.get("full", ()) if c not in WHOLE_MODEL_CORES))  # fmt: skip


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
        "--attention", type=renamed("--attention"), choices=OPTIMIZE_ATTENTIONS, default=None,
        help=attention_help(OPTIMIZE_ATTENTIONS, "ort-fused") + f" ({MEASURE} measures each on --provider); a whole "
        "model's blocks are written in that lowering's cores (default: ort-fused's, else decomposed for a block no "
        f"fused core computes; {MEASURE}: every measured lowering's)",
    )  # fmt: skip
    p.add_argument("--dtype", choices=(*MODEL_DTYPES, "bf16"), default=None,
                   help="a model attnx wrote: the precision it is written in (default: the model's; int8 and int4 "
                        "quantize its projections); a whole model keeps its own (--weights)")  # fmt: skip
    add_quant_args(p)
    p.add_argument("--keep-io-fp32", action="store_true", help="with --dtype fp16: keep float32 inputs and output")
    p.add_argument("--provider", choices=list(PROVIDERS), default="cpu", help=f"where parity is checked and {MEASURE} times")
    p.add_argument("--auto-seq", type=_shape, default=None,
                   help=f"a model attnx wrote: the sequence length {MEASURE} times at (default 512)")
    p.add_argument("--checkpoint", default=None, metavar="HF_DIR",
                   help="a whole model's Hugging Face checkpoint: each block written as its layer states it, each "
                        "difference a named repair")  # fmt: skip
    p.add_argument("--json", default=None, metavar="REPORT.json", help="the report as JSON")
    p.add_argument("--weights", choices=WEIGHT_CHOICES, default=None,
                   help="a whole model exported in fp32: its MatMul weights quantized first with ONNX Runtime's "
                        "MatMulNBits quantizer (symmetric blocks of 32, accuracy_level 4; at int4 the embeddings too, as "
                        "GatherBlockQuantized), each "
                        "block proven with its quantized weights, the distance from the fp32 model said")  # fmt: skip
    p.add_argument("--core", type=renamed("--core"), choices=CORE_CHOICES, default=None,
                   help=f"the core each block is written as: for a whole model (default {MEASURE}) the fastest of "
                        "the ort-fused lowering's that computes the block, measured on --provider, the switch core's "
                        "If among them, or the block kept where the graph's own is faster; for a model attnx wrote "
                        f"(default: the lowering's own core) one of the --attention lowering's cores, or {MEASURE}; a "
                        "core named is written wherever it computes the block")  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Every model through one optimizer (attnx.workflows.optimize_model): a model attnx wrote is a whole model with
    one block; each flag for one kind of model is refused (exit 2) for the other."""
    flows = workflows("optimize", needs=("onnx_ir", "onnxscript"))
    model = flows.open_whole_model(args.model)  # checked as untrusted input and parsed, once
    report = flows.optimize_model(
        model, args.out, checkpoint=args.checkpoint, json_path=args.json, provider=args.provider, core=args.core,
        weights=args.weights, lowering=args.attention, dtype=args.dtype, keep_io_fp32=args.keep_io_fp32,
        auto_seq=args.auto_seq, block_size=args.block_size, accuracy_level=args.accuracy_level,
        int8_bits=args.int8_bits, progress=Progress(),
    )  # fmt: skip
    print("\n".join(report.lines()))
    return 0 if report.passed else 1
