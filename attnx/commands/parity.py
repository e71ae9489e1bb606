"""attnx parity: every backend against the reference, case by case."""

from __future__ import annotations

import argparse
import os
import tempfile

from attnx._io import check_output_file
from attnx._text import format_table
from attnx.commands import COMMANDS
from attnx.commands._common import (
    SIZE_MAX,
    Progress,
    add_max_mem_arg,
    add_model_args,
    exporter_for_localisation,
    int_arg,
    int_list,
    load_config_arg,
    load_weights_arg,
    model_flag,
    step_config,
    str_list,
    workflows,
)
from attnx.errors import UsageError
from attnx.model.contract import (
    BACKEND_NAMES,
    MODEL_DTYPES,
    RUNTIME_DTYPES,
    check_choice,
    graph_dtype,
    model_form,
    runs_onnx_model,
)
from attnx.model.resources import check_memory, estimate_parity
from attnx.runtimes import ModelSource, backend_names, create_runner
from attnx.runtimes._untrusted import check_untrusted_model
from attnx.runtimes.decode import DEFAULT_PREFILLS, DEFAULT_STEPS, run_decode_parity
from attnx.runtimes.parity import DEFAULT_BATCHES, DEFAULT_MEM_SEQS, DEFAULT_SEQS, ParityReport, run_parity

HELP = COMMANDS["parity"].help


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("parity", help=HELP, description=HELP)
    add_model_args(p, required=False)
    p.add_argument("--model", metavar="MODEL.onnx",
                   help="the ONNX model for ort-* and openvino (default: export one now); it describes itself: its "
                   "config, dtype, lowering and decode form are read from it, and a flag that contradicts them is an "
                   "error")  # fmt: skip
    p.add_argument("--backends", type=str_list, default=list(BACKEND_NAMES), help=f"default {','.join(BACKEND_NAMES)}")
    p.add_argument("--require", type=str_list, default=[], help="backends that must be available (else exit 2)")
    p.add_argument("--batch", type=int_list, default=list(DEFAULT_BATCHES),
                   help=f"batch sizes, comma-separated (default {','.join(map(str, DEFAULT_BATCHES))})")  # fmt: skip
    p.add_argument("--seq", type=int_list, default=list(DEFAULT_SEQS),
                   help=f"sequence lengths, comma-separated (default {','.join(map(str, DEFAULT_SEQS))})")  # fmt: skip
    p.add_argument("--mem-seq", type=int_list, default=None, help="memory lengths for cross-attention (default 9)")
    p.add_argument(
        "--dtype",
        choices=(*MODEL_DTYPES, *RUNTIME_DTYPES),
        default=None,
        help="the precision every backend computes in (default: the --model's, else fp32; bf16: the torch module in "
        "bfloat16 and OpenVINO's bf16 precision hint on the fp32 graph; ort-* have no bf16 form and are skipped)",
    )
    p.add_argument("--json", metavar="FILE", help="write the parity report as JSON")
    p.add_argument("--decode", action="store_true",
                   help="step by step: a prefill of each --prefill length, then --steps single-token steps feeding the "
                   "cache back, against the reference's full forward, of the step model of --preset/--config (causal "
                   "self-attention; export --decode writes it); implied by a kv_cache config and by a step model")  # fmt: skip
    p.add_argument("--prefill", type=_lengths, default=list(DEFAULT_PREFILLS), help="with --decode (default 0,1,37)")
    p.add_argument("--steps", type=int_arg(1, SIZE_MAX), default=DEFAULT_STEPS,
                   help=f"with --decode (default {DEFAULT_STEPS})")  # fmt: skip
    p.add_argument("--attention", default=None,
                   help="without --model: the lowering of the model exported for the run (default decomposed); with "
                   "--model: must be the model's")  # fmt: skip
    where = p.add_mutually_exclusive_group()
    where.add_argument("--localise", dest="localise", action="store_const", const="all", default="failing",
                       help="localise every case, passing ones too (a passing case must show no stage beyond its "
                       "bound); by default each failing case is localised once: the first stage of the formula "
                       "that diverges, its nodes, and on ONNX Runtime each optimization level's verdict")  # fmt: skip
    where.add_argument("--no-localise", dest="localise", action="store_const", const="off",
                       help="do not localise failing cases")
    add_max_mem_arg(p)
    p.set_defaults(run=run)


def _lengths(text: str) -> list[int]:
    """Prefill lengths: like int_list, 0 included (no prefill: every token is a step)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or any(not 0 <= v <= SIZE_MAX for v in values):
        raise argparse.ArgumentTypeError(f"expected integers from 0 to {SIZE_MAX}, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    exporter_for_localisation("parity")
    # Everything that can be refused is refused before the weights are made.
    for name in [*args.backends, *args.require]:
        check_choice("backend", name, backend_names())
    if args.json:
        check_output_file(args.json, "--json")
    given = load_config_arg(args)
    if args.decode and given is not None:  # the step model of --preset/--config, as export --decode writes it
        given = step_config(given, model_flag(args))
    if args.model:  # the model describes itself; a flag that contradicts it is one error
        # one rule for every backend, before any reads the file; the runtime holds every tensor at once
        check_untrusted_model(args.model, whole_model=True, max_mem_gb=args.max_mem_gb)
        form = model_form(args.model, config=given, dtype=args.dtype, lowering=args.attention,
                          flags={"config": "--preset" if args.preset else "--config"})  # fmt: skip
        config, dtype = form.config, form.dtype
    else:
        config = given
        if config is None:
            raise UsageError("parity needs --preset, --config or --model (whose config it reads)")
        dtype = args.dtype or "fp32"
    if args.decode and not config.kv_cache:
        raise UsageError(f"--decode needs a step model, and {args.model!r} is a full-sequence one "
                         "(attnx export --decode writes the step model)")  # fmt: skip
    decode = config.kv_cache  # a step model's parity is step by step
    mem_seqs = (args.mem_seq or DEFAULT_MEM_SEQS) if config.cross else [None]
    shapes = [(b, s, m) for b in args.batch for s in args.seq for m in mem_seqs]
    if decode:  # the reference's full forward over every token of the longest case
        shapes = [(b, max(args.prefill) + args.steps, None) for b in args.batch]
    needs_model = any(runs_onnx_model(b) for b in [*args.backends, *args.require])
    check_memory(estimate_parity(config, shapes, onnx_model=needs_model), args.max_mem_gb)
    progress = Progress()
    weights = load_weights_arg(args, config, progress)
    for name in args.require:  # ProviderUnavailable exits 2 with the backend's reason
        if name not in args.backends:
            args.backends.append(name)
    with tempfile.TemporaryDirectory(prefix="attnx-parity-") as tmp:
        model = args.model
        if needs_model and model is None:
            export_model = workflows("parity (ort-* without --model: it exports one)").export_model
            model = os.path.join(tmp, "model.onnx")
            export_model(config, model, weights, dtype=graph_dtype(dtype), validate=False, progress=progress,
                         **({"attention": args.attention} if args.attention else {}))  # fmt: skip
        source = ModelSource(config, weights, model, dtype)
        for name in args.require:
            with create_runner(name, source):
                pass
        if decode:
            report = ParityReport([
                case for batch in args.batch
                for case in run_decode_parity(source, args.backends, prefills=args.prefill, steps=args.steps,
                                              batch=batch, progress=progress, localise=args.localise).cases
            ])  # fmt: skip
        else:
            report = run_parity(source, args.backends, batches=args.batch, seqs=args.seq, mem_seqs=args.mem_seq,
                                progress=progress, localise=args.localise)  # fmt: skip
    rows = [
        (c.backend, c.reference, c.dtype, c.batch, c.seq, c.mem_seq, c.input_mean, c.status, c.max_abs, c.max_rel,
         c.atol, c.cosine, c.rel_rms)  # fmt: skip
        for c in report.cases
    ]
    headers = ["backend", "vs", "dtype", "batch", "seq", "mem_seq", "x mean", "status", "max_abs", "max_rel", "atol",
               "cosine", "rel_rms"]  # fmt: skip
    if decode:
        rows = [(c.backend, c.reference, c.dtype, c.batch, c.prefill, c.steps, c.status, c.max_abs, c.max_rel, c.atol,
                 c.cosine, c.rel_rms) for c in report.cases]  # fmt: skip
        headers = [h for h in headers if h != "x mean"]
        headers[4:6] = ["prefill", "steps"]
    print(format_table(headers, rows))
    precisions = {c.backend: c.precision for c in report.cases if c.precision and c.backend != "reference"}
    if precisions:
        print("computed in: " + ", ".join(f"{b} {p}" for b, p in precisions.items())
              + (" (openvino: INFERENCE_PRECISION_HINT read back from the compiled model)" if "openvino" in precisions
                 else ""))  # fmt: skip
    reasons = {c.backend: c.reason for c in report.cases if c.status == "skipped"}
    for backend, reason in reasons.items():
        print(f"skipped {backend}: {reason}")
    for c in report.cases:
        if c.status == "fail":
            where = f"prefill={c.prefill} steps={c.steps}" if c.prefill is not None else f"seq={c.seq}"
            print(f"FAIL {c.backend} batch={c.batch} {where}: {c.reason}")
            if c.localisation:
                print(f"  {c.localisation['line']}")
    findings = [c for c in report.cases if c.status == "pass" and c.localisation and c.localisation.get("stage")]
    for c in findings:  # a passing y with a stage beyond its bound: say so, it is a lead
        where = f"prefill={c.prefill} steps={c.steps}" if c.prefill is not None else f"seq={c.seq}"
        print(f"finding {c.backend} batch={c.batch} {where} (y passes): {c.localisation['line']}")
    if args.localise == "all":
        localised = sum(1 for c in report.cases if c.localisation and "error" not in c.localisation)
        print(f"localised {localised} cases: {len(findings)} passing case(s) with a stage beyond its bound")
    if args.json:
        report.write_json(args.json)
    counts = {s: sum(c.status == s for c in report.cases) for s in ("pass", "fail", "skipped")}
    print(f"parity {'PASSED' if report.passed else 'FAILED'}: {counts['pass']} passed, {counts['fail']} failed, "
          f"{counts['skipped']} skipped")  # fmt: skip
    return 0 if report.passed else 1
