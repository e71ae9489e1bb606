"""A package's manifest and its names, read safely (the first thing `attnx verify` and `attnx.load` do): the format's
files, every name a manifest or a model gives checked to be a plain file inside the package folder (member_path,
check_external_data), the manifest's own sha256, its fields and their types (read_manifest)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from attnx._io import not_a_file
from attnx.errors import CheckFailed, ConfigError, PackageError, UsageError
from attnx.model.config import AttentionConfig
from attnx.model.contract import MODEL_DTYPES, external_data_locations, external_data_tensors
from attnx.model.onnx_tensors import external_tensors

__all__ = ["Check", "FORMAT", "FORMAT_VERSION", "MANIFEST", "MANIFEST_SUM", "check_external_data", "check_model_data",
           "check_names", "file_sha256", "manifest_bytes", "member_path", "package_root", "parse_manifest", "read_manifest"]



# Verify ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Check:
    """One thing verify checked: a file, the runtime, or one output of one golden case."""

    name: str
    passed: bool
    detail: str
    # A golden output's comparison (attnx.runtimes.compare): its statistics, atol and rtol
    stats: dict[str, float | None] | None = None
    # A failing golden case's localisation (attnx.runtimes.localise.Localisation.to_dict() and its
    # "line"; {"error", "line"} when it could not run), on the case's first failing output
    localisation: dict[str, Any] | None = None

    def __bool__(self) -> bool:
        return self.passed

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FORMAT = "attnx-package"


FORMAT_VERSION = 2  # 2: a whole model's package (MODEL_KIND); a layer's package is written at LAYER_FORMAT_VERSION


LAYER_FORMAT_VERSION = 1


# A whole model's package (attnx build --model): its model, golden generations, the optimization's report
MODEL_KIND = "model"


MANIFEST = "manifest.json"


MANIFEST_SUM = "manifest.sha256"


# A manifest is a few kB; anything much larger is not one, and is not read into memory.
MAX_MANIFEST_BYTES = 16 * 1024**2


_HEX64 = re.compile(r"[0-9a-f]{64}")


_CHUNK = 8 * 1024**2


# Paths ---------------------------------------------------------------------------------
def member_path(root: str, name: Any, what: str) -> str:
    """The path of file `name` inside the package folder `root` (a realpath).

    Refused (PackageError) unless `name` is a plain file name: a string with no folder part,
    not absolute, not '.' or '..', no NUL; and its realpath, symlinks followed, lies inside
    `root`. Nothing is opened here: this runs before anything is read from the file.
    """
    if not isinstance(name, str) or not name:
        raise PackageError(f"{what} gives a file name {name!r} that is not a plain name: refused")
    if os.path.isabs(name) or "/" in name or "\\" in name or "\0" in name or name in (".", ".."):
        raise PackageError(
            f"{what} names {name!r}: a package may only name plain files inside its own folder "
            "(no absolute path, no folder part, no '..'): refused before reading anything"
        )
    path = os.path.join(root, name)
    real = os.path.realpath(path)
    if real == root or os.path.commonpath([root, real]) != root:
        raise PackageError(f"{what} {name!r} resolves to {real!r}, outside the package folder: refused")
    return path


def check_external_data(model_path: str, proto: Any = None) -> None:
    """Refuse (UsageError, exit 2) a model file whose external data does not lie, whole, inside its own
    folder: every location a plain file name (member_path's rule), present, and at least as long as the
    bytes its tensors claim. Read from the model's protobuf alone, before any runtime opens the file: one
    rule for every backend (ONNX Runtime refuses such a file, OpenVINO reads it). proto: the file's protobuf
    where the caller has read it already (without its data), so that it is not parsed again."""
    root = os.path.realpath(os.path.dirname(os.path.abspath(model_path)))
    what = f"the external data location of {os.path.basename(model_path)!r}"
    ends: dict[str, int] = {}
    tensors = external_data_tensors(model_path) if proto is None else external_tensors(proto, model_path)
    for tensor in tensors:
        entries = {e.key: e.value for e in tensor.external_data}
        location = entries.get("location", "")
        path = member_path(root, location, what)
        if not os.path.isfile(path):
            raise UsageError(f"{model_path}: its external data {location!r} {not_a_file(path)}")
        numbers = {key: entries.get(key) or "0" for key in ("offset", "length")}
        for key, text in numbers.items():
            if not text.isdigit():  # digits only: no sign, no space
                raise UsageError(f"{model_path}: tensor {tensor.name!r} gives its external data {key} {text!r}, not a "
                                 "whole number of bytes: refused")  # fmt: skip
        end = int(numbers["offset"]) + int(numbers["length"])
        ends[location] = max(ends.get(location, 0), end)
    for location, end in ends.items():
        size = os.path.getsize(os.path.join(root, location))
        if end > size:
            raise UsageError(f"{model_path}: its tensors claim bytes up to {end} of {location!r}, which holds {size}: "
                             "truncated external data")  # fmt: skip


def file_sha256(path: str, progress: Callable[[str], None] | None = None, label: str = "") -> str:
    digest = hashlib.sha256()
    size = os.path.getsize(path)
    done, step = 0, 1024**3
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            done += len(chunk)
            if progress and size > step and done % step < len(chunk):  # one line per GB of a big file
                progress(f"hashing {label or os.path.basename(path)}: {done / 1e9:.1f}/{size / 1e9:.1f} GB")
    return digest.hexdigest()


# The manifest ------------------------------------------------------------------------
def package_root(directory: str | os.PathLike[str]) -> str:
    path = os.fspath(directory)
    if not os.path.exists(path):
        raise PackageError(f"{path!r} is not a package: it does not exist")
    if not os.path.isdir(path):
        raise PackageError(f"{path!r} is not a package: not a folder")
    root = os.path.realpath(path)
    if not os.path.lexists(os.path.join(root, MANIFEST)):
        raise PackageError(f"{path!r} is not an attnx package: it has no {MANIFEST}")
    return root


def _read_small(root: str, name: str, what: str, limit: int) -> bytes:
    path = member_path(root, name, what)
    if not os.path.isfile(path):
        raise PackageError(f"{what} {name!r} is not a regular file")
    if os.path.getsize(path) > limit:
        raise PackageError(f"{what} {name!r} is larger than {limit} bytes: not an attnx {what}")
    with open(path, "rb") as f:
        return f.read()


def manifest_bytes(root: str) -> tuple[bytes, Check]:
    """The manifest's bytes, and the check of its sha256 against manifest.sha256."""
    data = _read_small(root, MANIFEST, "the manifest", MAX_MANIFEST_BYTES)
    got = hashlib.sha256(data).hexdigest()
    sum_path = member_path(root, MANIFEST_SUM, "the manifest checksum")
    if not os.path.lexists(sum_path):
        return data, Check(MANIFEST_SUM, False, "missing: the manifest's sha256 cannot be checked")
    text = _read_small(root, MANIFEST_SUM, "the manifest checksum", 4096).decode("ascii", "replace").split()
    if len(text) != 2 or text[1] != MANIFEST or not _HEX64.fullmatch(text[0]):
        return data, Check(MANIFEST_SUM, False, f"not a '<sha256>  {MANIFEST}' line (damaged)")
    if text[0] != got:
        return data, Check(
            MANIFEST, False, f"sha256 {got[:16]}... differs from the {text[0][:16]}... in {MANIFEST_SUM} (altered)"
        )
    return data, Check(MANIFEST, True, f"sha256 {got[:16]}... as in {MANIFEST_SUM}")


def _require(cond: bool, key: str, what: str) -> None:
    if not cond:
        raise PackageError(f"{MANIFEST}: {key!r} {what}")


def parse_manifest(data: bytes) -> dict[str, Any]:
    """The manifest as a dict, its structure checked: one PackageError naming the bad key."""
    try:
        m = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PackageError(f"{MANIFEST} is not valid JSON: {e}") from None
    _require(isinstance(m, dict), "(top level)", "must be a JSON object")
    _require(m.get("format") == FORMAT, "format", f"must be {FORMAT!r}: this is not an attnx package manifest")
    version = m.get("format_version")
    _require(isinstance(version, int) and not isinstance(version, bool), "format_version", "must be an integer")
    if version > FORMAT_VERSION:
        raise PackageError(
            f"the package has format version {version}, made by a newer attnx; this attnx reads up to {FORMAT_VERSION}"
        )
    if m.get("kind") == MODEL_KIND:
        return _parse_model_manifest(m)
    _require(isinstance(m.get("config"), dict), "config", "must be an object")
    try:
        AttentionConfig.from_dict(dict(m["config"]))
    except ConfigError as e:
        raise PackageError(f"{MANIFEST}: 'config' is invalid: {e}") from None
    _require(m.get("dtype") in MODEL_DTYPES, "dtype", f"must be one of {', '.join(MODEL_DTYPES)}")
    _parse_files_and_models(m)
    files = m["files"]
    golden = m.get("golden")
    _require(isinstance(golden, list) and golden, "golden", "must be a non-empty list")
    for i, case in enumerate(golden):
        _require(isinstance(case, dict) and case.get("file") in files, f"golden[{i}].file", "must be one of 'files'")
        _require(isinstance(case.get("inputs"), list) and case["inputs"], f"golden[{i}].inputs", "must be a list")
        _require(isinstance(case.get("outputs"), list) and case["outputs"], f"golden[{i}].outputs", "must be a list")
        size = case.get("problem_size")
        _require(
            isinstance(size, dict)
            and isinstance(size.get("k"), int)
            and isinstance(size.get("score_max"), (int, float)),
            f"golden[{i}].problem_size",
            "must be {'k': int, 'score_max': number}",
        )
    return m


def _parse_files_and_models(m: dict[str, Any]) -> None:
    files = m.get("files")
    _require(isinstance(files, dict) and files, "files", "must be a non-empty object")
    for name, entry in files.items():
        _require(isinstance(entry, dict) and isinstance(entry.get("size"), int) and entry["size"] >= 0
                 and isinstance(entry.get("sha256"), str) and _HEX64.fullmatch(entry["sha256"]) is not None,
                 f"files.{name}", "must be {'size': bytes, 'sha256': 64 hex digits}")  # fmt: skip
    models = m.get("models")
    _require(isinstance(models, list) and models, "models", "must be a non-empty list")
    for i, model in enumerate(models):
        _require(isinstance(model, dict) and isinstance(model.get("file"), str), f"models[{i}].file", "must be a name")
        _require(model["file"] in files, f"models[{i}].file", "must be one of 'files'")
        providers = model.get("providers")
        _require(isinstance(providers, list) and providers, f"models[{i}].providers", "must be a non-empty list")
        _require(isinstance(model.get("ir_version"), int), f"models[{i}].ir_version", "must be an integer")
        _require(isinstance(model.get("opsets"), dict), f"models[{i}].opsets", "must be an object")
        _require(isinstance(model.get("external_data", []), list), f"models[{i}].external_data", "must be a list")


def _whole(value: Any, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _parse_model_manifest(m: dict[str, Any]) -> dict[str, Any]:
    """A whole model's manifest (MODEL_KIND): its files and models as a layer's, its golden generations, the bound
    they are replayed under, and what generation needs (context, vocabulary, padding, batch)."""
    _parse_files_and_models(m)
    golden = m.get("generations")
    _require(isinstance(golden, dict) and golden.get("file") in m["files"], "generations.file", "must be one of 'files'")
    _require(_whole(golden.get("requests"), 1), "generations.requests", "must be a whole number of requests")
    _require(_whole(golden.get("max_batch"), 1), "generations.max_batch", "must be a whole number, 1 or more")
    tol = m.get("tolerance")
    _require(isinstance(tol, dict) and tol.get("dtype") in MODEL_DTYPES and _whole(tol.get("blocks"), 1)
             and _whole(tol.get("k"), 1), "tolerance",
             "must be {'dtype': a model dtype, 'blocks': int, 'k': int}")  # fmt: skip
    for key in ("context", "vocab"):
        _require(m.get(key) is None or _whole(m.get(key), 1), key, "must be a whole number or null")
    _require(m.get("padding") in ("left", "right"), "padding", "must be 'left' or 'right'")
    _require(m.get("one_row") is None or isinstance(m["one_row"], str), "one_row", "must be a reason or null")
    return m


def read_manifest(directory: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    """(package root, manifest) with the manifest's sha256 and every name in it checked.

    PackageError (exit 2): not a package, or a name pointing outside it. CheckFailed (exit
    1): the manifest does not match manifest.sha256.
    """
    root = package_root(directory)
    data, check = manifest_bytes(root)
    if not check:
        raise CheckFailed(f"{os.fspath(directory)}: {check.name}: {check.detail}")
    manifest = parse_manifest(data)
    check_names(root, manifest)
    return root, manifest


def check_names(root: str, manifest: Mapping[str, Any]) -> None:
    """Every file the manifest names is a plain name inside the package (nothing is read)."""
    for name in manifest["files"]:
        member_path(root, name, f"{MANIFEST} 'files'")
        if name in (MANIFEST, MANIFEST_SUM):
            raise PackageError(f"{MANIFEST} lists {name!r} among its files: it cannot hash itself")
    for model in manifest["models"]:
        for name in model.get("external_data", []):
            member_path(root, name, f"{MANIFEST} external data of {model['file']!r}")
            if name not in manifest["files"]:
                raise PackageError(f"{MANIFEST}: external data {name!r} of {model['file']!r} is not among its files")


# External data of a model ---------------------------------------------------------------
def check_model_data(root: str, manifest: Mapping[str, Any], model_file: str) -> None:
    """The model's own external-data entries, checked as the manifest's names are, before
    onnxruntime opens the model: a crafted model.onnx cannot make it read outside."""
    path = member_path(root, model_file, "the model")
    for location in external_data_locations(path):
        member_path(root, location, f"the external data location of {model_file!r}")
        if location not in manifest["files"]:
            raise PackageError(
                f"{model_file!r} stores data in {location!r}, which {MANIFEST} does not list "
                "(so it is not hashed): refused"
            )
