"""Deployment packages, the deployment side: verify, load, describe.

A package is a folder that `attnx build` (attnx.workflows.build_package) wrote:

    manifest.json      what the package is: config, inputs/outputs, models, every file's
                       size and sha256, golden cases, parity summary, tool versions
    manifest.sha256    the manifest's own sha256 (`sha256sum -c` reads it)
    model.onnx         the model, with model.onnx.data beside it when large
    golden-<i>.npz     golden inputs and the reference backend's float64 outputs
    parity.json/.md    the parity report of the build

This module runs on the deployment machine: numpy, onnx (to read the model's
external-data entries without loading the data) and onnxruntime; never torch.

Safety: every name the manifest or the model gives is checked before anything is read
from it: a plain file name (no folder part, not absolute, not '..') that resolves, symlinks
followed, inside the package folder. Arrays are read with allow_pickle=False.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import logging
import os
import re
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from attnx.errors import CheckFailed, InputError, ModelFileError, UsageError
from attnx.model.config import AttentionConfig
from attnx.model.contract import describe, get_provider
from attnx.model.tolerance import ProblemSize, stage_tolerance, tolerance_for
from attnx.model.weights import init_weights, weight_shapes, weights_sha256
from attnx.runtimes._manifest import (
    FORMAT,
    FORMAT_VERSION,
    LAYER_FORMAT_VERSION,
    MANIFEST,
    MANIFEST_SUM,
    MODEL_KIND,
    Check,
    check_model_data,
    check_names,
    file_sha256,
    manifest_bytes,
    member_path,
    package_root,
    parse_manifest,
    read_manifest,
)
from attnx.runtimes.base import ModelSource, Runner, create_runner
from attnx.runtimes.compare import compare_arrays
from attnx.runtimes.decode import decode_sequence, localise_decode
from attnx.runtimes.localise import file_weights, localisation_dict, localise_case
from attnx.runtimes.model_package import load_model_package, open_model, replay_generations, served_model
from attnx.runtimes.ort_runner import import_onnxruntime
from attnx.runtimes.text import check_text

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "LAYER_FORMAT_VERSION",
    "MODEL_KIND",
    "MANIFEST",
    "MANIFEST_SUM",
    "Check",
    "VerifyReport",
    "verify_package",
    "load",
    "describe_package",
    "read_manifest",
    "member_path",
    "file_sha256",
]

logger = logging.getLogger(__name__)

@dataclasses.dataclass
class VerifyReport:
    directory: str
    provider: str
    checks: list[Check]
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(self.checks)

    def __bool__(self) -> bool:
        return self.passed

    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c]

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "provider": self.provider,
            "passed": self.passed,
            "checks": [c.to_dict() for c in self.checks],
            "notes": self.notes,
        }


def _check_files(root: str, manifest: Mapping[str, Any], progress: Callable[[str], None]) -> list[Check]:
    """Size, then sha256, of every file the manifest lists."""
    checks = []
    for name, entry in manifest["files"].items():
        path = member_path(root, name, f"{MANIFEST} 'files'")
        if not os.path.lexists(path):
            checks.append(Check(name, False, "missing"))
            continue
        if not os.path.isfile(path):
            checks.append(Check(name, False, "not a regular file"))
            continue
        size = os.path.getsize(path)
        if size != entry["size"]:
            how = "truncated" if size < entry["size"] else "grown"
            checks.append(Check(name, False, f"{size} bytes, expected {entry['size']} ({how})"))
            continue
        digest = file_sha256(path, progress, name)
        if digest != entry["sha256"]:
            checks.append(
                Check(
                    name,
                    False,
                    f"sha256 {digest[:16]}... differs from the manifest's {entry['sha256'][:16]}... (altered)",
                )
            )
            continue
        checks.append(Check(name, True, f"{size} bytes, sha256 {digest[:16]}..."))
    return checks


def _model_for(manifest: Mapping[str, Any], name: str) -> dict[str, Any]:
    get_provider(name)
    for model in manifest["models"]:
        if name in model["providers"]:
            return model
    built = sorted({p for m in manifest["models"] for p in m["providers"]})
    raise UsageError(f"this package has no model for provider {name!r} (built for: {', '.join(built)})")


def _check_description(root: str, manifest: Mapping[str, Any], model: Mapping[str, Any]) -> Check:
    """What the manifest says of its model (config, lowering, dtype, inputs and outputs with their
    dims, IR version, opsets) against what the model file says of itself: the hashes prove the
    files are the ones the manifest lists, not that the manifest describes them truly."""
    name = model["file"]
    try:
        info = describe(member_path(root, name, "the model"))
    except ModelFileError as e:
        return Check(f"{name} description", False, str(e))
    said = {
        "config": manifest["config"],
        "lowering": model.get("lowering"),
        "dtype": manifest["dtype"],
        "inputs": manifest.get("inputs"),
        "outputs": manifest.get("outputs"),
        "ir_version": model["ir_version"],
        "opsets": model["opsets"],
    }
    found = {
        "config": info.config.to_dict() if info.config is not None else info.config_error,
        "lowering": info.lowering,
        "dtype": info.dtype,
        "inputs": [s.to_dict() for s in info.inputs],
        "outputs": [s.to_dict() for s in info.outputs],
        "ir_version": info.ir_version,
        "opsets": info.opsets,
    }
    if "decode" in model:  # a step model's form (growing, buffer), where the manifest says it
        said["decode"], found["decode"] = model["decode"], info.decode
    differ = [key for key in said if said[key] != found[key]]
    if differ:
        key = differ[0]
        ours, its = said[key], found[key]
        if isinstance(ours, dict) and isinstance(its, dict):  # a config, the opsets: only the keys that differ
            keys = [k for k in {**ours, **its} if ours.get(k) != its.get(k)]
            ours, its = {k: ours.get(k) for k in keys}, {k: its.get(k) for k in keys}
        return Check(
            f"{name} description", False,
            f"{MANIFEST} says {key} {json.dumps(ours)[:200]}, the model itself {json.dumps(its)[:200]}"
            + (f" (and {len(differ) - 1} more: {', '.join(differ[1:])})" if len(differ) > 1 else ""),
        )  # fmt: skip
    return Check(f"{name} description", True, f"config, {info.lowering} lowering, {info.dtype}, dims as in {MANIFEST}")


def _describe_versions(model: Mapping[str, Any]) -> str:
    opsets = ", ".join(f"{domain} {version}" for domain, version in sorted(model["opsets"].items()))
    return f"IR version {model['ir_version']}, opsets {opsets}"


def _model_named(manifest: Mapping[str, Any], file: str) -> dict[str, Any]:
    for model in manifest["models"]:
        if model["file"] == file:
            return model
    raise UsageError(f"this package has no model {file!r}")


def _open_runner(root: str, manifest: Mapping[str, Any], name: str, model: Mapping[str, Any]) -> Runner:
    """A loaded ORT runner for `model` on provider `name` (ModelFileError if ORT cannot load it)."""
    check_model_data(root, manifest, model["file"])
    config = AttentionConfig.from_dict(dict(manifest["config"]))
    source = ModelSource(config, None, member_path(root, model["file"], "the model"), manifest["dtype"])
    return create_runner(get_provider(name).backend, source).load()


class _BadGolden(Exception):
    """A golden file that cannot be used; the message says why."""


def _load_golden(path: str, case: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(inputs, outputs) of one golden file; allow_pickle=False: an object array is refused."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        raise _BadGolden(f"not a plain npz of arrays: {str(e).strip()[:200]}") from None
    missing = [k for k in [*case["inputs"], *case["outputs"]] if k not in arrays]
    if missing:
        raise _BadGolden(f"has no array {missing[0]!r} (holds {', '.join(arrays) or 'nothing'})")
    return {k: arrays[k] for k in case["inputs"]}, {k: arrays[k] for k in case["outputs"]}


def _case_label(case: Mapping[str, Any]) -> str:
    mem = f" mem_seq={case['mem_seq']}" if case.get("mem_seq") else ""
    decode = case.get("decode")
    if isinstance(decode, dict):
        return f"batch={case.get('batch')} prefill={decode.get('prefill')} + {decode.get('steps')} steps"
    return f"batch={case.get('batch')} seq={case.get('seq')}{mem}"


def _replay_decode(runner: Runner, case: Mapping[str, Any], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A golden decode sequence replayed: the prefill, then one token per step, each step's
    cache fed back as past (runner.prefill/step); y of every position and the final cache."""
    decode = case["decode"]
    prefill = decode.get("prefill") if isinstance(decode, dict) else None
    if not isinstance(prefill, int) or isinstance(prefill, bool) or not 0 <= prefill < feeds["x"].shape[1]:
        raise _BadGolden(f"its 'decode' entry {decode!r} gives no prefill length within its {feeds['x'].shape[1]} tokens")
    y, cache = decode_sequence(runner, feeds, prefill)  # present_key, present_value; present_latent (cache_specs)
    return {"y": y, **{spec.name: a for spec, a in zip(runner.source.config.cache_specs(prefix="present_"), cache)}}


def _check_golden(root: str, manifest: Mapping[str, Any], runner: Runner) -> list[Check]:
    checks: list[Check] = []
    tol = tolerance_for(manifest["dtype"], runner.name, manifest.get("quantization"))
    config = AttentionConfig.from_dict(dict(manifest["config"]))
    for case in manifest["golden"]:
        name = case["file"]
        label = _case_label(case)
        try:
            feeds, expected = _load_golden(member_path(root, name, "a golden file"), case)
            got = _replay_decode(runner, case, feeds) if "decode" in case else runner.run(feeds)
        except _BadGolden as e:
            checks.append(Check(name, False, str(e)))
            continue
        except InputError as e:
            checks.append(Check(name, False, f"{label}: the model refuses its inputs: {e}"))
            continue
        except Exception as e:  # noqa: BLE001 - ORT's own error types: the model fails to run
            checks.append(Check(name, False, f"{label}: onnxruntime fails: {str(e).strip().splitlines()[0][:300]}"))
            continue
        size = ProblemSize.from_dict(case["problem_size"])
        first = len(checks)
        for out_name, ref in expected.items():
            if out_name not in got:
                checks.append(Check(f"{name} {out_name}", False, f"{label}: the model has no output {out_name!r}"))
                continue
            # each output's bound by the stages' one rule, as decode parity holds it (the rotated cache's
            # rope term; a quantized model's caches their projection's own error)
            bound = stage_tolerance(out_name, config, tol, size, np.asarray(ref))
            cmp = compare_arrays(out_name, got[out_name], ref, bound.tol, bound.size, bound.scale)
            stats = {**cmp.stats(), "atol": cmp.atol, "rtol": cmp.rtol}
            checks.append(Check(f"{name} {out_name}", cmp.passed, f"{label}: {cmp.detail()}", stats))
        failed = next((i for i in range(first, len(checks)) if not checks[i]), None)
        if failed is not None and all(out in got for out in expected):  # localised once, on its first failure
            found = localisation_dict(functools.partial(_localise_golden, manifest, runner, case, feeds, expected, tol,
                                                        size))  # fmt: skip
            checks[failed] = dataclasses.replace(checks[failed], localisation=found)
    return checks


def _localise_golden(manifest: Mapping[str, Any], runner: Runner, case: Mapping[str, Any],
                     feeds: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray], tol: Any,
                     size: ProblemSize) -> Any:  # fmt: skip
    """Where a failing golden case diverges (attnx.runtimes.localise): a decode sequence replayed step by
    step (localise_decode), a full-sequence case run with its stages exposed (localise_case); the
    reference's stages from the package's weights (_package_weights)."""
    config = AttentionConfig.from_dict(dict(manifest["config"]))
    path = runner.source.model_path
    weights, note, altered = _package_weights(manifest, config, path)
    source = ModelSource(config, weights, path, manifest["dtype"])
    # a look inside a fused operator exports its decomposed form (torch, where this machine has it) from
    # the package's weights: not when the model file holds others (the two forms would differ in those)
    inside = importlib.util.find_spec("torch") is not None and not altered
    if "decode" in case:
        result = localise_decode(source, runner, feeds, case["decode"]["prefill"], expected, tol=tol, size=size,
                                 look_inside=inside)  # fmt: skip
    elif weights is None:
        raise UsageError(note)
    else:
        result = localise_case(source, runner.name, feeds, tol=tol, size=size, look_inside=inside)
    if altered:
        result.cause = altered + (f"; {result.cause}" if result.cause else "")
    if note:
        result.note = f"{result.note}; {note}" if result.note else note
    return result


def _package_weights(manifest: Mapping[str, Any], config: AttentionConfig,
                     path: str) -> tuple[dict[str, np.ndarray] | None, str | None, str | None]:  # fmt: skip
    """(weights, note, altered) for the reference's stages: the weights the package was built with when
    its manifest names their seed (and their sha256 agrees), else the model file's own. altered: when
    the model file's weights are not those the manifest's weights.sha256 records (fp32: a half-precision
    file holds them rounded), which."""
    built = manifest.get("weights") if isinstance(manifest.get("weights"), dict) else {}
    digest = built.get("sha256")
    seeded = re.fullmatch(r"seed (\d+)", str(built.get("source", "")))
    weights = init_weights(config, int(seeded.group(1))) if seeded else None
    if weights is not None and digest is not None and weights_sha256(config, weights) != digest:
        weights = None  # not the seed's after all
    own = _file_weights(path, config)
    altered = None
    if own is not None and digest is not None and manifest["dtype"] == "fp32" and weights_sha256(config, own) != digest:
        names = [n for n in own if weights is not None and not np.array_equal(own[n], weights[n])]
        altered = ("the model file's weights are not those the package was built with (their sha256 is not the "
                   "manifest's weights.sha256)" + (f": {', '.join(names)} differ" if names else ""))  # fmt: skip
    if weights is not None:
        return weights, None, altered
    if own is not None:
        return own, "the reference's stages from the model file's own weights (the manifest names no seed)", altered
    return None, ("no weights for the reference's stages: the manifest names no seed, and the model file holds "
                  "them in another form (packed, fused or quantized)"), None  # fmt: skip


def _file_weights(path: str, config: AttentionConfig) -> dict[str, np.ndarray] | None:
    """The weights as the model file holds them (attnx.runtimes.localise.file_weights), float32; None
    when one is not there as itself (a quantized form)."""
    own = file_weights(path, config)
    return own if set(own) == set(weight_shapes(config)) else None


def verify_package(
    directory: str | os.PathLike[str],
    provider: str = "cpu",
    progress: Callable[[str], None] = lambda msg: None,
    *,
    model_file: str | None = None,
) -> VerifyReport:
    """Check a package on this machine: every file's size and sha256, that the installed
    onnxruntime loads the model (its IR version and opsets) on `provider`, and that the
    golden inputs give the golden outputs within the tolerance table.

    Returns the report (failed checks say which file or output, by how much). Raises
    PackageError for a folder that is not a package or names a file outside itself, and
    ProviderUnavailable when `provider` cannot run here. model_file runs that model on
    `provider` even if the package was not built for it (attnx build checks a cuda-only
    package's model on cpu this way when it has no CUDA).
    """
    backend = get_provider(provider).backend
    root = package_root(directory)
    report = VerifyReport(os.fspath(directory), provider, [])
    data, manifest_check = manifest_bytes(root)
    report.checks.append(manifest_check)
    if not manifest_check:
        return report  # nothing else can be trusted: the manifest holds every other hash
    manifest = parse_manifest(data)
    check_names(root, manifest)
    if manifest.get("kind") == MODEL_KIND:
        return _verify_model_package(root, manifest, provider, report, progress)
    model = _model_for(manifest, provider) if model_file is None else _model_named(manifest, model_file)
    if not _files_hold(root, manifest, report, progress):
        return report  # a damaged or altered file is never handed to onnxruntime
    report.checks.append(_check_description(root, manifest, model))
    if not report.passed:
        return report  # a manifest that misdescribes its model verifies nothing

    onnxruntime = _runtime(manifest, backend, report)
    versions = _describe_versions(model)
    check_model_data(root, manifest, model["file"])  # before onnxruntime opens anything
    progress(f"loading {model['file']} in onnxruntime {onnxruntime.__version__} ({backend})")
    try:
        runner = _open_runner(root, manifest, provider, model)
    except ModelFileError as e:
        report.checks.append(
            Check("onnxruntime", False, f"{onnxruntime.__version__} cannot load {model['file']} ({versions}): {e}")
        )
        return report
    report.checks.append(
        Check("onnxruntime", True, f"{onnxruntime.__version__} loads {model['file']} ({versions}) on {runner.ort_provider}")
    )
    try:
        progress(f"running {len(manifest['golden'])} golden cases")
        report.checks += _check_golden(root, manifest, runner)
    finally:
        runner.close()
    return report


def _files_hold(root: str, manifest: Mapping[str, Any], report: VerifyReport, progress: Callable[[str], None]) -> bool:
    """Every file's size and sha256 checked into `report` (files the manifest does not list noted); whether all
    hold."""
    progress("checking file sizes and sha256")
    report.checks += _check_files(root, manifest, progress)
    extra = sorted(set(os.listdir(root)) - set(manifest["files"]) - {MANIFEST, MANIFEST_SUM})
    if extra:
        report.notes.append(f"files not in the manifest (not checked, not used): {', '.join(extra)}")
    return report.passed


def _runtime(manifest: Mapping[str, Any], backend: str, report: VerifyReport) -> Any:
    """onnxruntime for `backend`, noting in `report` where it is not the version the package was built with."""
    onnxruntime = import_onnxruntime(backend)
    built_with = manifest.get("versions", {}).get("onnxruntime")
    if built_with and built_with != onnxruntime.__version__:
        report.notes.append(f"built with onnxruntime {built_with}, verifying with {onnxruntime.__version__}")
    return onnxruntime


def _verify_model_package(root: str, manifest: dict[str, Any], provider: str, report: VerifyReport,
                          progress: Callable[[str], None]) -> VerifyReport:  # fmt: skip
    """A whole model's package (attnx.runtimes.model_package): its files, its model on `provider`, its golden
    generations replayed token by token."""
    if not _files_hold(root, manifest, report, progress):
        return report  # a damaged or altered file is never handed to onnxruntime
    if "text" in manifest:
        progress("checking the text: the golden prompt encoded, the golden tokens decoded")
        report.checks += check_text(root, manifest)
    onnxruntime = _runtime(manifest, get_provider(provider).backend, report)
    model = served_model(manifest, provider)
    progress(f"loading {model['file']} in onnxruntime {onnxruntime.__version__} ({provider})")
    try:
        runner = open_model(root, manifest, provider)
    except ModelFileError as e:
        report.checks.append(Check("onnxruntime", False, f"{onnxruntime.__version__} cannot load {model['file']} "
                                   f"({_describe_versions(model)}): {e}"))  # fmt: skip
        return report
    with runner:
        report.checks.append(Check("onnxruntime", True, f"{onnxruntime.__version__} loads {model['file']} "
                                   f"({_describe_versions(model)}) on {runner.ort_provider}"))  # fmt: skip
        report.checks += replay_generations(root, manifest, runner, progress)
    return report


# Load and describe -------------------------------------------------------------------------
def load(directory: str | os.PathLike[str], provider: str = "cpu", check_files: bool = True) -> Any:
    """A loaded runner (a context manager) for the package's model on `provider`; for a whole model's package, a
    GenerativeModel (attnx.runtimes.model_package: .generate(prompts, ...)).

    The names are always checked; with check_files (the default) every file's size and
    sha256 too, and the manifest's description of the model against the model's own:
    CheckFailed names a damaged file or a false description before onnxruntime sees it.
    """
    root, manifest = read_manifest(directory)
    if manifest.get("kind") == MODEL_KIND:
        failures = [c for c in _check_files(root, manifest, lambda msg: None) if not c] if check_files else []
        if failures:
            raise CheckFailed(f"{os.fspath(directory)}: " + "; ".join(f"{c.name}: {c.detail}" for c in failures))
        return load_model_package(root, manifest, provider)
    model = _model_for(manifest, provider)
    if check_files:
        failures = [c for c in _check_files(root, manifest, lambda msg: None) if not c]
        if not failures:
            failures = [c for c in [_check_description(root, manifest, model)] if not c]
        if failures:
            raise CheckFailed(f"{os.fspath(directory)}: " + "; ".join(f"{c.name}: {c.detail}" for c in failures))
    return _open_runner(root, manifest, provider, model)


def describe_package(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """What the package is, from its manifest (hashes of the big files are not computed)."""
    _, m = read_manifest(directory)
    if m.get("kind") == MODEL_KIND:
        return {"path": os.fspath(directory), "format": f"{m['format']} {m['format_version']}", "kind": MODEL_KIND,
                **{k: m.get(k) for k in ("source", "inputs", "outputs", "context", "vocab", "padding", "decode",
                                         "verified_on", "versions")},
                "models": [{k: model.get(k) for k in ("file", "providers", "form", "ir_version", "opsets",
                                                      "external_data")} for model in m["models"]],
                "generations": m["generations"], "files": {n: e["size"] for n, e in m["files"].items()}}  # fmt: skip
    parity = m.get("parity", {})
    return {
        "path": os.fspath(directory),
        "format": f"{m['format']} {m['format_version']}",
        "config": m["config"],
        "dtype": m["dtype"],
        "attention": m.get("attention"),
        "inputs": m.get("inputs"),
        "outputs": m.get("outputs"),
        "models": [
            {k: model.get(k) for k in ("file", "providers", "lowering", "decode", "ir_version", "opsets", "external_data")
             if k != "decode" or "decode" in model}  # a step model's form, where the manifest says it
            for model in m["models"]
        ],
        "providers": m.get("providers"),
        "verified_on": m.get("verified_on"),
        "parity": {k: parity.get(k) for k in ("passed", "cases", "max_abs")},
        "golden": [_case_label(case) for case in m["golden"]],
        "files": {name: entry["size"] for name, entry in m["files"].items()},
        "versions": m.get("versions"),
    }
