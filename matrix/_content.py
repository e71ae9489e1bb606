"""Files travel by content: the driver names each file of a package (or of a model it exported,
or of a model to audit and its checkpoint) by its sha256, cuts it into parts of at most
PART_BYTES, each named by its own sha256, and puts each part in the cluster's object store once;
a node writes the parts into a folder of its own cache, checking each name (a plain name inside
the folder: the verify rules of attnx.runtimes.package), each part's hash and each file's hash
before anything runs. Neither side holds more than one part of a file in memory, so a model's
data file larger than the driver's or a node's memory travels too.

    bundle = {"key": <the manifest's sha256, or the files'>, "files": {name: sha256},
              "parts": {name: [sha256 of each part, in order]}, "part_bytes": PART_BYTES}

The cache folder is named by the key. A folder already there is used only when every file in it
still has its hash; otherwise it is rebuilt. Folders are assembled under a temporary name and
renamed into place, so two cases on one node never see half a folder.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator

from attnx.errors import PackageError
from attnx.runtimes.package import MANIFEST, MANIFEST_SUM, file_sha256, member_path

__all__ = ["PART_BYTES", "bundle_parts", "cache_root", "files_bundle", "materialize", "package_bundle", "part_digests"]

_HEX64 = re.compile(r"[0-9a-f]{64}")
# The largest object a file travels in: what the driver reads into memory to put, and a node to write, at a time
# (Ray's object store spills what does not fit to disk; one object must fit it whole).
PART_BYTES = 64 * 1024**2


def _digests(path: str, part_bytes: int) -> tuple[str, list[str]]:
    """(the file's sha256, the sha256 of each of its parts), in one read of the file."""
    whole, parts = hashlib.sha256(), []
    with open(path, "rb") as f:
        while data := f.read(part_bytes):
            whole.update(data)
            parts.append(hashlib.sha256(data).hexdigest())
    return whole.hexdigest(), parts or [hashlib.sha256(b"").hexdigest()]  # an empty file: one empty part


def _bundle(paths: dict[str, str], part_bytes: int) -> dict:
    files, parts = {}, {}
    for name, path in paths.items():
        files[name], parts[name] = _digests(path, part_bytes)
    return {"files": files, "parts": parts, "part_bytes": part_bytes}


def package_bundle(root: str, manifest: dict, part_bytes: int = PART_BYTES) -> dict:
    """The bundle of a package folder (its manifest already read: names checked): the manifest,
    its checksum and every file it lists, each by the sha256 of the bytes on this disk (a file
    altered here travels altered, and the node's verify names it)."""
    names = [MANIFEST, MANIFEST_SUM, *manifest["files"]]
    paths = {name: member_path(root, name, "a package file") for name in names}
    bundle = _bundle({n: p for n, p in paths.items() if os.path.isfile(p)}, part_bytes)
    return {"key": bundle["files"][MANIFEST], **bundle}


def files_bundle(paths: list[str], part_bytes: int = PART_BYTES) -> dict:
    """The bundle of loose files (an exported model and its data file, a model to audit and its data
    files, a checkpoint's files), keyed by their names and hashes."""
    bundle = _bundle({os.path.basename(p): p for p in paths}, part_bytes)
    key = hashlib.sha256("".join(f"{n}\0{h}\0" for n, h in sorted(bundle["files"].items())).encode()).hexdigest()
    return {"key": key, **bundle}


def part_digests(bundle: dict) -> list[str]:
    """Every object a node fetches to materialize the bundle: each file's parts."""
    return [d for name in bundle["files"] for d in bundle["parts"][name]]


def bundle_parts(bundle: dict, name: str, path: str, skip: Callable[[str], bool] = lambda d: False
                 ) -> Iterator[tuple[str, bytes]]:  # fmt: skip
    """(sha256, bytes) of each part of file `name` of the bundle, read from `path` one part at a time
    (a part for which skip(sha256) holds is not read: already put)."""
    with open(path, "rb") as f:
        for i, digest in enumerate(bundle["parts"][name]):
            if skip(digest):
                continue
            f.seek(i * bundle["part_bytes"])
            yield digest, f.read(bundle["part_bytes"])


def cache_root() -> str:
    """The node's cache of materialized bundles (one per user)."""
    return os.path.join(tempfile.gettempdir(), f"attnx-matrix-cache-{os.getuid()}")


def _intact(folder: str, files: dict[str, str]) -> bool:
    try:
        return all(file_sha256(member_path(folder, n, "a cached file")) == h for n, h in files.items())
    except (OSError, PackageError):
        return False


def _check_digest(name: str, digest: object, what: str) -> None:
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        raise PackageError(f"{name!r} arrives with {what} {digest!r}, not a sha256")


def materialize(bundle: dict, fetch: Callable[[str], bytes], root: str | None = None) -> str:
    """The folder holding the bundle's files on this node, written part by part from
    `fetch(sha256) -> bytes` where it is not already cached intact. PackageError for a name that is
    not a plain file name, or a part or a file whose bytes do not have their hash: nothing of such
    a bundle is used."""
    key, files, parts = bundle["key"], bundle["files"], bundle.get("parts") or {}
    if not isinstance(key, str) or not _HEX64.fullmatch(key):
        raise PackageError(f"bundle key {key!r} is not a sha256")
    root = root or cache_root()
    os.makedirs(root, mode=0o700, exist_ok=True)
    folder = os.path.join(root, key)
    if os.path.isdir(folder) and _intact(folder, files):
        return folder
    stage = tempfile.mkdtemp(prefix=f".{key[:16]}.partial-", dir=root)
    try:
        for name, digest in files.items():
            path = member_path(os.path.realpath(stage), name, "a file sent to this node")
            _check_digest(name, digest, "sha256")
            digests = parts.get(name, [digest])
            if not isinstance(digests, list) or not digests:
                raise PackageError(f"{name!r} arrives with parts {digests!r}, not a list of sha256")
            whole = hashlib.sha256()
            with open(path, "wb") as f:
                for i, part in enumerate(digests):
                    _check_digest(name, part, f"part {i}")
                    data = fetch(part)
                    got = hashlib.sha256(data).hexdigest()
                    if got != part:
                        raise PackageError(f"{name!r} part {i} arrived with sha256 {got[:16]}..., not the "
                                           f"{part[:16]}... it was sent as")  # fmt: skip
                    whole.update(data)
                    f.write(data)
            if whole.hexdigest() != digest:
                raise PackageError(f"{name!r} arrived with sha256 {whole.hexdigest()[:16]}..., not the "
                                   f"{digest[:16]}... it was sent as")  # fmt: skip
        if os.path.isdir(folder):  # there but damaged: replaced
            shutil.rmtree(folder, ignore_errors=True)
        try:
            os.rename(stage, folder)
        except OSError:  # another case on this node put it there first
            if not _intact(folder, files):
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return folder
