"""The plan: what the matrix runs (sources x jobs x backends x lowerings x dtypes x shapes), read
from a JSON (or YAML) file, checked before any work, and expanded into cases.

A plan names its model sources (`presets`, `configs`: AttentionConfig JSON files, `packages`:
folders built by `attnx build`), the jobs (`parity`, `verify`, `bench`) and the axes. Every axis
may be set at the top (for every job) and overridden in a job's own object:

    {"presets": ["tiny"], "packages": ["pkg"],
     "backends": ["torch", "ort-cpu"], "lowerings": ["decomposed", "ort-fused"],
     "batches": [1, 2], "seqs": [1, 7],
     "requirements": {"torch": {"tagged": 1}, "ort-cuda": {"GPU": 1}},
     "jobs": {"parity": {}, "verify": {"backends": ["ort-cpu", "ort-cuda"]},
              "bench": {"backends": ["ort-cpu"], "lowerings": ["ort-fused"], "repeat": 5}}}

`jobs` may also be a list of job names (no overrides). Which sources each job takes: parity and
bench run presets and configs (seeded weights, `seed`); verify runs packages; bench also times a
package's own model on the ort-* backends; audit runs `models`, whole models another tool exported
(`attnx audit`), one case per attention block and backend:

    {"models": [{"model": "llama/model.onnx", "checkpoint": "llama-hf", "layers": "all"}],
     "backends": ["ort-cpu"], "jobs": ["audit"]}

A model entry may also be the model's path alone (no checkpoint, every block). `layers` is "all"
(the default: the blocks are counted from the graph, no weight read) or a list of block indices.
The files an audit case needs are the model, the external data files it names (each a plain name
inside the model's folder: attnx.runtimes.package.check_external_data) and the checkpoint's
config.json and safetensors files (each inside the checkpoint's folder, links out of it refused):
listed once here, they travel to a Ray node by content (attnx.matrix._content). Relative paths
are read from the plan file's folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from attnx.errors import ConfigError, UsageError
from attnx.model.config import AttentionConfig, load_config, preset
from attnx.model.contract import (
    AUDIT_BACKENDS,
    BACKEND_NAMES,
    BENCH_ORT_LOWERINGS,
    LOWERINGS,
    MODEL_DTYPES,
    REFERENCE,
    TORCH_CORES,
    check_choice,
    external_data_locations,
    provider_of_backend,
)
from attnx.model.importers import checkpoint_files
from attnx.runtimes._manifest import check_external_data, member_path, read_manifest
from attnx.runtimes.parity import DEFAULT_BATCHES, DEFAULT_MEM_SEQS, DEFAULT_SEQS

__all__ = ["BENCH_SLOT", "JOBS", "CaseSpec", "JobAxes", "MatrixPlan", "Source", "load_plan"]

JOBS = ("parity", "verify", "bench", "audit")
# The Ray resource a node declares once to take timed work: a bench case holds it while it runs,
# so that at most one timed case runs on a node at a time.
BENCH_SLOT = "attnx_bench_slot"
_AXES = ("backends", "lowerings", "dtypes", "batches", "seqs", "mem_seqs")
_BENCH_KEYS = ("repeat", "warmup", "threads")
_TOP_KEYS = frozenset(
    {"presets", "configs", "packages", "models", "jobs", "requirements", "seed", "timeout_s", "retries",
     "unschedulable_timeout_s", *_AXES, *_BENCH_KEYS}
)  # fmt: skip
_DEFAULTS: dict[str, Any] = {
    "backends": ["torch", "ort-cpu"],
    "lowerings": list(BENCH_ORT_LOWERINGS),
    "dtypes": ["fp32"],
    "batches": list(DEFAULT_BATCHES),
    "seqs": list(DEFAULT_SEQS),
    "mem_seqs": list(DEFAULT_MEM_SEQS),
    "repeat": 10,
    "warmup": 2,
    "threads": None,  # None: every core of the node the case runs on
}


@dataclasses.dataclass(frozen=True)
class Source:
    """A model source: a preset, a config file, a package or a whole model to audit. label names it
    in case ids."""

    kind: str  # "preset" | "config" | "package" | "model"
    label: str  # "preset:tiny", "config:cfg/causal.json", "package:pkg", "model:llama/model.onnx"
    config: AttentionConfig | None  # None for a whole model (each block has its own)
    path: str | None = None  # the config file, package folder or model file (absolute)
    manifest: dict[str, Any] | None = None  # a package's manifest (its names and sha256 checked)
    files: tuple[str, ...] = ()  # a model's files: the model first, then its external data files
    checkpoint: str | None = None  # a model's Hugging Face checkpoint folder (absolute)
    checkpoint_files: tuple[str, ...] = ()  # the checkpoint's files the import reads
    layers: tuple[int, ...] = ()  # a model's blocks to audit


@dataclasses.dataclass(frozen=True)
class JobAxes:
    backends: tuple[str, ...]
    lowerings: tuple[str, ...]
    dtypes: tuple[str, ...]
    batches: tuple[int, ...]
    seqs: tuple[int, ...]
    mem_seqs: tuple[int, ...]
    repeat: int
    warmup: int
    threads: int | None


@dataclasses.dataclass(frozen=True)
class CaseSpec:
    """One case: a job on one source, backend, lowering, dtype and shape, with the host
    resources it needs. `id` is stable across runs (what --resume matches)."""

    id: str
    job: str
    source: str  # the Source's label
    backend: str
    lowering: str | None  # the ONNX lowering (ort-*), the torch core (bench on torch), None (torch parity, audit)
    dtype: str | None  # None for an audit case (the model's own)
    batch: int | None
    seq: int | None
    mem_seq: int | None
    requires: dict[str, float]  # Ray resources (CPU and GPU included) beyond the default one CPU
    timed: bool  # a bench case: holds the node's bench slot
    layer: int | None = None  # an audit case's block (graph order, from 0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class MatrixPlan:
    path: str
    sha256: str  # of the plan as read (its canonical JSON): --resume refuses a report of another plan
    data: dict[str, Any]
    sources: list[Source]
    jobs: dict[str, JobAxes]
    requirements: dict[str, dict[str, float]]
    seed: int = 0
    timeout_s: float = 600.0
    retries: int = 2
    unschedulable_timeout_s: float = 60.0

    def source(self, label: str) -> Source:
        return next(s for s in self.sources if s.label == label)

    def cases(self) -> list[CaseSpec]:
        """Every case of the plan, in order: job by job, source by source."""
        out: list[CaseSpec] = []
        for job, axes in self.jobs.items():
            for src in self.sources:
                out += _job_cases(self, job, axes, src)
        ids = [c.id for c in out]
        dup = next((i for i in ids if ids.count(i) > 1), None)
        if dup:  # cannot happen with distinct sources; a guard for the resume key
            raise UsageError(f"the plan gives case {dup!r} twice")
        return out


def _job_cases(plan: MatrixPlan, job: str, axes: JobAxes, src: Source) -> list[CaseSpec]:
    if job == "audit" or src.kind == "model":  # the audit runs whole models, and whole models only the audit
        if job != "audit" or src.kind != "model":
            return []
        return [CaseSpec(f"audit:{src.label}:{backend}:layer{layer}", job, src.label, backend, None, None, None, None,
                         None, dict(plan.requirements.get(backend, {})), False, layer)
                for backend in axes.backends if backend in AUDIT_BACKENDS for layer in src.layers]  # fmt: skip
    out = []
    shapes = _shapes(src.config, axes)

    def add(backend: str, lowering: str | None, dtype: str, shape: tuple | None, timed: bool = False) -> None:
        batch, seq, mem_seq = shape or (None, None, None)
        parts = [job, src.label, backend, lowering or "-", dtype]
        if shape:
            parts += [f"b{batch}", f"s{seq}"] + ([f"m{mem_seq}"] if mem_seq else [])
        requires = dict(plan.requirements.get(backend, {}))
        out.append(CaseSpec(":".join(parts), job, src.label, backend, lowering, dtype, batch, seq, mem_seq,
                            requires, timed))  # fmt: skip

    if job == "verify":
        if src.kind == "package":
            for backend in axes.backends:
                if provider_of_backend(backend) is not None:  # verify runs a package on a provider
                    add(backend, src.manifest.get("attention"), src.manifest["dtype"], None)
        return out
    if src.kind == "package":
        if job == "bench":  # the package's own model, on the ort-* backends
            for backend in axes.backends:
                if provider_of_backend(backend) is not None:
                    for shape in shapes:
                        add(backend, src.manifest.get("attention"), src.manifest["dtype"], shape, timed=True)
        return out  # parity needs the weights, which a package holds only inside its model
    for dtype in axes.dtypes:
        for backend in axes.backends:
            if provider_of_backend(backend) is not None:
                lowerings: list[str | None] = list(axes.lowerings)
            elif job == "parity":
                lowerings = [None]  # the torch module (reference: checked against torch in float64)
            else:  # bench on torch: the module's cores among the lowerings asked for
                lowerings = [c for c in TORCH_CORES if c in axes.lowerings] or [TORCH_CORES[0]]
            if job == "bench" and backend == REFERENCE:
                continue  # the reference is written to be read, not timed
            for lowering in lowerings:
                for shape in shapes:
                    add(backend, lowering, dtype, shape, timed=job == "bench")
    return out


def _shapes(config: AttentionConfig, axes: JobAxes) -> list[tuple[int, int, int | None]]:
    mems: list[int | None] = list(axes.mem_seqs) if config.cross else [None]
    return [(b, s, m) for b in axes.batches for s in axes.seqs for m in mems]


# Reading -----------------------------------------------------------------------------------------
def _read(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise UsageError(
            f"plan {path!r} does not exist" if not os.path.exists(path) else f"plan {path!r} is not a file"
        )
    with open(path, "rb") as f:
        raw = f.read(4 * 1024**2 + 1)
    if len(raw) > 4 * 1024**2:
        raise UsageError(f"plan {path!r} is larger than 4 MB: not a plan")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"plan {path!r} is not UTF-8 text") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise UsageError(
                f"plan {path!r} is YAML, which needs PyYAML: pip install pyyaml (or write it as JSON)"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise UsageError(f"plan {path!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UsageError(f"plan {path!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise UsageError(f"plan {path!r} must be an object (JSON) or a mapping (YAML)")
    return data


def _list(data: Mapping[str, Any], key: str, kind: type, where: str) -> list[Any] | None:
    if key not in data:
        return None
    value = data[key]
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        value = [value]
    ok = isinstance(value, list) and value and all(isinstance(v, kind) and not isinstance(v, bool) for v in value)
    if not ok:
        raise UsageError(f"plan {where}{key!r} must be a non-empty list of {kind.__name__}s, got {value!r}")
    return value


def _positive_ints(values: Sequence[int], key: str, where: str) -> None:
    if any(v < 1 for v in values):
        raise UsageError(f"plan {where}{key!r} must hold positive integers, got {list(values)}")


def _number(data: Mapping[str, Any], key: str, default: Any, low: float, where: str = "", integer: bool = False) -> Any:
    value = data.get(key, default)
    if value is None and default is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value >= low or math.isnan(value):
        what = "an integer" if integer else "a number"
        raise UsageError(f"plan {where}{key!r} must be {what} of at least {low:g}, got {value!r}")
    return value


def _axes(data: Mapping[str, Any], base: Mapping[str, Any], where: str) -> dict[str, Any]:
    out = dict(base)
    for key, kind in (("backends", str), ("lowerings", str), ("dtypes", str), ("batches", int), ("seqs", int),
                      ("mem_seqs", int)):  # fmt: skip
        value = _list(data, key, kind, where)
        if value is not None:
            out[key] = value
    for key in _BENCH_KEYS:
        if key in data:
            out[key] = _number(data, key, None, 0 if key == "warmup" else 1, where, integer=True)
    for name in out["backends"]:
        check_choice(f"backend in plan {where}'backends':", name, BACKEND_NAMES)
    exportable = [lw.name for lw in LOWERINGS.values() if lw.export]
    for name in out["lowerings"]:
        check_choice(f"lowering in plan {where}'lowerings':", name, [*exportable, *TORCH_CORES])
    for name in out["dtypes"]:
        check_choice(f"dtype in plan {where}'dtypes':", name, MODEL_DTYPES)
    for key in ("batches", "seqs", "mem_seqs"):
        _positive_ints(out[key], key, where)
    return out


def _requirements(data: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    req = data.get("requirements", {})
    if not isinstance(req, dict):
        raise UsageError(f"plan 'requirements' must map a backend to Ray resources, got {req!r}")
    out = {}
    for backend, resources in req.items():
        check_choice("backend in plan 'requirements':", backend, BACKEND_NAMES)
        if not isinstance(resources, dict) or not resources:
            raise UsageError(
                f'plan requirements[{backend!r}] must be a non-empty object of Ray resources, e.g. {{"GPU": 1}}'
            )
        for name, amount in resources.items():
            if not isinstance(name, str) or not name or name == BENCH_SLOT:
                raise UsageError(
                    f"plan requirements[{backend!r}] names resource {name!r}: not a resource a plan may ask for"
                )
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
                raise UsageError(f"plan requirements[{backend!r}][{name!r}] must be a positive number, got {amount!r}")
        out[backend] = {k: float(v) for k, v in resources.items()}
    return out


def _sources(data: Mapping[str, Any], folder: str) -> list[Source]:
    sources = []
    for name in _list(data, "presets", str, "") or []:
        try:
            sources.append(Source("preset", f"preset:{name}", preset(name)))
        except ConfigError as e:
            raise UsageError(f"plan 'presets': {e}") from None
    for name in _list(data, "configs", str, "") or []:
        path = os.path.join(folder, name)
        try:
            config = load_config(path)
        except ConfigError as e:
            raise UsageError(f"plan 'configs': {e}") from None
        sources.append(Source("config", f"config:{name}", config, os.path.abspath(path)))
    for name in _list(data, "packages", str, "") or []:
        path = os.path.join(folder, name)
        root, manifest = read_manifest(path)  # not a package, a name outside it: PackageError (exit 2)
        sources.append(Source("package", f"package:{name}", AttentionConfig.from_dict(dict(manifest["config"])), root,
                              manifest))  # fmt: skip
    models = data.get("models", [])
    if not isinstance(models, list):
        models = [models]
    for i, entry in enumerate(models):
        sources.append(_model_source(entry, folder, f"models[{i}]"))
    labels = [s.label for s in sources]
    if len(set(labels)) != len(labels):
        raise UsageError(f"plan names a source twice: {', '.join(sorted({x for x in labels if labels.count(x) > 1}))}")
    if not sources:
        raise UsageError("plan names no source: give 'presets', 'configs', 'packages' and/or 'models'")
    return sources


_MODEL_KEYS = frozenset({"model", "checkpoint", "layers"})


def _model_source(entry: Any, folder: str, where: str) -> Source:
    """A whole model to audit: its files (the model, its external data) and its checkpoint's, each
    checked to lie inside its own folder, and the blocks to audit (counted from the graph for "all")."""
    if isinstance(entry, str):
        entry = {"model": entry}
    if not isinstance(entry, dict) or not isinstance(entry.get("model"), str) or not entry["model"]:
        raise UsageError(f"plan {where} must be a model's path, or an object with 'model' (a path), 'checkpoint' "
                         f"and 'layers', got {entry!r}")  # fmt: skip
    unknown = sorted(set(entry) - _MODEL_KEYS)
    if unknown:
        raise UsageError(f"plan {where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_MODEL_KEYS))})")
    name = entry["model"]
    path = os.path.abspath(os.path.join(folder, name))
    if not os.path.isfile(path):
        raise UsageError(f"plan {where}: model {name!r} " + ("does not exist" if not os.path.exists(path)
                                                              else "is not a file"))  # fmt: skip
    try:
        check_external_data(path)  # every data file a plain name inside the model's folder, whole: before reading it
        root = os.path.realpath(os.path.dirname(path))
        what = f"the external data of {name!r}"
        files = [path, *(member_path(root, loc, what) for loc in external_data_locations(path))]
    except UsageError as e:
        raise UsageError(f"plan {where}: {e}") from None
    checkpoint, ckpt_files = None, []
    if entry.get("checkpoint") is not None:
        if not isinstance(entry["checkpoint"], str) or not entry["checkpoint"]:
            raise UsageError(f"plan {where} 'checkpoint' must be a folder's path, got {entry['checkpoint']!r}")
        checkpoint = os.path.abspath(os.path.join(folder, entry["checkpoint"]))
        try:
            real = os.path.realpath(checkpoint)
            ckpt_files = [member_path(real, n, f"checkpoint {entry['checkpoint']!r}: its file")
                          for n in checkpoint_files(checkpoint)]  # fmt: skip
        except UsageError as e:
            raise UsageError(f"plan {where}: {e}") from None
    count = _block_count(path, where)
    layers = entry.get("layers", "all")
    if layers == "all":
        layers = list(range(count))
    elif not (isinstance(layers, list) and layers and all(isinstance(i, int) and not isinstance(i, bool)
                                                           for i in layers)):  # fmt: skip
        raise UsageError(f"plan {where} 'layers' must be \"all\" or a non-empty list of block indices, got {layers!r}")
    outside = [i for i in layers if not 0 <= i < count]
    if outside or len(set(layers)) != len(layers):
        raise UsageError(f"plan {where} 'layers' {layers}: "
                         + (f"{outside[0]} is not a block of {name!r}, which has {count} (0 to {count - 1})"
                            if outside else "a block given twice"))  # fmt: skip
    return Source("model", f"model:{name}", None, path, files=tuple(files), checkpoint=checkpoint,
                  checkpoint_files=tuple(ckpt_files), layers=tuple(layers))  # fmt: skip


def _block_count(path: str, where: str) -> int:
    """How many attention blocks the model's graph holds (attnx.export._blocks.block_nodes: no weight read)."""
    import onnx_ir as ir

    from attnx.export._blocks import block_nodes  # onnx-ir: only for a plan that audits a model

    try:
        model = ir.load(path)  # the graph; external data stays unread
    except Exception as e:  # noqa: BLE001 - protobuf's and onnx-ir's own errors: a file that is no ONNX model
        raise UsageError(f"plan {where}: {os.path.basename(path)!r} is not an ONNX model: {e}") from None
    count = len(block_nodes(model))
    if not count:
        raise UsageError(f"plan {where}: {os.path.basename(path)!r}: no attention block found")
    return count


def load_plan(path: str | os.PathLike[str]) -> MatrixPlan:
    """Read and check a plan file; one UsageError (exit 2) naming what is wrong."""
    path = os.fspath(path)
    data = _read(path)
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise UsageError(f"plan {path!r}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_TOP_KEYS))})")
    folder = os.path.dirname(os.path.abspath(path))
    base = _axes(data, _DEFAULTS, "")
    jobs_value = data.get("jobs")
    if isinstance(jobs_value, list) and jobs_value and all(isinstance(j, str) for j in jobs_value):
        jobs_value = {j: {} for j in jobs_value}
    if not isinstance(jobs_value, dict) or not jobs_value:
        raise UsageError(
            f"plan 'jobs' must name the jobs to run ({', '.join(JOBS)}): a list, or an object of overrides"
        )
    jobs = {}
    for job, overrides in jobs_value.items():
        check_choice("job in plan 'jobs':", job, JOBS)
        if not isinstance(overrides, dict):
            raise UsageError(f"plan jobs[{job!r}] must be an object of axis overrides, got {overrides!r}")
        unknown = sorted(set(overrides) - set(_AXES) - set(_BENCH_KEYS))
        if unknown:
            raise UsageError(
                f"plan jobs[{job!r}]: unknown key {unknown[0]!r} (known: {', '.join(_AXES + _BENCH_KEYS)})"
            )
        jobs[job] = JobAxes(**{k: tuple(v) if isinstance(v, list) else v
                               for k, v in _axes(overrides, base, f"jobs[{job!r}] ").items()})  # fmt: skip
    plan = MatrixPlan(
        path=os.path.abspath(path),
        sha256=hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest(),
        data=data,
        sources=_sources(data, folder),
        jobs=jobs,
        requirements=_requirements(data),
        seed=_number(data, "seed", 0, 0, integer=True),
        timeout_s=float(_number(data, "timeout_s", 600.0, 1e-3)),
        retries=_number(data, "retries", 2, 0, integer=True),
        unschedulable_timeout_s=float(_number(data, "unschedulable_timeout_s", 60.0, 0)),
    )
    if "audit" in jobs and not set(jobs["audit"].backends) & set(AUDIT_BACKENDS):
        raise UsageError(f"plan: the audit runs on {', '.join(AUDIT_BACKENDS)}, and its backends are "
                         f"{', '.join(jobs['audit'].backends)}: give one in jobs['audit'] 'backends'")  # fmt: skip
    if not plan.cases():
        raise UsageError(
            "the plan has no case: verify needs 'packages' and an ort-* backend; parity needs 'presets' or 'configs'; "
            "audit needs 'models'"
        )
    return plan
