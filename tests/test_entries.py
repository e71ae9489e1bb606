"""What the product's source keeps to, read with ast (as tests/test_layers.py reads its imports): no product file over
MAX_LINES lines."""

from __future__ import annotations

from tests.test_layers import read_sources

MAX_LINES = 650  # a module a person reads whole (issue 52's target)


def test_no_product_file_is_over_650_lines():
    sources = read_sources()
    assert "attnx.runtimes.generate" in sources and "attnx.serve.serving" in sources
    long = {module: text.count("\n") for module, text in sources.items() if text.count("\n") > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines (split along a real seam): {long}"
