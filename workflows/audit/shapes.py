"""The shapes the audit feeds a model: its own dims where it fixes them, AUDIT_SHAPE's where they are dynamic."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["AUDIT_SHAPE", "Shapes", "model_shapes"]

# (full-sequence tokens, prefill tokens, single steps): past an 8-token window, within a 128-row rope table;
# the padded batch's last row is `padding` tokens shorter
AUDIT_SHAPE = {"tokens": 12, "prefill": 9, "steps": 3, "batch": 2, "padding": 3, "rope_positions": 128}


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The shapes the audit feeds a model: AUDIT_SHAPE's where the model's dims are dynamic, the model's own where
    it fixes them (model_shapes), so that every run is one the model's dims allow."""

    batch: int
    tokens: int  # a full sequence's
    prefill: int | None  # decoding: a prefill of this many tokens, then single steps to `tokens`; None: none fits
    fixed: dict[str, str] = dataclasses.field(default_factory=dict)  # batch/sequence/cache -> the input fixing it
    padding: int = AUDIT_SHAPE["padding"]  # the padded batch's last row is this many tokens shorter

    @property
    def padded(self) -> bool:
        """Whether a padded batch fits: two rows or more, and a row shorter than the sequence."""
        return self.batch >= 2 and self.tokens > self.padding

    def not_applicable(self, decoding: bool = True) -> list[str]:
        """The checks the model's dims rule out, each with the dim and the input that fixes it; decoding: whether the
        model decodes at all (has a cache), else a fixed sequence rules out no decoding check."""
        lines = []
        if self.batch < 2:
            lines.append(f"a padded batch: the model's batch is fixed at {self.batch} ({self.fixed['batch']})")
        elif not self.padded:
            lines.append(f"a padded batch: the model's sequence is fixed at {self.tokens} tokens "
                         f"({self.fixed['sequence']}), too short to pad a row by {self.padding}")  # fmt: skip
        if "sequence" in self.fixed and decoding:
            lines.append(f"decoding step by step: the model's sequence is fixed at {self.tokens} tokens "
                         f"({self.fixed['sequence']}), so no single-token step can be fed")  # fmt: skip
        return lines


# graph inputs whose first dim is the batch; whose second is the sequence (the tokens of this call); a cache's third
_BATCH_FIRST = ("x", "memory", "input_ids", "attention_mask", "position_ids", "token_type_ids", "key_padding_mask")


_SEQUENCE_SECOND = ("x", "input_ids", "position_ids", "token_type_ids")


def model_shapes(model: Any) -> Shapes:
    """The shapes a model's own graph inputs allow (a batch or a sequence fixed by its dims, say by a torch.onnx
    export whose batch was not made dynamic), else AUDIT_SHAPE's."""

    def said(value: Any) -> str:
        return f"input {value.name} [{', '.join(str(d) for d in value.shape)}]"

    fixed: dict[str, str] = {}
    batch = tokens = None
    caches = [v for v in model.graph.inputs if v.name.startswith("past")]
    for value in model.graph.inputs:
        dims = list(value.shape) if value.shape is not None else []
        cache = value in caches
        if not dims or not (value.name in _BATCH_FIRST or cache):
            continue
        if isinstance(dims[0], int) and batch is None:
            batch, fixed["batch"] = dims[0], said(value)
        sequence = 1 if value.name in _SEQUENCE_SECOND or (value.name == "attention_mask" and not caches) else None
        if sequence is not None and len(dims) > sequence and isinstance(dims[sequence], int) and tokens is None:
            tokens, fixed["sequence"] = dims[sequence], said(value)
        if cache and len(dims) == 4 and isinstance(dims[2], int) and "cache" not in fixed:
            fixed["cache"] = said(value)
        if value.name == "attention_mask" and caches and isinstance(dims[1], int) and "cache" not in fixed:
            fixed["cache"] = said(value)  # a total length fixed: a static cache
    prefill = AUDIT_SHAPE["prefill"] if tokens is None and "cache" not in fixed else None
    return Shapes(batch if batch is not None else AUDIT_SHAPE["batch"],
                  tokens if tokens is not None else AUDIT_SHAPE["tokens"], prefill, fixed)  # fmt: skip
