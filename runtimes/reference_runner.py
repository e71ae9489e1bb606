"""`reference`: the numpy float64 formula of docs/concepts/formula.md."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from attnx.model.contract import host_dtype
from attnx.model.reference import reference_attention
from attnx.runtimes.base import Runner, register_backend, require_source

__all__ = ["ReferenceRunner"]


@register_backend("reference")
class ReferenceRunner(Runner):
    # A dict: the next runs record there every stage of the formula the reference computes anyway
    # (attnx.model.stages; scores and probs not: they would cost a second pass over the keys), as the
    # torch module's `stages` does; a localisation of the case reuses them. None: nothing is kept.
    stages: dict[str, np.ndarray] | None = None

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
            stages=self.stages,
            core_stages=False,
            past_latent=feeds.get("past_latent"),
        )
        if self.source.config.kv_cache:  # the step model: y, present_key, present_value (present_latent)
            return dict(zip(("y", *(s.name for s in self.source.config.cache_specs(prefix="present_"))), out))
        return {"y": out}
