"""A whole model is parsed once per command (issue 52): `attnx optimize`, `attnx audit` and `attnx build --model`
run in-process on a committed fixture with every parse entry point wrapped by a counter (onnx.load /
onnx.load_model, onnx.load_from_string, onnx_ir.load, ModelProto.ParseFromString, shape inference, attnx's own
protobuf reader, and the checkpoint's reader, CheckpointLayers), each parse counted against the file it parsed.

The counts, per command:
- the input model: parsed once (the untrusted-input checks' read, which the command then uses:
  attnx.workflows.audit.whole), and its structure typed once by shape inference;
- the checkpoint: its layers read once (CheckpointLayers: config.json and the sampled projections);
- what attnx itself writes and then proves, counted apart: optimize's output is parsed once (opened once for
  its audit and the whole-model proof) and typed once; the models of one block that choosing a core times, and
  the package's own files that `build --model` goes on to read (the buffer form, the manifest), are not
  asserted.
- ONNX Runtime sessions are not parses of ours: ONNX Runtime parses its own copy from the path (the module doc
  of attnx.workflows.audit.whole says why the path); they are listed in a failure's message, not asserted.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import onnx
import onnx.shape_inference
import onnx_ir
import pytest

import attnx.model.contract
from attnx.cli import main
from attnx.workflows.audit.sources import CheckpointLayers

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SOURCE = FIXTURES / "exported" / "torch-dynamo" / "llama" / "sdpa-opset20" / "model.onnx"
CHECKPOINT = FIXTURES / "genai" / "llama" / "checkpoint"


class Parses:
    """Counts of parses, by (what parsed, which file): the input, the checkpoint, the output (a file named as
    `output`, at its staging path too), "other" (the models attnx writes of one block, the package's files) or
    "bytes" (a parse of bytes held in memory); nested calls (onnx_ir.load's own onnx.load) count once, as the
    outermost."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, source: Path, output: str = "") -> None:
        self.source = os.path.realpath(source)
        self.output = output
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.protos: dict[int, str] = {}  # id of a ModelProto read -> the file it was read from
        self.depth = 0
        for owner, name in ((onnx, "load"), (onnx, "load_model"), (onnx, "load_from_string"), (onnx_ir, "load"),
                            (onnx.ModelProto, "ParseFromString"), (onnx.shape_inference, "infer_shapes_path"),
                            (onnx.shape_inference, "infer_shapes"), (attnx.model.contract, "read_model"),
                            (CheckpointLayers, "__init__")):  # fmt: skip
            monkeypatch.setattr(owner, name, self.counted(getattr(owner, name), name))
        import onnxruntime

        monkeypatch.setattr(onnxruntime, "InferenceSession", self.counted(onnxruntime.InferenceSession, "session"))

    def which(self, name: str, args: tuple) -> str:
        first = args[1] if name in ("ParseFromString", "__init__") else args[0] if args else None
        if name == "__init__":
            return "checkpoint" if os.path.realpath(first) == os.path.realpath(CHECKPOINT) else "another checkpoint"
        if name == "infer_shapes":
            return self.protos.get(id(first), "other")
        if isinstance(first, (str, os.PathLike)):
            if os.path.realpath(first) == self.source:
                return "input"
            return "output" if os.path.basename(first) == self.output else "other"
        return "bytes"

    def counted(self, original, name: str):
        def wrapper(*args, **kwargs):
            self.depth += 1
            try:
                result = original(*args, **kwargs)
            finally:
                self.depth -= 1
            if self.depth == 0:
                which = self.which(name, args)
                self.counts[(name, which)] += 1
                if isinstance(result, onnx.ModelProto):
                    self.protos[id(result)] = which
            return result

        return wrapper

    def of(self, which: str) -> dict[str, int]:
        """{what parsed: how often} of one file (shape inference named "shapes", the checkpoint's reader "layers")."""
        names = {"infer_shapes": "shapes", "infer_shapes_path": "shapes", "__init__": "layers", "session": "session"}
        out: collections.Counter[str] = collections.Counter()
        for (name, file), n in self.counts.items():
            if file == which:
                out[names.get(name, "parse")] += n
        return dict(out)

    def parses(self, which: str) -> dict[str, int]:
        return {k: v for k, v in self.of(which).items() if k != "session"}


def test_optimize_parses_its_input_and_checkpoint_once(monkeypatch, tmp_path):
    parses = Parses(monkeypatch, SOURCE, "out.onnx")
    out = tmp_path / "out.onnx"
    assert main(["optimize", str(SOURCE), "--out", str(out), "--checkpoint", str(CHECKPOINT), "--core", "gqa"]) == 0
    assert out.exists()
    said = sorted(parses.counts.items())
    assert parses.parses("input") == {"parse": 1, "shapes": 1}, said
    assert parses.parses("checkpoint") == {"layers": 1}, said
    # its output, opened once for the audit of its blocks and the whole model's proof
    assert parses.parses("output") == {"parse": 1, "shapes": 1}, said


def test_audit_parses_its_input_and_checkpoint_once(monkeypatch):
    parses = Parses(monkeypatch, SOURCE)
    assert main(["audit", str(SOURCE), "--checkpoint", str(CHECKPOINT)]) == 0
    said = sorted(parses.counts.items())
    assert parses.parses("input") == {"parse": 1, "shapes": 1}, said
    assert parses.parses("checkpoint") == {"layers": 1}, said
    assert not parses.parses("other") and not parses.parses("bytes"), said


def test_build_model_parses_its_input_and_checkpoint_once(monkeypatch, tmp_path):
    parses = Parses(monkeypatch, SOURCE)
    assert main(["build", "--model", str(SOURCE), "--checkpoint", str(CHECKPOINT), "--out", str(tmp_path / "pkg")]) == 0
    said = sorted(parses.counts.items())
    assert parses.parses("input") == {"parse": 1, "shapes": 1}, said
    assert parses.parses("checkpoint") == {"layers": 1}, said


def test_optimize_parses_a_model_attnx_wrote_once(monkeypatch, tmp_path):
    """A model attnx export wrote: the command's one read (its untrusted-input checks) is what optimize_file
    describes and reads the weights from; ONNX Runtime's sessions (parity) read their own copies."""
    source = tmp_path / "tiny.onnx"
    assert main(["export", "--preset", "tiny", "--out", str(source), "--no-validate"]) == 0
    parses = Parses(monkeypatch, source, "out.onnx")
    assert main(["optimize", str(source), "--out", str(tmp_path / "out.onnx")]) == 0
    said = sorted(parses.counts.items())
    assert parses.parses("input") == {"parse": 1}, said
