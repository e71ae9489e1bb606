"""What the product's source keeps to, read with ast (as tests/test_layers.py reads its imports): no product file over
MAX_LINES lines; no core, lowering or term name compared outside its entry (the tests at the end plant a comparison
and see the checker catch it)."""

from __future__ import annotations

import ast

import pytest

from tests.test_layers import read_sources

MAX_LINES = 650  # a module a person reads whole (issue 52's target)


def test_no_product_file_is_over_650_lines():
    sources = read_sources()
    assert "attnx.runtimes.generate" in sources and "attnx.serve.serving" in sources
    long = {module: text.count("\n") for module, text in sources.items() if text.count("\n") > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines (split along a real seam): {long}"


# Core, lowering and term names --------------------------------------------------------------------------------------
# A decision that depends on a core, a lowering or a term is the entry's (a field or method of Core, Lowering, Term
# or their graph halves), never a comparison of its name: a new core or term is then one entry, not a hunt for the
# places that spell the names. The entries themselves may name their own.
ENTRY_MODULES = ("attnx.model.cores", "attnx.model.terms", "attnx.export.cores", "attnx.export.terms")
# (module, name): where the string compared is not that core, lowering or term, with the reason
NOT_THE_NAME = {
    ("attnx.model.importers", "cross"): "--attention self or cross: which of a checkpoint's attentions to import",
    ("attnx.workflows._import", "cross"): "the same choice, as the import's result records it",
    # the contract's graph input of that name (a feed), not the term
    ("attnx.model.tolerance", "key_padding_mask"): "a feed's name",
    ("attnx.runtimes.decode", "key_padding_mask"): "a feed's name",
    ("attnx.workflows._import", "key_padding_mask"): "a feed's name",
    ("attnx.workflows.audit.audit", "key_padding_mask"): "a feed's name",
    ("attnx.workflows.audit.cut", "key_padding_mask"): "a feed's name",
    ("attnx.workflows.rewrite.splice", "key_padding_mask"): "a feed's name",
}


def _names() -> frozenset[str]:
    from attnx.model.cores import CORES, LOWERINGS
    from attnx.model.terms import TERMS

    return frozenset(CORES) | frozenset(LOWERINGS) | frozenset(TERMS)


def _strings(node: ast.AST) -> list[str]:
    """The string constants of an expression compared: a literal, or the literals of a tuple, list or set."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e)]
    return []


def name_comparisons(module: str, text: str, names: frozenset[str]) -> list[tuple[int, str]]:
    """(line, name) of every comparison (==, !=, in, not in, a match case, startswith/endswith) of an expression
    with a string literal that is one of `names`."""
    found = []
    for node in ast.walk(ast.parse(text)):
        compared: list[str] = []
        if isinstance(node, ast.Compare):
            if any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
                compared = [s for side in (node.left, *node.comparators) for s in _strings(side)]
        elif isinstance(node, ast.match_case):
            compared = [s for p in ast.walk(node.pattern) if isinstance(p, ast.MatchValue) for s in _strings(p.value)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("startswith", "endswith"):  # fmt: skip
            compared = [s for a in node.args for s in _strings(a)]
        line = node.pattern.lineno if isinstance(node, ast.match_case) else getattr(node, "lineno", 0)
        found += [(line, s) for s in compared if s in names]
    return found


def check_names(sources: dict[str, str], names: frozenset[str]) -> list[str]:
    problems = []
    for module, text in sources.items():
        if module.startswith(ENTRY_MODULES):
            continue
        for line, name in name_comparisons(module, text, names):
            if (module, name) not in NOT_THE_NAME:
                problems.append(f"{module}:{line} compares {name!r}: read the entry's field instead")
    return problems


def test_no_core_lowering_or_term_name_is_compared_outside_its_entry():
    sources, names = read_sources(), _names()
    assert {"gqa", "decomposed", "ort-fused", "rope"} <= names
    assert check_names(sources, names) == []
    # every exception still names a comparison there (one made good leaves the lists)
    stale = [key for key in NOT_THE_NAME
             if key[1] not in {n for _, n in name_comparisons(key[0], sources[key[0]], names)}]  # fmt: skip
    assert not stale, f"no longer compared there: drop them from the lists: {stale}"


@pytest.mark.parametrize("text", [
    "def f(block):\n    return block.core == 'gqa'\n",
    "def f(lowering):\n    return lowering in {'decomposed', 'onnx'}\n",
    "def f(name):\n    return 'ort-attention' != name\n",
    "def f(t):\n    match t:\n        case 'rope':\n            return 1\n",
    "def f(core_name):\n    return core_name.startswith('mha')\n",
])  # fmt: skip
def test_the_checker_catches_a_planted_name_comparison(text):
    problems = check_names({"attnx.runtimes._planted": text}, _names())
    assert problems and all(p.startswith("attnx.runtimes._planted:2") or p.startswith("attnx.runtimes._planted:3")
                            for p in problems), problems  # fmt: skip
