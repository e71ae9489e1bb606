"""`reference`: the numpy float64 formula of the README ("The model")."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from attnx.model.contract import host_dtype
from attnx.model.reference import reference_attention
from attnx.runtimes.base import Runner, register_backend, require_source

__all__ = ["ReferenceRunner"]


@register_backend("reference")
class ReferenceRunner(Runner):
    def load_impl(self) -> None:
        require_source(self, config=True, weights=True)
        cfg = self.source.config
        self.inputs = cfg.inputs(host_dtype(self.source.dtype))  # a bf16 run's inputs are float32
        self.outputs = [s.__class__(s.name, "fp64", s.shape) for s in cfg.outputs()]

    def run_impl(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = reference_attention(
            self.source.config,
            self.source.weights,
            feeds["x"],
            memory=feeds.get("memory"),
            key_padding_mask=feeds.get("key_padding_mask"),
            past_key=feeds.get("past_key"),
            past_value=feeds.get("past_value"),
            position_ids=feeds.get("position_ids"),
        )
        if self.source.config.kv_cache:  # the step model: y, present_key, present_value
            return dict(zip(("y", "present_key", "present_value"), out))
        return {"y": out}
