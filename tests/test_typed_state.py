"""A block's state is typed (issue 52), read from the product's source with ast as tests/test_entries.py reads it:
no `facts` dict of string keys (a block's reading is attnx.export.terms.Reading and the Block's own fields). The test
at the end plants one and sees the checker catch it."""

from __future__ import annotations

import ast

from tests.test_layers import read_sources


def facts_uses(text: str) -> list[int]:
    """The lines that hold state in a `facts` dict: an attribute `.facts` read or written, or a name `facts`
    subscripted or asked for a key (facts["k"], facts.get, facts.update, facts.setdefault, facts.pop)."""
    lines = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and node.attr == "facts":
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "facts":
            lines.append(node.lineno)
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "facts"
              and node.attr in ("get", "update", "setdefault", "pop")):  # fmt: skip
            lines.append(node.lineno)
    return sorted(set(lines))


def test_no_product_file_keeps_a_block_s_state_in_a_facts_dict():
    sources = read_sources()
    assert "attnx.export.cores._block" in sources and "attnx.workflows.audit.cut" in sources
    found = {module: lines for module, text in sources.items() if (lines := facts_uses(text))}
    assert not found, f"a facts dict (a block's reading is typed: attnx.export.terms.Reading, Block's fields): {found}"


def test_the_checker_catches_a_planted_facts_dict():
    assert facts_uses("block.facts['rope'] = 1\n") == [1]
    assert facts_uses("x = 1\nif facts.get('rope_tables') is not None:\n    pass\n") == [2]
    assert facts_uses("def f(facts):\n    facts['n_heads'] = 2\n") == [2]
    assert facts_uses("reading.rope.tables = None\nstated.get('scale')\n") == []
