"""Files travel by content: the driver names each file of a package (or of a model it exported,
or of a model to audit and its checkpoint) by its sha256 and puts the bytes in the cluster's
object store once per hash; a node writes them into a folder of its own cache, checking each name
(a plain name inside the folder: the verify rules of attnx.runtimes.package) and each hash
before anything runs.

    bundle = {"key": <the manifest's sha256, or the model's>, "files": {name: sha256}}

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
from collections.abc import Callable

from attnx.errors import PackageError
from attnx.runtimes.package import MANIFEST, MANIFEST_SUM, file_sha256, member_path

__all__ = ["cache_root", "files_bundle", "materialize", "package_bundle"]

_HEX64 = re.compile(r"[0-9a-f]{64}")


def package_bundle(root: str, manifest: dict) -> dict:
    """The bundle of a package folder (its manifest already read: names checked): the manifest,
    its checksum and every file it lists, each by the sha256 of the bytes on this disk (a file
    altered here travels altered, and the node's verify names it)."""
    names = [MANIFEST, MANIFEST_SUM, *manifest["files"]]
    files = {name: file_sha256(member_path(root, name, "a package file")) for name in names
             if os.path.isfile(member_path(root, name, "a package file"))}  # fmt: skip
    return {"key": files[MANIFEST], "files": files}


def files_bundle(paths: list[str]) -> dict:
    """The bundle of loose files (an exported model and its data file, a model to audit and its data
    files, a checkpoint's files), keyed by their names and hashes."""
    files = {os.path.basename(p): file_sha256(p) for p in paths}
    key = hashlib.sha256("".join(f"{n}\0{h}\0" for n, h in sorted(files.items())).encode()).hexdigest()
    return {"key": key, "files": files}


def cache_root() -> str:
    """The node's cache of materialized bundles (one per user)."""
    return os.path.join(tempfile.gettempdir(), f"attnx-matrix-cache-{os.getuid()}")


def _intact(folder: str, files: dict[str, str]) -> bool:
    try:
        return all(file_sha256(member_path(folder, n, "a cached file")) == h for n, h in files.items())
    except (OSError, PackageError):
        return False


def materialize(bundle: dict, fetch: Callable[[str], bytes], root: str | None = None) -> str:
    """The folder holding the bundle's files on this node, written from `fetch(sha256) -> bytes`
    where it is not already cached intact. PackageError for a name that is not a plain file name
    or bytes that do not have their hash: nothing of such a bundle is used."""
    key, files = bundle["key"], bundle["files"]
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
            if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
                raise PackageError(f"{name!r} arrives with {digest!r}, not a sha256")
            data = fetch(digest)
            got = hashlib.sha256(data).hexdigest()
            if got != digest:
                raise PackageError(
                    f"{name!r} arrived with sha256 {got[:16]}..., not the {digest[:16]}... it was sent as"
                )
            with open(path, "wb") as f:
                f.write(data)
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
