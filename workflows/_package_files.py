"""What a package holds besides its model, written by `attnx build` (workflows._build): golden cases (inputs and the
reference's float64 outputs, a step model's golden decode), the manifest (every file's size and sha256, the parity
summary, the versions), parity.md; and the runners that record the reference half of a check and replay it to the
ONNX Runtime half (the weights and a session never live at once)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import zipfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from attnx import __version__
from attnx.errors import CheckFailed
from attnx.model.config import AttentionConfig
from attnx.model.contract import (
    BACKEND_NAMES,
    PROVIDERS,
    QUANTIZATIONS,
    REFERENCE,
    describe,
    float_dtype,
    quantization_of,
)
from attnx.model.inputs import make_inputs
from attnx.model.tolerance import problem_size
from attnx.runtimes.base import ModelSource, Runner, create_runner
from attnx.runtimes.decode import decode_sequence, empty_cache, make_decode_inputs
from attnx.runtimes.package import FORMAT, LAYER_FORMAT_VERSION, MANIFEST, MANIFEST_SUM, file_sha256
from attnx.runtimes.parity import ParityCase, ParityReport

__all__ = ["GOLDEN_SEED", "MODEL_FILE", "PARITY_JSON", "PARITY_MD", "RecordingRunner", "ReplayRunner", "manifest_of",
           "parity_markdown", "write_golden", "write_golden_decode", "write_json", "write_npz"]


MODEL_FILE = "model.onnx"


PARITY_JSON = "parity.json"


PARITY_MD = "parity.md"


GOLDEN_SEED = 1000  # golden inputs are drawn apart from parity's (seeds 0, 1, ...)


STEP_GOLDEN = {"prefill": 5, "steps": 4, "batch": 2}


# Files -----------------------------------------------------------------------------------
def write_npz(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray]) -> None:
    """An .npz that np.load reads, written byte-for-byte reproducibly: numpy's own savez
    stamps each member with the current time. No pickles (allow_pickle=False)."""
    with open(path, "wb") as f, zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            with zf.open(info, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.ascontiguousarray(array), allow_pickle=False)


def write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True, allow_nan=False)
        f.write("\n")


def feeds_key(feeds: Mapping[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(feeds):
        array = np.ascontiguousarray(feeds[name])
        digest.update(f"{name}:{array.dtype.str}:{list(array.shape)};".encode())
        digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


class RecordingRunner(Runner):
    """The reference backend, its outputs kept by the digest of the inputs they came from."""

    def __init__(self, inner: Runner, record: dict[str, np.ndarray]) -> None:
        super().__init__(inner.source)
        self.name = inner.name
        self.inner = inner
        self.record = record

    def load_impl(self) -> None:
        self.inner.load()
        self.inputs, self.outputs = self.inner.inputs, self.inner.outputs

    def run_impl(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self.inner.run(feeds)
        self.record[feeds_key(feeds)] = out["y"]
        return out

    def close_impl(self) -> None:
        self.inner.close()


class ReplayRunner(Runner):
    """The reference backend's recorded outputs, given back for the same inputs."""

    def __init__(self, source: ModelSource, record: Mapping[str, np.ndarray]) -> None:
        super().__init__(source)
        self.name = REFERENCE
        self.record = record

    def load_impl(self) -> None:
        self.inputs = self.source.config.inputs(self.source.dtype)
        self.outputs = [dataclasses.replace(s, dtype="fp64") for s in self.source.config.outputs()]

    def run_impl(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        key = feeds_key(feeds)
        if key not in self.record:
            shapes = {k: list(v.shape) for k, v in feeds.items()}
            raise CheckFailed(f"internal: no reference output was recorded for inputs {shapes}")
        return {"y": self.record[key]}


def shapes_text(shapes: Sequence[tuple[int, int, int]]) -> str:
    return ", ".join(f"{b}x{s}" for b, s, _ in shapes)


def order_cases(cases: list[ParityCase]) -> list[ParityCase]:
    """Cases by shape (in the order they first ran), then by backend as parity lists them."""
    shape_order: dict[tuple[int, int, int | None], int] = {}
    for c in cases:
        shape_order.setdefault((c.batch, c.seq, c.mem_seq), len(shape_order))
    rank = {b: i for i, b in enumerate(BACKEND_NAMES)}
    return sorted(cases, key=lambda c: (shape_order[(c.batch, c.seq, c.mem_seq)], rank.get(c.backend, len(rank))))


def write_golden(
    tmp: str,
    config: AttentionConfig,
    weights: Mapping[str, np.ndarray],
    dtype: str,
    shapes: Sequence[tuple[int, int, int]],
) -> list[dict[str, Any]]:
    """Golden inputs (in the model's input dtype) and the reference backend's outputs.

    The outputs stay float64: they are the formula's values for these inputs, so verify
    compares a deployment's output with them exactly as parity compares a backend with the
    reference. Rounding them to the model dtype would add half an ulp of error to the golden
    file itself (for fp16 a sizable part of the tolerance)."""
    entries = []
    quantized = dtype in QUANTIZATIONS  # its inputs are float32; its error model needs the activations
    dtype = float_dtype(dtype)
    with create_runner(REFERENCE, ModelSource(config, weights, None, dtype)) as reference:
        for i, (batch, seq, mem_seq) in enumerate(shapes):
            mem = mem_seq if config.cross else None
            feeds = make_inputs(config, batch, seq, mem, dtype=dtype, seed=GOLDEN_SEED + i)
            y = reference.run(feeds)["y"]
            name = f"golden-{i}.npz"
            write_npz(os.path.join(tmp, name), {**feeds, "y": y})
            entries.append({
                "file": name,
                "batch": batch,
                "seq": seq,
                "mem_seq": mem,
                "seed": GOLDEN_SEED + i,
                "inputs": list(feeds),
                "outputs": ["y"],
                "output_dtype": "fp64",
                "backend": REFERENCE,
                # The tolerance rule needs the largest attention score, which needs the
                # weights: computed here, where they are.
                "problem_size": problem_size(config, weights, feeds, activations=quantized).to_dict(),
            })  # fmt: skip
    return entries


def versions() -> dict[str, str]:
    import onnx
    import onnx_ir
    import onnxruntime
    import onnxscript
    import torch

    return {
        "attnx": __version__,
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__,
        "onnx_ir": onnx_ir.__version__,
        "onnxruntime": onnxruntime.__version__,
        "numpy": np.__version__,
    }


def manifest_of(
    tmp: str,
    config: AttentionConfig,
    dtype: str,
    attention: str,
    model_files: list[str],
    providers: list[str],
    parity: ParityReport,
    golden: list[dict[str, Any]],
    weights_info: dict[str, Any],
    progress: Callable[[str], None],
) -> dict[str, Any]:
    info = describe(os.path.join(tmp, MODEL_FILE))
    data_files = [os.path.basename(f) for f in model_files if os.path.basename(f) != MODEL_FILE]
    verified, not_verified = [], {}
    for provider in providers:
        ort_cases = [c for c in parity.cases if c.backend == PROVIDERS[provider].backend]
        if ort_cases and all(c.status == "pass" for c in ort_cases):
            verified.append(provider)
        else:
            skipped = [c.reason for c in ort_cases if c.status == "skipped"]
            not_verified[provider] = skipped[0] if skipped else "not run"
    files = {}
    for name in sorted(os.listdir(tmp)):
        if name in (MANIFEST, MANIFEST_SUM):
            continue
        path = os.path.join(tmp, name)
        files[name] = {"size": os.path.getsize(path), "sha256": file_sha256(path, progress, name)}
    summary = parity.summary()
    max_abs = {}
    for c in parity.cases:
        if c.max_abs is not None:
            max_abs[c.backend] = max(max_abs.get(c.backend, 0.0), c.max_abs)
    return {
        "format": FORMAT,
        "format_version": LAYER_FORMAT_VERSION,
        "config": config.to_dict(),
        "dtype": dtype,
        **({"quantization": quantization_of(info.metadata)} if dtype in QUANTIZATIONS else {}),
        "attention": attention,
        "inputs": [spec.to_dict() for spec in info.inputs],
        "outputs": [spec.to_dict() for spec in info.outputs],
        "models": [
            {
                "file": MODEL_FILE,
                "external_data": data_files,
                # One model serves every provider while the lowering does not depend on it.
                "providers": providers,
                "lowering": info.lowering,
                "ir_version": info.ir_version,
                "opsets": info.opsets,
                **({"decode": info.decode} if info.decode is not None else {}),  # a step model's form
            }
        ],
        "files": files,
        "golden": golden,
        "weights": weights_info,
        "parity": {
            "passed": parity.passed,
            "report": PARITY_JSON,
            "summary": PARITY_MD,
            "cases": summary,
            "max_abs": max_abs,
        },
        "providers": providers,
        "verified_on": verified,
        "not_verified": not_verified,
        "versions": versions(),
    }


def localised_text(failed: list[ParityCase]) -> str:
    """Where the first localised failing case diverges (attnx.runtimes.localise), as the end of a message."""
    found = next((c for c in failed if c.localisation and c.localisation.get("line")), None)
    return f" ({found.backend}: {found.localisation['line']})" if found else ""


def parity_markdown(parity: ParityReport, config: AttentionConfig, dtype: str) -> str:
    """A short human-readable parity summary: one row per backend."""
    lines = [
        f"# Parity: {'PASSED' if parity.passed else 'FAILED'}",
        "",
        f"Config: `{config.to_json()}`, dtype {dtype}. Every backend against the numpy reference (float64);",
        "`reference` is the reference itself against torch in float64.",
        "",
        "| backend | vs | cases | pass | fail | skipped | max abs error | worst atol needed / allowed |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for backend, counts in parity.summary().items():
        cases = [c for c in parity.cases if c.backend == backend]
        ran = [c for c in cases if c.max_abs is not None]
        max_abs = f"{max(c.max_abs for c in ran):.3g}" if ran else "-"
        ratio = max(((c.needed_atol or 0.0) / c.atol for c in ran if c.atol), default=None)
        lines.append(
            f"| {backend} | {cases[0].reference} | {len(cases)} | {counts['pass']} | {counts['fail']} | "
            f"{counts['skipped']} | {max_abs} | {'-' if ratio is None else f'{ratio:.3f}'} |"
        )
    shapes = sorted({(c.batch, c.seq, c.mem_seq) for c in parity.cases})
    lines += ["", "Shapes (batch x seq" + (" x mem_seq" if config.cross else "") + "): "
              + ", ".join("x".join(str(v) for v in s if v is not None) for s in shapes)]  # fmt: skip
    reasons = {c.backend: c.reason for c in parity.cases if c.status == "skipped"}
    for backend, reason in reasons.items():
        lines.append(f"- skipped {backend}: {reason}")
    for c in parity.cases:
        if c.status == "fail":
            lines.append(f"- FAIL {c.backend} batch={c.batch} seq={c.seq}: {c.reason}")
    return "\n".join(lines) + "\n"


def write_golden_decode(tmp: str, config: AttentionConfig, weights: Mapping[str, np.ndarray],
                         dtype: str, buffer: bool = False) -> dict[str, Any]:  # fmt: skip
    """golden-decode-0.npz: the tokens (and their key padding mask) of a prefill then single-token
    steps, with the reference's float64 full forward over them: y at every position and the
    final cache. attnx verify replays the sequence (runner.prefill, runner.step; the buffer form's
    BufferDecoder) and compares. buffer: no padding (make_decode_inputs' buffer rows)."""
    prefill, steps, batch = STEP_GOLDEN["prefill"], STEP_GOLDEN["steps"], STEP_GOLDEN["batch"]
    quantized = dtype in QUANTIZATIONS  # its inputs are float32; its error model needs the activations
    dtype = float_dtype(dtype)
    feeds = make_decode_inputs(config, batch, prefill + steps, dtype, seed=GOLDEN_SEED, buffer=buffer)
    presents = [spec.name for spec in config.cache_specs(prefix="present_")]  # present_key, ..; present_latent
    full = {**feeds, **dict(zip((spec.name for spec in config.cache_specs()), empty_cache(config, batch, dtype)))}
    with create_runner(REFERENCE, ModelSource(config, weights, None, dtype)) as reference:
        if config.rope is None:
            expected = reference.run(full)
        else:
            # With rope the reference decodes the same sequence as verify replays it: each call's
            # positions (position_ids, recorded in the golden file) choose longrope's factors for that
            # call, so keys cached before a switch keep their rotation (transformers' rule).
            y, cache = decode_sequence(reference, feeds, prefill, config)
            expected = {"y": y, **dict(zip(presents, cache))}
    name = "golden-decode-0.npz"
    write_npz(os.path.join(tmp, name), {**feeds, **expected})
    return {
        "file": name,
        "batch": batch,
        "seq": prefill + steps,
        "mem_seq": None,
        "seed": GOLDEN_SEED,
        "decode": {"prefill": prefill, "steps": steps},
        "inputs": list(feeds),
        "outputs": ["y", *presents],
        "output_dtype": "fp64",
        "backend": REFERENCE,
        "problem_size": problem_size(config, weights, full, activations=quantized).to_dict(),
    }
