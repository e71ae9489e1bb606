"""A block's state is typed and a message is for people (issue 52), read from the product's source with ast as
tests/test_entries.py reads it: no `facts` dict of string keys (a block's reading is attnx.export.terms.Reading and
the Block's own fields), and no branch on a message's text (a reason, a detail, a finding: code branches on a typed
field or an enum, as Unread.kind). The tests at the end plant each and see the checker catch it."""

from __future__ import annotations

import ast

from tests.test_layers import read_sources

# the names a message is held under (a block's unread reason, a check's detail, a kept block's why, a finding): their
# text is said, never parsed
MESSAGES = frozenset({"reason", "detail", "kept", "said", "unread", "finding", "why", "message"})
# (module, name): a runtime's own exception text (ONNX Runtime raises no typed error), shortened to the one line said
RUNTIME_TEXT = {
    ("attnx.runtimes.cuda", "message"): "ONNX Runtime's '[ONNXRuntimeError] : 1 : FAIL :' prefix cut",
    ("attnx.workflows.audit.run", "message"): "ONNX Runtime's node named once, before its 'Status Message:'",
}
_PARSE = frozenset({"startswith", "endswith", "split", "rsplit", "partition", "rpartition", "find", "index"})


def _last_name(node: ast.AST) -> str | None:
    """`reason` of reason, c.reason, str(c.reason), c.reason.strip(): the name a value is held under."""
    while True:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str" and node.args:
            node = node.args[0]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("strip", "lower"):
            node = node.func.value
        else:
            break
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


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


def message_branches(text: str) -> list[tuple[int, str]]:
    """(line, name) of each place a message is parsed or searched: reason.startswith(...), c.detail.split(...),
    "..." in block.unread, str(finding).endswith(...)."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _PARSE:
            name = _last_name(node.func.value)
            if name in MESSAGES:
                found.append((node.lineno, name))
        elif isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators):
                left_is_text = isinstance(node.left, ast.Constant) and isinstance(node.left.value, str)
                if isinstance(op, (ast.In, ast.NotIn)) and left_is_text and _last_name(right) in MESSAGES:
                    found.append((node.lineno, _last_name(right)))
    return found


def test_no_product_file_keeps_a_block_s_state_in_a_facts_dict():
    sources = read_sources()
    assert "attnx.export.cores._block" in sources and "attnx.workflows.audit.cut" in sources
    found = {module: lines for module, text in sources.items() if (lines := facts_uses(text))}
    assert not found, f"a facts dict (a block's reading is typed: attnx.export.terms.Reading, Block's fields): {found}"


def test_no_product_file_branches_on_a_message_s_text():
    hits = {module: message_branches(text) for module, text in read_sources().items()}
    found = {module: kept for module, lines in hits.items()
             if (kept := [(line, name) for line, name in lines if (module, name) not in RUNTIME_TEXT])}
    assert not found, f"a message's text parsed (branch on a typed field or an enum instead): {found}"
    used = {(module, name) for module, lines in hits.items() for _, name in lines}
    assert set(RUNTIME_TEXT) <= used, f"an exemption no longer needed: {set(RUNTIME_TEXT) - used}"


def test_the_checkers_catch_a_planted_facts_dict_and_a_parsed_message():
    assert facts_uses("block.facts['rope'] = 1\n") == [1]
    assert facts_uses("x = 1\nif facts.get('rope_tables') is not None:\n    pass\n") == [2]
    assert facts_uses("def f(facts):\n    facts['n_heads'] = 2\n") == [2]
    assert facts_uses("reading.rope.tables = None\nstated.get('scale')\n") == []
    assert message_branches("if c.reason.split(':')[0] == 'the fastest':\n    pass\n") == [(1, "reason")]
    assert message_branches("ok = 'not read' in str(block.unread)\n") == [(1, "unread")]
    assert message_branches("if block.unread.kind is UnreadKind.UNFIT_TABLE:\n    pass\n") == []
    assert message_branches("names = [n for n in specs if n.startswith('past')]\n") == []
