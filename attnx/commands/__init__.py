"""One module per `attnx` subcommand: add_parser(subparsers) and run(args) -> exit code.

COMMANDS is the table the CLI reads, in the order `attnx --help` lists them: each command's module
and its one-line help. The CLI imports the module of the command it runs and no other (attnx.cli):
a module brings what its command needs (bench its harness, export onnx-ir), and the deployment
commands (verify, run, inspect) start without what the others need.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Command", "COMMANDS"]


@dataclasses.dataclass(frozen=True)
class Command:
    module: str  # attnx.commands.<module>
    help: str
    # Whether it may start ONNX Runtime: the CLI then sets ORT's C++ log to errors first, which
    # imports onnxruntime (measurements/inspect_startup.md); inspect reads files alone and starts without it.
    runs_ort: bool = True


COMMANDS: dict[str, Command] = {
    "import": Command("importer", "import one attention layer of a Hugging Face checkpoint (safetensors) as attnx's config and weights"),
    "export": Command("export", "export the model to ONNX (dynamic batch and sequence axes), then check it"),
    "optimize": Command("optimize", "lower an exported model's attention (ort-fused, auto, fp16), check parity, then write it"),
    "parity": Command("parity", "compare backends (torch, ONNX Runtime, reference) case by case"),
    "bench": Command("bench", "time backends x lowerings x shapes: latency, tokens/s, GFLOP/s, roofline ratio, peak memory"),
    "build": Command("build", "export, check and package the model: a folder that verifies itself on the deployment machine"),
    "verify": Command("verify", "check a package here: file hashes, onnxruntime can load it, golden outputs within tolerance"),
    "run": Command("run", "run an ONNX model or a package on .npy inputs"),
    "generate": Command("generate", "serve a whole model's package: token ids in (JSON lines), new token ids out, "
                        "requests of any length batched together"),
    "serve": Command("serve", "serve a whole model's package over the OpenAI API (completions, chat, streaming), "
                     "verified before it listens"),
    "inspect": Command("inspect", "describe a model or a package: config, lowering, dtype, inputs, outputs, opset, operators",
                       runs_ort=False),
    "audit": Command("audit", "check every attention block of a whole exported model against the reference and its checkpoint"),
    "matrix": Command("matrix", "run a plan's parity / verify / bench / audit cases here or on a Ray cluster, into one report"),
}  # fmt: skip
