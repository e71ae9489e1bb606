"""attnx serve: the OpenAI API (completions, chat, streaming) over a whole model's package, verified before it listens
(attnx.serve)."""

from __future__ import annotations

import argparse
import importlib.util

from attnx.commands import COMMANDS
from attnx.commands._common import Progress, int_arg
from attnx.errors import UsageError
from attnx.model.contract import PROVIDERS
from attnx.runtimes.engine_loop import PREFILL_CHUNK
from attnx.serve._ray import need_ray, serve_on_ray  # Ray itself is imported inside, where --ray asks for it

HELP = COMMANDS["serve"].help
SERVE_EXTRA = ("fastapi", "uvicorn", "tokenizers", "jinja2", "prometheus_client")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help=HELP, description=HELP + ". It listens once the package verified and loaded; "
                       "SIGTERM stops accepting and drains. Exit 1: the package failed verify; 2: bad usage; 130/143: "
                       "ended by Ctrl-C/SIGTERM once drained.")  # fmt: skip
    p.add_argument("package", metavar="PKG", help="a whole model's package (attnx build --model)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int_arg(0, 65535), default=8000, help="the port (default 8000; 0: a free one)")
    p.add_argument("--max-batch", type=int_arg(1), default=None, metavar="N", help="rows decoded at once: requests "
                   "join and leave between steps (default 16, within half the memory available)")
    p.add_argument("--max-queue", type=int_arg(1), default=64, metavar="N", help="requests waiting to join the "
                   "batch; past it a request is answered 429 with Retry-After (default 64)")
    p.add_argument("--max-model-len", type=int_arg(2), default=None, metavar="N", help="positions a request's prompt "
                   "and new tokens may fill, below the model's context (default: its context); the buffer form's "
                   "cache is sized for it")
    p.add_argument("--prefill-chunk", type=int_arg(0), default=PREFILL_CHUNK, metavar="N", help="prompt tokens "
                   "prefilled a step, at most: a long prompt goes in over several steps, between the steps of the "
                   f"rows decoding (default {PREFILL_CHUNK}; 0: each prompt whole as it joins)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's id in the API (default: the package folder's name)")
    p.add_argument("--grace", type=_seconds, default=30.0, metavar="S", help="on SIGTERM, seconds the "
                   "running requests get to finish before the rest end with finish_reason abort (default 30)")
    p.add_argument("--provider", choices=list(PROVIDERS), default="cpu", help="execution provider (default cpu)")
    ray = p.add_argument_group("replicas on Ray Serve (the serve-ray extra)")
    ray.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDR", help="deploy the package's "
                     "replicas on Ray Serve behind one endpoint: local (alone: a cluster started here for the "
                     "command), auto, or HOST:PORT of a running cluster; every node reads PKG at the same absolute "
                     "path and each replica verifies it where it lands")  # fmt: skip
    ray.add_argument("--replicas", type=int_arg(1), default=None, metavar="N", help="replicas with --ray (default 1)")
    ray.add_argument("--replica-cpus", type=_cpus, default=None, metavar="C", help="CPUs each replica holds on its "
                     "node, and its onnxruntime threads, with --ray (default 1)")  # fmt: skip
    p.set_defaults(run=run)


def _seconds(text: str) -> float:
    """An argparse type: seconds, from 0 to an hour."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"expected seconds from 0 to 3600, got {text!r}")
    return value


def _cpus(text: str) -> float:
    """An argparse type: a replica's CPUs, a positive number (fractions share a CPU)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of CPUs, got {text!r}") from None
    if not 0 < value <= 1024:
        raise argparse.ArgumentTypeError(f"expected CPUs above 0, at most 1024, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    missing = [m for m in SERVE_EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"attnx serve needs {', '.join(missing)}: pip install 'attnx[serve]'")
    progress = Progress()
    if args.ray is None:
        for flag, value in (("--replicas", args.replicas), ("--replica-cpus", args.replica_cpus)):
            if value is not None:
                raise UsageError(f"{flag} deploys replicas on Ray Serve: give it with --ray")
    else:
        need_ray()
        return serve_on_ray(args.package, args.ray, replicas=args.replicas or 1, replica_cpus=args.replica_cpus or 1.0,
                            host=args.host, port=args.port, provider=args.provider, max_batch=args.max_batch,
                            max_queue=args.max_queue, max_model_len=args.max_model_len,
                            prefill_chunk=args.prefill_chunk or None, name=args.served_model_name,
                            grace_s=args.grace, progress=progress,
                            on_listening=lambda url: progress(f"serving {url}/v1 on Ray Serve (Ctrl-C or SIGTERM to "
                                                              "stop)"))  # fmt: skip
    from attnx.serve.server import serve_package

    return serve_package(args.package, host=args.host, port=args.port, provider=args.provider,
                         max_batch=args.max_batch, max_queue=args.max_queue, max_model_len=args.max_model_len,
                         prefill_chunk=args.prefill_chunk or None, name=args.served_model_name, grace_s=args.grace, progress=progress,
                         on_listening=lambda url: progress(f"serving {url}/v1 (Ctrl-C or SIGTERM to stop)"))  # fmt: skip
