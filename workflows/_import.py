"""`attnx import`: one attention layer of a model people have, into attnx's contract (a folder with
config.json and weights.safetensors), and its check against the source model.

The check runs the source's own attention module (torch; Hugging Face's classes through
transformers, with its eager attention) on seeded inputs and masks, and compares its output with
attnx's float64 reference of the imported weights under the tolerance table: the mapping is right
when they agree. It also runs attnx's exported model (each lowering asked for) against the same
reference. Rows whose keys are all hidden are left out of the comparison with the source: attnx
gives the output bias there (z = 0), while Hugging Face's eager attention averages every value
(a softmax over equal masked scores) and torch's nn.MultiheadAttention fast path gives NaN.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from attnx.errors import CheckFailed, UsageError
from attnx.model.config import AttentionConfig
from attnx.model.importers import ImportResult, check_import_target, import_weights, write_import
from attnx.model.inputs import make_inputs
from attnx.model.reference import reference_attention
from attnx.model.tolerance import problem_size, tolerance_for
from attnx.runtimes import ModelSource, create_runner
from attnx.runtimes.compare import Comparison, compare_arrays
from attnx.workflows._export import export_model

__all__ = ["ImportReport", "import_model", "check_against_source", "CHECK_SHAPE"]

# (batch, seq, mem_seq) the check runs at: make_inputs' padding mask hides every key of batch
# element 1 (left out of the comparison with the source, see above) and some of the others'.
CHECK_SHAPE = (3, 7, 5)


@dataclasses.dataclass
class ImportReport:
    result: ImportResult
    out: str | None
    files: list[str]
    checks: list[Comparison]

    @property
    def passed(self) -> bool:
        return all(self.checks)


def import_model(
    source: Any,
    out: str | os.PathLike[str] | None,
    *,
    layer: int = 0,
    attention: str = "self",
    stack: str | None = None,
    key_padding_mask: bool | None = None,
    check: bool = False,
    lowerings: Sequence[str] = ("decomposed",),
    force: bool = False,
    progress: Callable[[str], None] = lambda msg: None,
) -> ImportReport:
    """Import, check (with check) and write the attnx folder `out` (config.json,
    weights.safetensors; attnx.model.importers.write_import), published only once the check
    passed. CheckFailed (exit 1) when the import disagrees with its source: nothing is written."""
    if out is not None:
        check_import_target(os.fspath(out), force)
    progress(f"reading {source if isinstance(source, (str, os.PathLike)) else type(source).__name__}")
    result = import_weights(source, layer=layer, attention=attention, stack=stack, key_padding_mask=key_padding_mask)
    checks = check_against_source(result, source, lowerings, progress) if check else []
    failed = [c for c in checks if not c]
    if failed:
        raise CheckFailed("the import disagrees with its source, nothing written: " + "; ".join(map(str, failed[:3])))
    files = write_import(result, out, force=force) if out is not None else []
    return ImportReport(result, None if out is None else os.fspath(out), files, checks)


def check_against_source(
    result: ImportResult,
    source: Any,
    lowerings: Sequence[str] = ("decomposed",),
    progress: Callable[[str], None] = lambda msg: None,
) -> list[Comparison]:
    """The source module and attnx's exported model (each lowering), each against attnx's float64
    reference of the imported weights, on the same seeded inputs and masks."""
    config, weights = result.config, result.weights
    batch, seq, mem_seq = CHECK_SHAPE
    feeds = make_inputs(config, batch, seq, mem_seq if config.cross else None, seed=11)
    ref = reference_attention(config, weights, **feeds)
    size = problem_size(config, weights, feeds)
    tol = tolerance_for("fp32")
    keep = _visible_rows(config, feeds)
    progress(f"running the source module ({result.architecture or 'torch'}) on the check inputs")
    theirs = _source_outputs(result, source, feeds)
    checks = [compare_arrays("source module vs attnx reference (rows with a visible key)", theirs[keep], ref[keep],
                             tol, size)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="attnx-import-check-") as tmp:
        for lowering in lowerings:
            progress(f"exporting and running the {lowering} lowering")
            path = os.path.join(tmp, f"{lowering}.onnx")
            export_model(config, path, weights, attention=lowering, validate=False)
            with create_runner("ort-cpu", ModelSource(config, None, path)) as runner:
                ours = runner.run(feeds)["y"]
            checks.append(compare_arrays(f"attnx {lowering} model vs attnx reference", ours, ref, tol, size))
    return checks


def _visible_rows(config: AttentionConfig, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """[batch, seq] True where query i sees at least one key."""
    batch, seq = feeds["x"].shape[:2]
    keys = feeds["memory"].shape[1] if config.cross else seq
    hidden = np.zeros((batch, seq, keys), dtype=bool)
    if config.causal:
        hidden |= np.triu(np.ones((seq, keys), dtype=bool), 1)[None]
    if "key_padding_mask" in feeds:
        hidden |= feeds["key_padding_mask"][:, None, :]
    return ~hidden.all(axis=-1)


def _source_outputs(result: ImportResult, source: Any, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import torch

    config = result.config
    x = torch.from_numpy(feeds["x"])
    memory = torch.from_numpy(feeds["memory"]) if config.cross else None
    kpm = torch.from_numpy(feeds["key_padding_mask"]) if "key_padding_mask" in feeds else None
    with torch.inference_mode():
        if not isinstance(source, (str, os.PathLike)):  # an nn.MultiheadAttention
            m = memory if memory is not None else x
            causal = torch.triu(torch.ones(x.shape[1], m.shape[1], dtype=torch.bool), 1) if config.causal else None
            y, _ = source(x if source.batch_first else x.transpose(0, 1),
                          m if source.batch_first else m.transpose(0, 1), m if source.batch_first else m.transpose(0, 1),
                          key_padding_mask=kpm, attn_mask=causal, need_weights=False)  # fmt: skip
            return (y if source.batch_first else y.transpose(0, 1)).numpy()
        return _hugging_face_outputs(result, os.fspath(source), x, memory, kpm).numpy()


def _hugging_face_outputs(result: ImportResult, folder: str, x: Any, memory: Any, kpm: Any) -> Any:
    """The attention block of `result` in the checkpoint's own transformers classes (eager)."""
    import torch

    try:
        import transformers
    except ImportError:
        raise UsageError("--check runs the source model, which needs transformers: pip install transformers") from None
    model = transformers.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    # The additive mask every eager attention takes, [batch, 1, queries, keys]: 0 sees, lowest hides.
    keys = memory.shape[1] if memory is not None else x.shape[1]
    hidden = torch.zeros(x.shape[0], 1, x.shape[1], keys, dtype=torch.bool)
    if result.config.causal:
        hidden |= torch.triu(torch.ones(x.shape[1], keys, dtype=torch.bool), 1)
    if kpm is not None:
        hidden |= kpm[:, None, None, :]
    mask = torch.zeros(hidden.shape).masked_fill(hidden, torch.finfo(torch.float32).min)
    n, kind = result.layer, result.architecture
    if kind in ("bert", "roberta"):
        block = model.encoder.layer[n].attention
        return block.output.dense(block.self(x, attention_mask=mask)[0])
    if kind == "vit":
        if hasattr(model, "layers"):  # transformers 5: layers[n].attention holds q/k/v/o_proj
            return model.layers[n].attention(x)[0]
        block = model.encoder.layer[n].attention  # earlier: attention.attention, attention.output.dense
        return block.output.dense(block.attention(x)[0])
    if kind == "gpt2":
        return model.h[n].attn(x, attention_mask=mask)[0]
    if kind in ("bart", "whisper"):
        stack = model.encoder if result.stack == "encoder" else model.decoder
        block = stack.layers[n].encoder_attn if result.attention == "cross" else stack.layers[n].self_attn
        return block(x, key_value_states=memory, attention_mask=mask)[0]
    if kind == "t5":
        block = model.decoder.block[n].layer[1].EncDecAttention
        return block(x, mask=mask, key_value_states=memory)[0]
    raise UsageError(f"--check has no way to run {kind!r} modules")  # pragma: no cover - the table and this agree
