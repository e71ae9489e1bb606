"""`attnx audit`: the attention blocks of a whole model another tool exported, each read back
(attnx.export._blocks), cut out of the graph at its own tensors, run on each backend asked and held against attnx's
float64 reference; with a Hugging Face checkpoint (or, for a model attnx wrote, its attnx.config), each block is
paired with the source's layer by its weights' values (never by names) and every term that differs is a finding.

Each block is cut at its hidden state, with the graph inputs its mask, lengths and rotary are computed from
(attention_mask, position_ids: fed as transformers makes them; _compute_in_cut), and runs a full sequence, a padded
batch in its convention (right padding for GroupQueryAttention and a mask_index, left for transformers' masks), then a
prefill and single-token steps through the model's own cache inputs: its output against the reference of the
source's layer (or, without one, of the layer read from the graph) under the tolerance table. A failing block is
localised to its first stage (_localise). A MatMulNBits graph is held against the model as it computes: its
dequantized weights, and at accuracy_level 4 its projections' inputs in int8 blocks (int8_blocks), y held to either
rounding of z where the kernel's own z may fall on the other side of a midpoint (requantization_slack). The whole model's
decoding is run once (_decode_whole). The model is untrusted input: it is checked before anything parses it
(attnx.runtimes._untrusted.check_untrusted_model: external data inside its folder, sizes, cycles, domains).

The pieces: whole (the model opened once, and the reading of its blocks that attnx optimize shares), shapes (what
the model's dims allow), sources (what a block is held to), compare (its terms against its source's), cut (a block
out of its model, and what the graph computes for it), run (a block on a backend, its checks, its localisation; the
whole model's decoding), report (the verdicts), audit (audit_model).
"""

from __future__ import annotations

from attnx.model.contract import AUDIT_BACKENDS
from attnx.workflows.audit.audit import audit_model
from attnx.workflows.audit.report import AuditReport, BlockAudit
from attnx.workflows.audit.shapes import AUDIT_SHAPE
from attnx.workflows.audit.sources import CheckpointLayers

__all__ = ["AUDIT_BACKENDS", "AUDIT_SHAPE", "AuditReport", "BlockAudit", "CheckpointLayers", "audit_model"]
