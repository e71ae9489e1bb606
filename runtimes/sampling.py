"""How a token is chosen from a row's logits (Sampling): greedy, or transformers' logits processors in order
(temperature, top-k, top-p, each a small function testable alone) and one draw from the request's own seeded
generator. What attnx generate's Engine and attnx serve's EngineLoop apply to each row (attnx.runtimes.generate)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from attnx.errors import UsageError

__all__ = ["Sampling", "top_k", "top_p"]


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a token is chosen from a row's logits: greedy (temperature 0, the default), else transformers' processors
    in order (temperature, top-k, top-p) and one draw from the request's generator, seeded by (seed, its index) so
    that a request draws the same tokens whatever shares its batch."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise UsageError(f"--temperature {self.temperature}: must be 0 (greedy) or more")
        if self.top_k is not None and self.top_k < 1:
            raise UsageError(f"--top-k {self.top_k}: must be 1 or more")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p {self.top_p}: must be in (0, 1]")
        if self.temperature == 0 and (self.top_k is not None or self.top_p is not None):
            raise UsageError("--top-k and --top-p choose among tokens to sample: give a --temperature above 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def processors(self) -> list[Callable[[np.ndarray], np.ndarray]]:
        """The logits processors of a sampled choice, in the order they apply (float64 logits in and out)."""
        out: list[Callable[[np.ndarray], np.ndarray]] = [lambda x: x / self.temperature]
        if self.top_k is not None:
            out.append(lambda x, k=self.top_k: top_k(x, k))
        if self.top_p is not None:
            out.append(lambda x, p=self.top_p: top_p(x, p))
        return out

    def choose(self, logits: np.ndarray, rng: np.random.Generator | None) -> int:
        """The token of one row's logits [V]."""
        if self.greedy:
            return int(np.argmax(logits))
        x = np.asarray(logits, np.float64)
        for process in self.processors():
            x = process(x)
        p = np.exp(x - x.max())
        p /= p.sum()
        return int(np.searchsorted(np.cumsum(p), rng.random() * (1 - 1e-12), side="right").clip(0, len(p) - 1))


def top_k(x: np.ndarray, k: int) -> np.ndarray:
    """The k largest logits kept, the rest -inf (ties at the k-th all kept, as transformers' TopKLogitsWarper)."""
    if k >= x.shape[-1]:
        return x
    kth = np.partition(x, -k)[-k]
    return np.where(x < kth, -np.inf, x)


def top_p(x: np.ndarray, p: float) -> np.ndarray:
    """The smallest set of most likely tokens whose probabilities reach p kept, the rest -inf (transformers'
    TopPLogitsWarper: the most likely token always kept)."""
    order = np.argsort(-x, kind="stable")
    probs = np.exp(x[order] - x[order[0]])
    probs /= probs.sum()
    keep = np.cumsum(probs) - probs < p  # a token is kept while the ones before it have not reached p
    out = np.full_like(x, -np.inf)
    out[order[keep]] = x[order[keep]]
    return out
