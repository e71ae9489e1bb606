"""attnx import: one attention layer of a Hugging Face checkpoint, into attnx's config and weights."""

from __future__ import annotations

import argparse
import os

from attnx._text import format_table
from attnx.commands import COMMANDS
from attnx.commands._common import Progress, int_arg, str_list, workflows
from attnx.model.contract import EXPORT_ATTENTIONS, check_choice
from attnx.model.importers import KNOWN_ARCHITECTURES, check_import_target, import_weights, write_import

HELP = COMMANDS["import"].help


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import", help=HELP,
        description=HELP + f". Architectures: {', '.join(KNOWN_ARCHITECTURES)}. Read with safetensors alone: no "
        "transformers, no network, never a pickle. --check runs the source model (needs transformers): a rotary or ALiBi "
        "decoder full-sequence and as a prefill then single-token steps.",
    )  # fmt: skip
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a folder with config.json and *.safetensors")
    p.add_argument("--out", required=True, metavar="DIR", help="the attnx folder to write: config.json, weights.safetensors")
    p.add_argument("--layer", type=int_arg(0), default=0, help="which layer (default 0)")
    p.add_argument("--attention", choices=["self", "cross"], default="self", help="self- or cross-attention (default self)")
    p.add_argument("--stack", choices=["encoder", "decoder"], default=None,
                   help="encoder or decoder, for encoder-decoders' self-attention (default: the encoder's)")  # fmt: skip
    p.add_argument("--key-padding-mask", choices=["yes", "no"], default=None,
                   help="whether the attnx model takes a key padding mask (default: as the architecture does)")  # fmt: skip
    p.add_argument("--kv-cache", action="store_true",
                   help="write the step model's config ('kv_cache': true; a causal self-attention layer)")  # fmt: skip
    p.add_argument("--check", action="store_true", help="run the source model and compare (needs transformers)")
    p.add_argument("--lowering", type=str_list, default=["decomposed"],
                   help=f"lowerings the check exports and runs ({','.join(EXPORT_ATTENTIONS[:-1])}; default decomposed)")  # fmt: skip
    p.add_argument("--force", action="store_true", help="replace an earlier import at --out")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    mask = None if args.key_padding_mask is None else args.key_padding_mask == "yes"
    options = dict(layer=args.layer, attention=args.attention, stack=args.stack, key_padding_mask=mask,
                   kv_cache=args.kv_cache)
    checks, skipped = [], []
    if args.check:  # runs the source model and exports: the export side, and transformers
        for name in args.lowering:
            check_choice("--lowering", name, EXPORT_ATTENTIONS[:-1])
        report = workflows("import --check").import_model(
            args.checkpoint, args.out, check=True, lowerings=args.lowering, force=args.force, progress=Progress(),
            **options,
        )  # fmt: skip
        result, checks, skipped = report.result, report.checks, report.skipped
    else:  # reading a checkpoint needs numpy alone; writing the weights, safetensors
        check_import_target(os.path.abspath(args.out), args.force)
        result = import_weights(args.checkpoint, **options)
        write_import(result, args.out, force=args.force)
    print("\n".join(result.lines()))
    if checks:
        rows = [(c.name, "pass" if c else "FAIL", c.max_abs, c.atol, c.cosine) for c in checks]
        print(format_table(["check", "status", "max_abs", "atol", "cosine"], rows))
    for reason in skipped:
        print(f"skipped: {reason}")
    print(f"wrote {args.out}: config.json, weights.safetensors ({result.config.to_json()})")
    return 0
