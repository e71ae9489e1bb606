"""What each block is held to: a Hugging Face checkpoint's layer (CheckpointLayers, paired by the values of its
projections, imported one layer at a time) or the attnx.config of a model attnx wrote (StatedConfig)."""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from attnx.model.config import AttentionConfig
from attnx.model.contract import CONFIG_KEY, config_from_metadata
from attnx.model.families import ROTARY_FAMILIES
from attnx.model.importers import PROJECTIONS, import_weights, projection_shape, read_checkpoint_config, read_projection
from attnx.model.terms import reach_of
from attnx.workflows.audit.report import AuditReport

__all__ = ["CheckpointLayers", "StatedConfig", "pairing_findings", "stated_config"]


class CheckpointLayers:
    """A checkpoint's layers as the audit needs them, one at a time: each layer's four projections kept only as a
    sample of their rows (each read alone, read_projection), which pairs a block with its layer by value; the
    paired layer's attention imported (import_weights) when its block is checked, and dropped after. So a
    checkpoint larger than memory is held a layer at a time, plus the samples (at most SAMPLE_ROWS rows of each
    projection per layer)."""

    SAMPLE_ROWS = 32
    # a sampled row matches a block's when it is within this fraction of its largest |value|: int4's half step is
    # 1/14 of its block's largest, fp16's 1e-3; another layer's row differs by about all of it
    MATCH = 0.25
    label = "the checkpoint"  # as findings name it

    def __init__(self, folder: str) -> None:
        hf = read_checkpoint_config(folder)
        # how far a computed term is read (read_mask_terms, read_computed_terms): a window, a chunk, the length over
        # which a temperature's factor first moves (twice its floor_scale: Llama 4's)
        self.reach = max(int(hf.get("sliding_window") or 0), int(hf.get("attention_chunk_size") or 0),
                         2 * int(hf.get("floor_scale") or 0) + 2 if hf.get("attn_temperature_tuning") else 0)  # fmt: skip
        self.rope_original = original_length(hf)  # where a computed rotary table is read (read_computed_terms)
        # the positions the model has (a table read past them is no time: attnx.workflows.rewrite.choose)
        self.max_positions = int(hf.get("max_position_embeddings") or hf.get("n_positions") or 0) or None
        n_layers = int(hf.get("num_hidden_layers") or hf.get("n_layer") or 0)
        self.folder = folder
        # layer -> attnx's weight name -> (the projection's shape, the rows sampled, their values)
        self.samples: dict[int, dict[str, tuple[tuple[int, ...], np.ndarray, np.ndarray]]] = {}
        family = ROTARY_FAMILIES.get(hf.get("model_type")) if isinstance(hf.get("model_type"), str) else None
        # multi-head latent attention has no q, k and v projections: its layers are paired by o_proj alone
        roles = {"o": PROJECTIONS["o"]} if family is not None and family.latent else PROJECTIONS
        for i in range(n_layers):
            self.samples[i] = {}
            for role, name in roles.items():
                shape = projection_shape(folder, i, role)
                rows = self._rows(shape[0])
                self.samples[i][name] = (tuple(shape), rows, read_projection(folder, i, role, rows))

    def _rows(self, n: int) -> np.ndarray:
        """The rows sampled of a projection of n rows: all of a small one, else evenly spread."""
        return np.unique(np.linspace(0, n - 1, min(n, self.SAMPLE_ROWS)).round().astype(np.int64))

    def pair(self, weights: dict[str, np.ndarray]) -> int | None:
        """The layer whose projections match the block's `weights` on the most sampled rows (never names), so that a
        fault in one projection of a layer (its heads permuted, its rows scaled) still pairs the block with its own
        layer; layers tied on those counts are told apart by their rows' errors, then by their whole q projections.
        None where no layer has a projection of the block's shapes."""

        def errors(theirs: np.ndarray, ours: np.ndarray) -> np.ndarray:  # each row's, relative to its largest value
            theirs = np.asarray(theirs, np.float64)
            scale = np.maximum(np.abs(theirs).max(axis=-1), 1e-30)
            return np.abs(theirs - np.asarray(ours, np.float64)).max(axis=-1) / scale

        scores: dict[int, tuple[int, float]] = {}
        for i, sampled in self.samples.items():
            matched, total, compared = 0, 0.0, False
            for name, (shape, rows, sample) in sampled.items():
                ours = weights.get(name)
                if ours is None or tuple(ours.shape) != shape:
                    continue
                e = errors(sample, np.asarray(ours)[rows])
                matched, total, compared = matched + int((e <= self.MATCH).sum()), total + float(e.sum()), True
            if compared:
                scores[i] = (-matched, total)
        if not scores:
            return None
        best = min(scores.values())
        tied = [i for i, score in scores.items() if score == best]
        if len(tied) == 1 or "q_proj.weight" not in self.samples[tied[0]] or "q_proj.weight" not in weights:
            return tied[0]  # (a latent layer's, sampled by o_proj alone: tied where their o_proj rows tie)
        q = weights["q_proj.weight"]
        shape, rows, _ = self.samples[tied[0]]["q_proj.weight"]
        if tuple(q.shape) != shape or len(rows) == q.shape[0]:
            return tied[0]
        return min(tied, key=lambda i: float(errors(read_projection(self.folder, i, "q"), q).max()))

    def layer(self, i: int) -> Any:
        """Layer i's attention, imported now (an ImportResult)."""
        return import_weights(self.folder, layer=i)


def original_length(hf: dict[str, Any]) -> int:
    """A checkpoint's original_max_position_embeddings, wherever its config.json keeps it (top level, rope_scaling,
    rope_parameters, or rope_parameters per layer type), or 0."""
    found = [hf.get("original_max_position_embeddings")]
    for key in ("rope_scaling", "rope_parameters"):
        params = hf.get(key)
        if isinstance(params, dict):
            found += [params.get("original_max_position_embeddings")]
            found += [p.get("original_max_position_embeddings") for p in params.values() if isinstance(p, dict)]
    return max((int(v) for v in found if isinstance(v, int) and not isinstance(v, bool)), default=0)


class StatedConfig:
    """The source of a model attnx wrote: the config its metadata states (attnx.config), with the block's own
    weights (one block), in CheckpointLayers' interface."""

    label = "its attnx.config"

    def __init__(self, config: AttentionConfig, weights: dict[str, np.ndarray]) -> None:
        self.config, self.weights = config, weights
        self.reach = reach_of(config) or 0
        scaling = config.rope.scaling.to_dict() if config.rope is not None and config.rope.scaling else {}
        self.rope_original = int(scaling.get("original_max_position_embeddings") or 0)

    def pair(self, weights: dict[str, np.ndarray]) -> int:
        return 0

    def layer(self, i: int) -> Any:
        return types.SimpleNamespace(config=self.config, weights=self.weights)


def stated_config(structure: Any) -> AttentionConfig | None:
    """The AttentionConfig a model attnx wrote states in its metadata (attnx.config), or None."""
    metadata = {p.key: p.value for p in structure.metadata_props}
    if CONFIG_KEY not in metadata:
        return None
    return config_from_metadata(metadata, "the model's attnx.config")


def pairing_findings(report: AuditReport, source: CheckpointLayers, whole: bool) -> None:
    """Each checkpoint layer paired with one block, and (auditing them all) every layer with one: a block that is
    another layer's copy, or a layer the graph left out, is a finding."""
    paired: dict[int, list[int]] = {}
    for b in report.blocks:
        if b.layer is not None:
            paired.setdefault(b.layer, []).append(b.index)
    for layer, blocks in sorted(paired.items()):
        if len(blocks) > 1:
            report.findings.append(f"blocks {', '.join(map(str, blocks))} all pair with checkpoint layer {layer}: the "
                                   "graph holds one layer's weights more than once")  # fmt: skip
    missing = sorted(set(source.samples) - set(paired))
    if whole and missing:
        report.findings.append(f"checkpoint layer(s) {', '.join(map(str, missing))}: no block of the graph pairs with "
                               "them")  # fmt: skip
