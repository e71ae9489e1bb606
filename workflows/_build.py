"""Deployment packages, the build side: `attnx build`.

build_package exports the model, checks it (onnx checker, contract dims, ORT load,
agreement with torch at shapes the export never saw, parity of every backend available
here against the reference), writes golden cases and a manifest, verifies the result as a
deployment machine would (attnx.runtimes.package.verify_package), and only then renames
the folder into place. An interrupted or failed build leaves nothing under the target.

Memory: the weights and an onnxruntime session never live at the same time (each is 2.4
GB for the gpt3 preset). Everything that needs the weights runs first (export, torch, the
reference, golden outputs); the weights are then spilled to scratch files that are mapped
only while the tolerance rule reads them, and the ONNX Runtime half of each check replays
the reference outputs recorded in the first half.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from attnx._io import Staging, check_output_parent, output_lock
from attnx.errors import CheckFailed, UsageError
from attnx.export import release_rewriter_state
from attnx.model.config import AttentionConfig
from attnx.model.contract import (
    BACKEND_NAMES,
    BUILD_ATTENTION,
    EXPORT_ATTENTIONS,
    PROVIDERS,
    REFERENCE,
    check_choice,
    check_model_dtype,
    get_provider,
    provider_of_backend,
    runs_onnx_model,
)
from attnx.model.cores import export_core
from attnx.model.int8 import int8_weight_bits
from attnx.model.resources import check_memory, estimate_export
from attnx.model.weights import check_weights, init_weights, load_weights, weights_sha256
from attnx.runtimes.base import ModelSource, Runner, create_runner
from attnx.runtimes.compare import Comparison
from attnx.runtimes.decode import run_decode_parity
from attnx.runtimes.package import (
    FORMAT,
    MANIFEST,
    MANIFEST_SUM,
    VerifyReport,
    verify_package,
)
from attnx.runtimes.parity import DEFAULT_BATCHES, DEFAULT_MEM_SEQS, DEFAULT_SEQS, ParityReport, run_parity
from attnx.workflows._checks import VALIDATION_SHAPES, check_against_expected, check_model_file, torch_expected
from attnx.workflows._export import export_model, release_weights, weights_nbytes
from attnx.workflows._package_files import (
    MODEL_FILE,
    PARITY_JSON,
    PARITY_MD,
    RecordingRunner,
    ReplayRunner,
    localised_text,
    manifest_of,
    order_cases,
    parity_markdown,
    shapes_text,
    write_golden,
    write_golden_decode,
    write_json,
    write_npz,
)

__all__ = [
    "DEFAULT_ATTENTION",
    "DEFAULT_PROVIDERS",
    "LARGE_MODEL_BYTES",
    "CheckPlan",
    "BuildReport",
    "check_plan",
    "build_package",
    "write_npz",
]

logger = logging.getLogger(__name__)

DEFAULT_ATTENTION = BUILD_ATTENTION  # the contract's, with its reason
# The providers a package is built for; each is verified here when it can run here.
DEFAULT_PROVIDERS = tuple(PROVIDERS)
# Above this many bytes of float32 weights, the build checks at smaller shapes (see check_plan).
LARGE_MODEL_BYTES = 1024**3
@dataclasses.dataclass(frozen=True)
class CheckPlan:
    """The shapes (batch, seq, mem_seq) a build checks its model at."""

    validation_shapes: tuple[tuple[int, int, int], ...]  # ORT against the torch module
    parity_batches: tuple[int, ...]
    parity_seqs: tuple[int, ...]
    parity_mem_seqs: tuple[int, ...]
    golden_shapes: tuple[tuple[int, int, int], ...]
    check_reference: bool  # the reference itself against torch in float64


def check_plan(config: AttentionConfig) -> CheckPlan:
    """Shapes by model size. Up to LARGE_MODEL_BYTES of weights: the export's validation
    shapes (seq 1, batch 3, seq 1031), parity's defaults, and the reference checked against
    torch in float64. Above (the gpt3 preset): the numpy reference is slow at that width and
    a float64 torch module would hold twice the weights again, so parity and golden cases
    stay small (batch 1-2, seq 1 and 8) and the float64 check is left out; the validation
    shapes are the export's (seq 1 and 1031 at batch 1, batch 3 at seq 17)."""
    if 4 * config.n_params <= LARGE_MODEL_BYTES:
        return CheckPlan(
            validation_shapes=VALIDATION_SHAPES,
            parity_batches=tuple(DEFAULT_BATCHES),
            parity_seqs=tuple(DEFAULT_SEQS),
            parity_mem_seqs=tuple(DEFAULT_MEM_SEQS),
            golden_shapes=((1, 1, 3), (2, 7, 5), (3, 33, 9)),
            check_reference=True,
        )
    return CheckPlan(
        validation_shapes=VALIDATION_SHAPES,
        parity_batches=(1, 2),
        parity_seqs=(1, 8),
        parity_mem_seqs=(5,),
        golden_shapes=((1, 1, 3), (2, 8, 5)),
        check_reference=False,
    )


@dataclasses.dataclass
class BuildReport:
    directory: str
    manifest: dict[str, Any]
    validation: list[Comparison]
    parity: ParityReport
    verify: VerifyReport
    export_lines: list[str] = dataclasses.field(default_factory=list)


class _SpilledWeights(Mapping[str, np.ndarray]):
    """Weights saved to .npy scratch files and memory-mapped on each access: the pages are
    mapped only while a caller holds the array, so the second half of the build can read
    them (the tolerance rule needs q and k) beside an onnxruntime session without holding
    a second copy of the weights."""

    def __init__(self, folder: str, weights: Mapping[str, np.ndarray]) -> None:
        # mkdir, not makedirs: inside a stage an interrupt removed, it fails rather than create the stage again
        os.mkdir(folder)
        self.paths = {}
        for i, (name, array) in enumerate(weights.items()):
            path = os.path.join(folder, f"w{i}.npy")
            np.save(path, np.ascontiguousarray(array), allow_pickle=False)
            self.paths[name] = path

    def __getitem__(self, name: str) -> np.ndarray:
        return np.load(self.paths[name], mmap_mode="r", allow_pickle=False)

    def __iter__(self) -> Iterator[str]:
        return iter(self.paths)

    def __len__(self) -> int:
        return len(self.paths)


# The build ---------------------------------------------------------------------------------
def _check_args(attention: str, dtype: str, providers: Sequence[str]) -> None:
    check_choice("--attention", attention, EXPORT_ATTENTIONS)
    check_model_dtype(dtype)
    if not providers:
        raise UsageError("--provider needs at least one of: " + ", ".join(PROVIDERS))
    for name in providers:
        get_provider(name, "--provider")


def _listed_files(path: str) -> set[str] | None:
    """The files the manifest of the folder `path` lists (itself and its checksum included),
    or None when the folder holds no readable attnx manifest."""
    manifest = os.path.join(path, MANIFEST)
    if os.path.islink(manifest) or not os.path.isfile(manifest) or os.path.getsize(manifest) > 16 * 1024**2:
        return None
    try:
        with open(manifest, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("files"), dict):
        return None
    return set(data["files"]) | {MANIFEST, MANIFEST_SUM}


def _check_target(out: str, force: bool) -> None:
    """Refuse to replace anything but an earlier package (or an empty folder), and that only
    with force; and a package only when every file in it is one its manifest lists: `--force`
    never deletes a file attnx did not write (nor `--out ~`, a home folder)."""
    check_output_parent(out, "--out")
    if not os.path.lexists(out):
        return
    if not force:
        raise UsageError(f"{out!r} already exists (pass --force to replace it)")
    if os.path.islink(out) or not os.path.isdir(out):
        raise UsageError(f"{out!r} exists and is not a folder: not replacing it")
    entries = os.listdir(out)
    if not entries:
        return
    listed = _listed_files(out)
    if listed is None:
        raise UsageError(f"{out!r} exists and is not an attnx package: not replacing it, even with --force")
    extra = sorted(set(entries) - listed)
    if extra:
        raise UsageError(
            f"{out!r} holds {len(extra)} file(s) its manifest does not list ({', '.join(extra[:5])}"
            f"{', ...' if len(extra) > 5 else ''}): not replacing it, even with --force (move them out first)"
        )


def build_package(
    config: AttentionConfig,
    out: str | os.PathLike[str],
    weights: Mapping[str, np.ndarray] | str | os.PathLike[str] | None = None,
    *,
    seed: int = 0,
    attention: str = DEFAULT_ATTENTION,
    dtype: str = "fp32",
    providers: Sequence[str] = DEFAULT_PROVIDERS,
    force: bool = False,
    plan: CheckPlan | None = None,
    max_mem_gb: float | None = None,
    progress: Callable[[str], None] = lambda msg: None,
    block_size: int = 32,
    accuracy_level: int = 4,
    decode_form: str = "growing",
    buffer_core: str | None = None,
    int8_bits: int | str = "auto",
) -> BuildReport:
    """Export, check and package `config` into the folder `out`.

    weights: a safetensors path (read here, and released before onnxruntime loads the
    model), a mapping of arrays (the caller's: it stays in memory), or None for seeded
    weights (`seed`). Raises CheckFailed (exit 1) when a check fails: then nothing is
    written under `out`. An existing `out` is replaced only with force, and only when it is
    an earlier package holding nothing but its manifest's files, or an empty folder. The
    package is assembled in a staging folder beside `out` (attnx._io.Staging): an interrupted
    or killed build leaves nothing under `out`, and the next build removes what it left.
    int8_bits: an int8 model's weight width, 7, 8 or auto (8 on a host with VNNI, else 7: a package of
    8-bit weights is refused on a host without VNNI; attnx.model.int8).
    """
    out = os.path.abspath(os.fspath(out))
    providers = list(dict.fromkeys(providers))
    _check_args(attention, dtype, providers)
    int8_weight_bits(dtype, int8_bits)  # an explicit width for another dtype is refused before any work
    # What the lowering's core cannot express in this form and dtype: refused by name before any work
    # (attnx.model.cores, the registry every check reads).
    export_core(config, attention, dtype, decode_form, buffer_core)
    _check_target(out, force)
    plan = plan or check_plan(config)
    shapes = [*plan.validation_shapes, *plan.golden_shapes,
              *((b, s, m) for b in plan.parity_batches for s in plan.parity_seqs for m in plan.parity_mem_seqs)]  # fmt: skip
    check_memory(estimate_export(config, shapes, what="build", reference=True), max_mem_gb)
    # The lock first: a second build of the same folder is refused now, not after its work.
    with output_lock(out), Staging(out, folder=True) as stage:
        quant = {"block_size": block_size, "accuracy_level": accuracy_level, "int8_bits": int8_bits}
        if config.kv_cache:
            report = _build_step_into(stage.dir, config, weights, seed, attention, dtype, providers, plan, progress,
                                      decode_form, buffer_core, quant)  # fmt: skip
        else:
            report = _build_into(stage.dir, config, weights, seed, attention, dtype, providers, plan, progress, quant)
        progress(f"moving the package into place: {out}")
        stage.publish(replace_folder=lambda target: _check_target(target, force))
    report.directory = out
    report.verify.directory = out
    return report


def _load_weights(
    config: AttentionConfig, weights: Any, seed: int, progress: Callable[[str], None]
) -> tuple[Mapping[str, np.ndarray], dict[str, Any]]:
    if weights is None:
        progress(f"drawing seeded weights (seed {seed}, {config.n_params:,} parameters)")
        return init_weights(config, seed), {"source": f"seed {seed}"}
    if isinstance(weights, (str, os.PathLike)):
        progress(f"reading weights {os.fspath(weights)}")
        return load_weights(weights, config), {"source": f"file {os.path.basename(os.fspath(weights))}"}
    check_weights(config, weights)
    return weights, {"source": "arrays"}


def _build_into(
    tmp: str,
    config: AttentionConfig,
    weights_arg: Any,
    seed: int,
    attention: str,
    dtype: str,
    providers: list[str],
    plan: CheckPlan,
    progress: Callable[[str], None],
    quant: Mapping[str, int | str] | None = None,
) -> BuildReport:
    model_path = os.path.join(tmp, MODEL_FILE)
    scratch = os.path.join(tmp, ".scratch")

    # First half: everything that needs the weights in memory. ---------------------------
    weights, weights_info = _load_weights(config, weights_arg, seed, progress)
    weights_info["sha256"] = weights_sha256(config, weights)
    exported = export_model(
        config, model_path, weights, seed=seed, attention=attention, dtype=dtype, validate=False, check=False,
        progress=progress, **(quant or {}),
    )  # fmt: skip
    release_rewriter_state()  # the lowering passes' rewrite rules may hold the graph, and so the weights
    progress(f"torch module at the validation shapes {shapes_text(plan.validation_shapes)}")
    expected = torch_expected(config, weights, dtype, plan.validation_shapes)
    record: dict[str, np.ndarray] = {}

    def recording_factory(name: str, source: ModelSource, **options: Any) -> Runner:
        runner = create_runner(name, source, **options)  # options: a localisation's session options
        return RecordingRunner(runner, record) if name == REFERENCE else runner

    source = ModelSource(config, weights, None, dtype)
    # Torch backends first, while the weights are in memory; each ONNX Runtime backend after.
    ort_backends = [p.backend for p in PROVIDERS.values()]
    first = [REFERENCE] if plan.check_reference else []
    # (openvino, a model-file backend of its own, is not part of a build: `attnx parity --backends openvino`)
    first += [b for b in BACKEND_NAMES if b != REFERENCE and b not in ort_backends and not runs_onnx_model(b)]
    progress(f"parity: {', '.join(first)} against the reference")
    parity_args = dict(batches=plan.parity_batches, seqs=plan.parity_seqs, mem_seqs=plan.parity_mem_seqs)
    cases = run_parity(source, first, runner_factory=recording_factory, progress=progress, **parity_args).cases
    progress(f"golden cases {shapes_text(plan.golden_shapes)} (reference backend, float64)")
    golden = write_golden(tmp, config, weights, dtype, plan.golden_shapes)
    progress("spilling the weights to scratch files: onnxruntime loads the model next")
    spilled = _SpilledWeights(scratch, weights)
    held = weights_nbytes(weights)
    del weights, source
    release_weights(held)

    # Second half: onnxruntime, one session at a time. ------------------------------------
    progress("checking the saved model (onnx checker, dims, onnxruntime load)")
    check_model_file(model_path, config)
    progress("validating onnxruntime against torch at the validation shapes")
    validation = check_against_expected(model_path, config, expected, dtype)
    replay_source = ModelSource(config, spilled, model_path, dtype)

    def replay_factory(name: str, source: ModelSource, **options: Any) -> Runner:
        return ReplayRunner(source, record) if name == REFERENCE else create_runner(name, source, **options)

    for backend in ort_backends:  # one call each: two sessions never coexist
        progress(f"parity: {backend} against the reference")
        cases += run_parity(
            replay_source, [backend], runner_factory=replay_factory, progress=progress, **parity_args
        ).cases
    del replay_source, spilled
    shutil.rmtree(scratch)
    parity = ParityReport(order_cases(cases))
    if not parity.passed:
        failed = [c for c in parity.cases if c.status == "fail"]
        raise CheckFailed(
            f"parity failed in {len(failed)} case(s), no package written: "
            + "; ".join(f"{c.backend} batch={c.batch} seq={c.seq}: {c.reason}" for c in failed[:5])
            + localised_text(failed)
        )

    # The package's files, then its own verify. -------------------------------------------
    return _write_and_verify(
        tmp, config, dtype, attention, exported, providers, parity, golden, weights_info, validation, progress
    )


# Step models (config kv_cache) -----------------------------------------------------------------
# The decode parity of a step-model build, and its golden decode sequence (a prefill, then steps).
STEP_PARITY = {"prefills": (0, 1, 37), "steps": 64, "batch": 3}
STEP_PARITY_LARGE = {"prefills": (0, 8), "steps": 4, "batch": 1}
def _build_step_into(
    tmp: str,
    config: AttentionConfig,
    weights_arg: Any,
    seed: int,
    attention: str,
    dtype: str,
    providers: list[str],
    plan: CheckPlan,
    progress: Callable[[str], None],
    decode_form: str = "growing",
    buffer_core: str | None = None,
    quant: Mapping[str, int | str] | None = None,
) -> BuildReport:
    """The package of a step model: the model, its step-by-step parity on every backend here
    (prefill then single-token steps against the reference's full forward), a golden decode
    sequence that `attnx verify` replays, the manifest, and the package's own verify.
    The buffer form (decode_form "buffer", its core buffer_core) runs on ONNX Runtime alone: its
    parity is the reference's and ONNX Runtime's, its golden sequence unpadded (the form has no
    padding: a token's position is its index).

    Unlike _build_into the weights stay in memory beside one ONNX Runtime session at a time
    (the step model is checked by decoding, which the replay of recorded outputs does not cover)."""
    model_path = os.path.join(tmp, MODEL_FILE)
    weights, weights_info = _load_weights(config, weights_arg, seed, progress)
    weights_info["sha256"] = weights_sha256(config, weights)
    exported = export_model(config, model_path, weights, seed=seed, attention=attention, dtype=dtype, validate=False,
                            check=False, progress=progress, decode_form=decode_form, buffer_core=buffer_core,
                            **(quant or {}))  # fmt: skip
    progress("checking the saved model (onnx checker, dims, onnxruntime load)")
    check_model_file(model_path, config)
    step_parity = STEP_PARITY if 4 * config.n_params <= LARGE_MODEL_BYTES else STEP_PARITY_LARGE
    source = ModelSource(config, weights, model_path, dtype)
    backends = [b for b in BACKEND_NAMES if plan.check_reference or b != REFERENCE]
    if decode_form == "buffer":  # IOBinding on one cache: ONNX Runtime's backends (and the reference's formula)
        backends = [b for b in backends if b == REFERENCE or provider_of_backend(b) is not None]
    parity = ParityReport([])
    for backend in backends:  # one backend at a time: two sessions never coexist
        progress(f"decode parity: {backend} (prefill {list(step_parity['prefills'])} + {step_parity['steps']} steps)")
        parity.cases += run_decode_parity(source, [backend], progress=progress, **step_parity).cases
    if not parity.passed:
        failed = [c for c in parity.cases if c.status == "fail"]
        raise CheckFailed(
            f"decode parity failed in {len(failed)} case(s), no package written: "
            + "; ".join(f"{c.backend} prefill={c.prefill}: {c.reason}" for c in failed[:5])
            + localised_text(failed)
        )
    progress("golden decode sequence (reference backend, float64)")
    golden = [write_golden_decode(tmp, config, weights, dtype, buffer=decode_form == "buffer")]
    held = weights_nbytes(weights)
    del weights, source
    release_weights(held)
    return _write_and_verify(
        tmp, config, dtype, attention, exported, providers, parity, golden, weights_info, [], progress
    )


def _write_and_verify(
    tmp: str,
    config: AttentionConfig,
    dtype: str,
    attention: str,
    exported: Any,
    providers: Sequence[str],
    parity: ParityReport,
    golden: list,
    weights_info: dict,
    validation: list,
    progress: Callable[[str], None],
) -> BuildReport:
    """The package's parity report, manifest and its checksum, then the package's own verify on
    each provider verified here (with none, a cuda-only package built without CUDA, the model
    still runs its golden cases on cpu). Shared by the full-sequence and the step-model builds."""
    parity.write_json(os.path.join(tmp, PARITY_JSON))
    with open(os.path.join(tmp, PARITY_MD), "w", encoding="utf-8") as f:
        f.write(parity_markdown(parity, config, dtype))
    manifest = manifest_of(
        tmp, config, dtype, attention, exported.files, providers, parity, golden, weights_info, progress
    )
    write_json(os.path.join(tmp, MANIFEST), manifest)
    with open(os.path.join(tmp, MANIFEST), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(tmp, MANIFEST_SUM), "w", encoding="ascii") as f:
        f.write(f"{digest}  {MANIFEST}\n")
    for provider in manifest["verified_on"] or ["cpu"]:
        progress(f"verifying the package as a deployment machine will (attnx verify, {provider})")
        model_file = None if provider in manifest["verified_on"] else MODEL_FILE
        verify = verify_package(tmp, provider, progress, model_file=model_file)
        if not verify.passed:
            raise CheckFailed(
                f"the package fails its own verify on {provider}: "
                + "; ".join(f"{c.name}: {c.detail}" for c in verify.failures())
            )
    return BuildReport(tmp, manifest, validation, parity, verify, exported.passes)
