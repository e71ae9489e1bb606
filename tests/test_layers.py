"""The layers import in one direction (docs/about.md, "Architecture"), read from the source with ast.

    ground    attnx.model, and attnx's own helpers (attnx, attnx.errors, attnx._io, attnx._ray, attnx._signals,
              attnx._text)
    graph     attnx.export          run   attnx.runtimes        (siblings: neither imports the other)
    workflows attnx.workflows
    bench     attnx.bench           serve attnx.serve           (siblings)
    top       attnx.cli, attnx.commands

A module imports its own layer and the layers below it, never above, whether the import is at
module level or inside a function. An import of an attnx module inside a function is allowed
only where the imported module brings in a heavy optional library at module level (torch,
onnx-ir, onnxscript, onnxruntime, matplotlib; the serving stack: fastapi, uvicorn, ray): a lazy import of
such a library, never a way to dodge a cycle. The tests at the end plant a back-import and a light in-function import and see
the checker catch them.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
import sys
from collections.abc import Mapping

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# heavy: the optional libraries a command that does not need them never imports (the serving stack among them)
HEAVY = frozenset({"torch", "onnx_ir", "onnxscript", "onnxruntime", "matplotlib", "fastapi", "uvicorn", "ray"})
GROUND_HELPERS = frozenset({"attnx", "attnx.errors", "attnx._io", "attnx._ray", "attnx._signals", "attnx._text"})
# (layer, rank). Same rank, different layer: siblings, which may not import each other.
LAYERS = {
    "attnx.model": ("ground", 0),
    "attnx.export": ("graph", 1),
    "attnx.runtimes": ("run", 1),
    "attnx.workflows": ("workflows", 2),
    "attnx.bench": ("bench", 3),
    # attnx serve: the OpenAI API over a package's engine loop (runtimes), for the CLI; bench's sibling
    "attnx.serve": ("serve", 3),
    # issue 15: the matrix runs parity, verify and bench (below it) for the CLI (above it)
    "attnx.matrix": ("matrix", 3.5),
    "attnx.commands": ("top", 4),
    "attnx.cli": ("top", 4),
}


def layer_of(module: str) -> tuple[str, int]:
    if module in GROUND_HELPERS:
        return ("ground", 0)
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return ("top", 4)  # the rest of the attnx/ folder: the public API's modules


def read_sources(root: str = ROOT) -> dict[str, str]:
    """{module name: source} of every module of the package: pyproject's packages, each in its
    folder by the package-dir map (a package it does not map lies in its parent's folder)."""
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    package_dir = setuptools["package-dir"]

    def folder_of(package: str) -> str:
        if package in package_dir:
            return package_dir[package]
        parent, _, last = package.rpartition(".")
        return os.path.join(folder_of(parent), last)

    sources = {}
    for package in setuptools["packages"]:
        folder_path = os.path.join(root, folder_of(package))
        for name in sorted(os.listdir(folder_path)):
            if name.endswith(".py"):
                module = package if name == "__init__.py" else f"{package}.{name[:-3]}"
                with open(os.path.join(folder_path, name), encoding="utf-8") as f:
                    sources[module] = f.read()
    return sources


@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported attnx module
    line: int
    in_function: bool


@functools.cache
def import_statements(text: str) -> tuple[tuple[bool, str | None, int, tuple[str, ...], int, bool], ...]:
    """(is_from, module, level, names, line, in_function) of every import statement of a source, in ast.walk's
    order. Parsed once per text: every check below reads the same sources (a planted module added), and walking
    the trees again took most of this file's time (3 s a check)."""
    tree = ast.parse(text)
    in_function = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function |= {id(n) for n in ast.walk(node) if n is not node}
    return tuple((isinstance(node, ast.ImportFrom), getattr(node, "module", None), getattr(node, "level", 0),
                  tuple(a.name for a in node.names), node.lineno, id(node) in in_function)
                 for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))  # fmt: skip


def imports_of(module: str, text: str, modules: set[str]) -> tuple[list[Import], set[str]]:
    """(attnx imports, third-party top-level names imported at module level) of one module."""
    package = module if module in {m.rsplit(".", 1)[0] for m in modules if "." in m} else module.rsplit(".", 1)[0]
    found, third_party = [], set()
    for is_from, base, level, aliases, line, in_function in import_statements(text):
        if not is_from:
            names = list(aliases)
        else:
            base = base or ""
            if level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - level + 1] + ([base] if base else []))
            # "from attnx.x import y" imports module attnx.x.y when there is one, else attnx.x
            names = [f"{base}.{a}" if f"{base}.{a}" in modules else base for a in aliases]
        for name in names:
            if name == "attnx" or name.startswith("attnx."):
                while name not in modules and "." in name:
                    name = name.rsplit(".", 1)[0]
                found.append(Import(module, name, line, in_function))
            elif not in_function and name:
                third_party.add(name.split(".")[0])
    return found, third_party


def check_layers(sources: Mapping[str, str]) -> list[str]:
    """Every import against the direction, and every in-function attnx import of a light module."""
    modules = set(sources)
    edges, heavy_direct = {}, {}
    for module, text in sources.items():
        edges[module], third_party = imports_of(module, text, modules)
        heavy_direct[module] = bool(third_party & HEAVY)

    # The modules whose import imports a heavy library at module level, transitively: those that import one
    # themselves, then, until nothing changes, those that import one of them at module level.
    heavy_modules = {m for m, direct in heavy_direct.items() if direct}
    grew = True
    while grew:
        grew = False
        for module, found in edges.items():
            if module not in heavy_modules and any(not i.in_function and i.target in heavy_modules for i in found):
                heavy_modules.add(module)
                grew = True

    def heavy(module: str) -> bool:
        """Whether importing `module` imports a heavy library at module level, transitively."""
        return module in heavy_modules

    problems = []
    for module, found in edges.items():
        src_layer, src_rank = layer_of(module)
        for i in found:
            dst_layer, dst_rank = layer_of(i.target)
            if dst_rank > src_rank or (dst_rank == src_rank and dst_layer != src_layer):
                problems.append(f"{module}:{i.line} ({src_layer}) imports {i.target} ({dst_layer}): against the layers")
            if i.in_function and not heavy(i.target):
                problems.append(
                    f"{module}:{i.line} imports {i.target} inside a function, which brings no heavy library: "
                    "import it at module level"
                )
    return problems


def test_imports_follow_the_layers():
    sources = read_sources()
    assert {"attnx.model.contract", "attnx.export", "attnx.runtimes.compare", "attnx.workflows", "attnx.cli"} <= set(
        sources
    )
    assert check_layers(sources) == []


def test_in_function_attnx_imports_are_only_of_heavy_modules():
    """The ones left import torch (the torch module) or onnx-ir (the graph layer) only when a
    command needs them: the deployment side and a bench worker never pay for them; and the web stack (attnx serve's
    server, fastapi) or Ray (its replicas) only when serving."""
    sources = read_sources()
    modules = set(sources)
    lazy = sorted({i.target for m, t in sources.items() for i in imports_of(m, t, modules)[0] if i.in_function})
    assert lazy and all(t == "attnx.model.module" or t.startswith(("attnx.export", "attnx.workflows"))
                        or t in ("attnx.serve.server", "attnx.serve._replica") for t in lazy), lazy  # fmt: skip


@pytest.mark.parametrize(
    ("module", "text", "expected"),
    [
        ("attnx.runtimes._planted", "from attnx.export import save_model\n", "(run) imports attnx.export (graph)"),
        ("attnx.export._planted", "from attnx.runtimes import create_runner\n", "(graph) imports attnx.runtimes (run)"),
        ("attnx.model._planted", "import attnx.workflows\n", "(ground) imports attnx.workflows (workflows)"),
        ("attnx.runtimes._planted", "def f():\n    from attnx.workflows import lower\n", "against the layers"),
        ("attnx.bench._planted", "from attnx.commands import _common\n", "(bench) imports attnx.commands._common (top)"),
        ("attnx.export._planted", "from ..runtimes import base\n", "imports attnx.runtimes.base (run)"),
        ("attnx.workflows._planted", "def f():\n    from attnx.runtimes import compare\n", "inside a function"),
    ],
)
def test_the_checker_catches_a_planted_violation(module, text, expected):
    sources = read_sources()
    sources[module] = text
    problems = check_layers(sources)
    assert len(problems) == 1 and expected in problems[0], problems


def test_every_package_folder_is_a_declared_package():
    """A folder with an __init__.py that pyproject does not list would be left out of the wheel
    (and of this check)."""
    sources = read_sources()
    packages = {m for m in sources if any(other.startswith(m + ".") for other in sources)} | {"attnx.commands"}
    for folder in ("attnx", "model", "export", "runtimes", "workflows", "bench"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
            if "__init__.py" in filenames:
                rel = os.path.relpath(dirpath, ROOT).split(os.sep)
                package = ".".join(["attnx"] + rel[1:]) if rel[0] == "attnx" else ".".join(["attnx"] + rel)
                assert package in packages, f"{dirpath} is not in pyproject's packages"


def test_the_matrix_layer_sits_between_bench_and_the_cli():
    """attnx.matrix (issue 15) imports bench and what lies below, the CLI imports it, and its
    folder is a declared package (the check above walks the folders it knew before it)."""
    sources = read_sources()
    assert "attnx.matrix._run" in sources and layer_of("attnx.matrix._run") == ("matrix", 3.5)
    planted = dict(sources, **{"attnx.matrix._planted": "from attnx.commands import _common\n"})
    assert any("(matrix) imports attnx.commands._common (top)" in p for p in check_layers(planted))
    planted = dict(sources, **{"attnx.bench._planted": "from attnx.matrix import _plan\n"})
    assert any("(bench) imports attnx.matrix._plan (matrix)" in p for p in check_layers(planted))
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "matrix")):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
        if "__init__.py" in filenames:
            rel = os.path.relpath(dirpath, ROOT).split(os.sep)
            assert ".".join(["attnx"] + rel) in sources, f"{dirpath} is not in pyproject's packages"
