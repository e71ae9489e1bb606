"""attnx generate: serve a whole model's package (attnx build --model): one JSON list of token ids a line in, the new
token ids of each line out, in order; the requests batched together (attnx.runtimes.generate)."""

from __future__ import annotations

import argparse
import json
import os
import time

from attnx._io import check_output_file, not_a_file, write_lines_atomic
from attnx._signals import on_interrupt
from attnx.commands import COMMANDS
from attnx.commands._common import Progress, float_arg, int_arg
from attnx.errors import InputError, UsageError
from attnx.model.contract import PROVIDERS
from attnx.runtimes.model_package import GenerativeModel
from attnx.runtimes.package import load

HELP = COMMANDS["generate"].help
# a prompts file is read whole; past this it is not one
MAX_PROMPTS_BYTES = 1024**3


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help=HELP, description=HELP + ". Exit 0: every line written; 1: a package check "
                       "failed; 2: bad input; 130/143: interrupted, the lines finished in order written whole.")
    p.add_argument("package", metavar="PKG", help="a whole model's package (attnx build --model)")
    p.add_argument("--prompts", required=True, metavar="PROMPTS.jsonl", help="one JSON list of token ids a line")
    p.add_argument("--out", required=True, metavar="OUT.jsonl", help="the new token ids of each prompt, a line each, "
                   "in the prompts' order (written whole: a temporary name, then renamed)")
    p.add_argument("--max-new-tokens", type=int_arg(1), default=32, metavar="N", help="new tokens a prompt at most "
                   "(default 32; a row also ends at an --eos id or the model's context)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 (the default): greedy; above 0: sampled, the logits divided by T")
    p.add_argument("--top-k", type=int_arg(1), default=None, metavar="K", help="sample among the K likeliest tokens")
    p.add_argument("--top-p", type=float_arg(0.0, 1.0), default=None, metavar="P",
                   help="sample among the likeliest tokens whose probabilities reach P")
    p.add_argument("--seed", type=int_arg(0), default=0, help="the sampling seed: each prompt draws from its own "
                   "generator (seed, its line), whatever shares its batch (default 0)")
    p.add_argument("--eos", type=int_arg(0), nargs="+", default=[], metavar="ID",
                   help="token ids that end a row (included in its output)")
    p.add_argument("--max-batch", type=int_arg(1), default=None, metavar="B", help="rows decoded at once; a row "
                   "that ends leaves and a waiting prompt joins between steps (default: every prompt, within half "
                   "the memory available for their caches)")
    p.add_argument("--provider", choices=list(PROVIDERS), default="cpu", help="execution provider (default cpu)")
    p.set_defaults(run=run)


def read_prompts(path: str) -> list[list[int]]:
    """The prompts of a JSON-lines file: one InputError naming the first line that is not a JSON list of ints (blank
    lines included); the ids' range and the context are checked against the model (check_prompts)."""
    problem = not_a_file(path)
    if problem is not None:
        raise InputError(f"--prompts {problem}")
    if os.path.getsize(path) > MAX_PROMPTS_BYTES:
        raise InputError(f"--prompts {path!r} is larger than {MAX_PROMPTS_BYTES} bytes")
    prompts = []
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            for number, line in enumerate(f, 1):
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"--prompts line {number}: not JSON ({e.msg})") from None
                if not isinstance(value, list) or not value or not all(type(t) is int for t in value):
                    raise InputError(f"--prompts line {number}: not a non-empty JSON list of token ids (integers)")
                prompts.append(value)
        except UnicodeDecodeError:
            raise InputError(f"--prompts {path!r} is not UTF-8 text") from None
    if not prompts:
        raise InputError(f"--prompts {path!r} holds no prompt")
    return prompts


def run(args: argparse.Namespace) -> int:
    check_output_file(args.out, "--out")
    prompts = read_prompts(args.prompts)
    model = load(args.package, args.provider)
    if not isinstance(model, GenerativeModel):
        model.close()
        raise UsageError(f"{args.package!r} holds one attention layer (attnx build --preset/--config): attnx generate "
                         "serves a whole model's package (attnx build --model)")  # fmt: skip
    finished: dict[int, list[int]] = {}
    progress = Progress()
    start = last = time.perf_counter()
    tokens = 0

    def written_in_order() -> list[str]:
        lines = []
        while len(lines) in finished:
            lines.append(json.dumps(finished[len(lines)]))
        return lines

    def keep_finished() -> str:
        """What Ctrl-C or SIGTERM keeps (attnx._signals runs it): the lines finished in order, written whole."""
        lines = written_in_order()
        write_lines_atomic(args.out, lines)
        return f"kept the first {len(lines)} of {len(prompts)} lines in {args.out} ({len(finished)} finished)"

    def on_finish(request) -> None:
        nonlocal last, tokens
        finished[request.index] = list(request.tokens)
        tokens += len(request.tokens)
        now = time.perf_counter()
        if len(finished) == 1 or now - last >= 5 or len(finished) == len(prompts):
            last = now
            progress(f"{len(finished)}/{len(prompts)} prompts done, {tokens} new tokens, "
                     f"{tokens / max(now - start, 1e-9):.1f} tokens/s")  # fmt: skip

    with model, on_interrupt(keep_finished):
        try:
            model.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos=args.eos,
                           max_batch=args.max_batch, on_finish=on_finish)  # fmt: skip
        except InputError as e:
            raise InputError(str(e).replace("prompt ", "--prompts line ", 1)) from None
        except KeyboardInterrupt:  # a library caller's process: Python's own Ctrl-C, unwound here
            print(keep_finished())
            raise
        write_lines_atomic(args.out, written_in_order())
        stats = model.stats
    print(f"wrote {args.out}: {len(prompts)} lines, {stats.new_tokens} new tokens in {stats.seconds:.2f} s "
          f"({stats.tokens_per_s:.1f} tokens/s, {stats.prefills} prefills, {stats.steps} steps, at most "
          f"{stats.largest_batch} rows at once, the {stats.form} form)")  # fmt: skip
    return 0
