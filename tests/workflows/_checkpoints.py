"""Hugging Face checkpoints for the import tests (test_import.py, test_import_llm.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def save_wide(root: Path, makers: Mapping[str, Callable[[], Any]]) -> dict[str, str]:
    """{name: folder} of each maker's model saved under `root`, every weight drawn wide (std 0.5, not
    the 0.02 of a fresh model): peaked attention, so that a wrong mapping, scale, window or rotation
    shows in the check. Seeded alike for every model."""
    import torch

    out = {}
    for name, make in makers.items():
        torch.manual_seed(3)
        model = make()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.5)
        model.save_pretrained(root / name)
        out[name] = str(root / name)
    return out
