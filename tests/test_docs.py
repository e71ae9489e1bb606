"""The docs (README.md and docs/**.md) as a reader uses them: every python and bash block runs as written, or
is marked as not meant to run (an HTML comment `<!-- not run: REASON -->` on the line before its fence, which
neither the site nor GitHub shows; docs/about.md, "Code blocks"); the generated reference pages (docs/_gen/hooks.py)
hold what the code holds; and the site builds as .ci/run builds it, strict, every warning counted."""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                         recursive=True))]  # fmt: skip
RUN = ("python", "bash")  # the languages whose blocks run
SHOWN = ("text", "json", "yaml", "toml")  # the languages shown and never run
# The mark of a block not meant to run: the line right before its fence, a comment no reader sees.
NOT_RUN = re.compile(r"<!-- not run: (\S.*?) -->")
MARK_START = "<!-- not run"  # a line that starts so is a mark, complete or not
# A fence at the start of a line: ``` and its info string (the language first), up to the closing ```.
FENCE = re.compile(r"^```([^`\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
# README.md's first block holds the two commands (install, build and verify; bash .ci/run): the main job is run by
# tests/test_readme.py, and `bash .ci/run` is this suite itself.
TWO_COMMANDS = "bash .ci/install && "


def read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def blocks(page: str) -> list[tuple[str, str, int, str]]:
    """(language, body, line, mark) of every fenced block of a page; mark is the line before its fence."""
    text = read(page)
    found = []
    for m in FENCE.finditer(text):
        before = text[: max(m.start() - 1, 0)].rsplit("\n", 1)[-1]  # the line before the fence's
        lang = m.group(1).split()[0] if m.group(1).strip() else ""
        found.append((lang, m.group(2), text.count("\n", 0, m.start()) + 1, before))
    return found


def runnable(page: str) -> list[tuple[str, str, int]]:
    """The blocks of a page the tests run, in order."""
    return [(lang, body, line) for lang, body, line, mark in blocks(page)
            if lang in RUN and not mark.startswith(MARK_START) and TWO_COMMANDS not in body]  # fmt: skip


def test_the_docs_have_pages():
    for page in ("docs/index.md", "docs/getting-started.md", "docs/about.md", "docs/reference/capabilities.md"):
        assert page in PAGES


@pytest.mark.parametrize("page", PAGES)
def test_every_block_runs_or_is_marked(page):
    """A python or bash block runs unless the line right before its fence is `<!-- not run: REASON -->`; other
    languages are those shown as they are (text, json, ...). A fence whose language is none or another (sh,
    console, py) fails: no block escapes both the runner and the mark. A mark without its reason, one on no
    fence (a blank line between them: the mark would apply to nothing) or on a block that never runs fails; so
    does the old mark, a first line `# not run: ...` inside the block, which every reader saw."""
    text = read(page)
    marked = set()
    for lang, body, line, mark in blocks(page):
        where = f"{page}:{line}"
        assert lang in RUN or lang in SHOWN, f"{where}: a ```{lang or '(no language)'} block: say bash, python or text"
        assert not body.startswith("# not run"), f"{where}: the mark is '<!-- not run: REASON -->' before the fence"
        if mark.startswith(MARK_START):
            assert NOT_RUN.fullmatch(mark), f"{where}: the mark is '<!-- not run: REASON -->', with the reason"
            assert lang in RUN, f"{where}: a ```{lang} block never runs: it needs no mark"
            marked.add(line - 1)
    for number, text_line in enumerate(text.splitlines(), 1):
        if text_line.startswith(MARK_START):
            assert number in marked, f"{page}:{number}: a mark with no fence on the next line"


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)])
def test_page_blocks_run_as_written(page, tmp_path):
    """The page's runnable blocks in order, in one empty folder, as a reader pastes them: python in a fresh
    interpreter, bash with -e and this environment's attnx first on the PATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    for lang, body, line in runnable(page):
        args = [sys.executable, "-c", body] if lang == "python" else ["bash", "-e", "-o", "pipefail", "-c", body]
        r = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{page}:{line} ({lang}) exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


# --- the generated pages ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hooks():
    spec = importlib.util.spec_from_file_location("attnx_docs_hooks", os.path.join(ROOT, "docs", "_gen", "hooks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table_rows(page: str) -> list[list[str]]:
    """The cells of every row of every Markdown table of a page (the separator rows left out)."""
    rows = []
    for line in re.findall(r"^\|.*\|$", page, re.M):
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if not all(re.fullmatch(r":?-+:?", c) for c in cells):
            rows.append(cells)
    return rows


def test_the_cli_page_has_every_subcommand_and_flag(hooks):
    """Every subcommand and every flag `attnx --help` and `attnx COMMAND --help` show is on the page, each with
    its help (no empty cell), its default as a user types it (never a Python list), a positional named once."""
    import argparse

    from attnx.cli import build_parser

    page = hooks.cli_page()
    parser = build_parser()
    sub = hooks._subparsers(parser)
    parsers = {"": parser, **sub.choices}
    assert set(sub.choices) >= {"import", "export", "optimize", "parity", "bench", "build", "verify", "run",
                                "inspect", "matrix"}  # fmt: skip
    for name, p in parsers.items():
        if name:
            assert f"## attnx {name}\n" in page
            assert p.format_usage().strip() in page
        for action in p._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
                continue
            for flag in action.option_strings:
                assert f"`{flag}`" in page, (name, flag)
            if not action.option_strings:  # a positional, by its metavar
                assert f"`{action.metavar or action.dest}`" in page, (name, action.dest)
            assert action.help, f"attnx {name} {action.option_strings or action.dest}: no help"
    for cells in table_rows(page):
        assert all(cells), f"an empty cell: {cells}"
        if len(cells) == 4:  # a flag's row: argument, takes, default, what it does
            assert cells[0] != cells[1], f"a positional named twice: {cells}"
            assert not re.search(r"\[\d|\['|\bTrue\b|\bNone\b", cells[2]), f"a Python value as a default: {cells}"


def test_the_config_page_has_every_key(hooks):
    import dataclasses

    from attnx.model import PRESETS, AttentionConfig
    from attnx.model.rope import SCALING_PARAMS

    page = hooks.config_page()
    for field in dataclasses.fields(AttentionConfig):
        assert f"| `{field.name}` |" in page
    for kind in SCALING_PARAMS:
        assert f"| `{kind}` |" in page
    for name in PRESETS:
        assert f"| `{name}` |" in page
    # Configs are JSON: every type is JSON's, every default parses as JSON, every preset's keys are a config
    # file that makes the preset
    import json

    for cells in table_rows(page):
        if cells[0] in ("key", "preset", "rope_type") or cells[0].strip("`") in SCALING_PARAMS:
            continue
        if len(cells) == 2:
            assert AttentionConfig.from_dict(json.loads(cells[1].strip("`"))) == PRESETS[cells[0].strip("`")], cells
        else:  # key, type, default (, what it is)
            assert not re.search(r"\b(int|float|bool|str|None|Rope\w*|QKNorm)\b|\\", cells[1]), cells
            if cells[2] != "required":
                json.loads(cells[2].strip("`"))


def test_the_capability_page_is_the_registrys(hooks):
    """docs/reference/capabilities.md holds the registry's tables (attnx.model.cores) as update_markdown writes
    them; the build rewrites them too, so the site cannot go stale. To refresh the source:
    python -c "from attnx.model.cores import update_markdown as u; p='docs/reference/capabilities.md'; ..."."""
    from attnx.model.cores import GENERATED_TABLES, update_markdown

    source = read("docs/reference/capabilities.md")
    for name, table in GENERATED_TABLES.items():
        assert f"<!-- generated: {name} -->\n{table()}\n<!-- end generated -->" in hooks.capabilities_page(source)
    assert update_markdown(source) == source, "the page's tables differ from the registry: run update_markdown"


# --- the site, built as .ci/run builds it -------------------------------------------------------


def ci_mkdocs_args() -> list[str]:
    """The arguments .ci/run gives `mkdocs build`, without the site folder (the build a warning must fail)."""
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        (line,) = [ln for ln in f if re.search(r"/mkdocs\" build ", ln)]
    args = line.split('/mkdocs" build ', 1)[1].split()
    at = args.index("--site-dir")
    return args[:at] + args[at + 2 :]


def mkdocs_build(config: str, site: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    mkdocs = os.path.join(os.path.dirname(sys.executable), "mkdocs")
    return subprocess.run([mkdocs, "build", *ci_mkdocs_args(), "--config-file", config, "--site-dir", site],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip


def test_the_ci_build_fails_on_a_page_left_out_of_the_nav(tmp_path):
    """.ci/run's build, with this site's validation settings, on a two-page site that leaves one page out of
    its nav: the build fails (strict mode counts the warning; --quiet would hide it, and the build pass),
    and passes once the page is in the nav."""
    import yaml

    assert "--strict" in ci_mkdocs_args()
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        validation = yaml.safe_load(f)["validation"]
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n")
    (tmp_path / "docs" / "left-out.md").write_text("# Left out\n")
    for nav, fails in ((["index.md"], True), (["index.md", "left-out.md"], False)):
        config = tmp_path / "mkdocs.yml"
        config.write_text(yaml.safe_dump({"site_name": "t", "docs_dir": str(tmp_path / "docs"), "nav": nav,
                                          "validation": validation}))  # fmt: skip
        r = mkdocs_build(str(config), str(tmp_path / "site"))
        assert (r.returncode != 0) == fails, (nav, r.returncode, r.stderr[-2000:])
        if fails:
            assert "left-out.md" in r.stderr and 'not included in the "nav"' in r.stderr, r.stderr[-2000:]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> str:
    """The built site: the one .ci/run built before the tests (ATTNX_DOCS_SITE), else built here the same way
    (about 5 s); either way `mkdocs build --strict` passed, every warning counted."""
    built = os.environ.get("ATTNX_DOCS_SITE")
    if built:
        assert os.path.exists(os.path.join(built, "index.html")), built
        return built
    folder = str(tmp_path_factory.mktemp("site"))
    r = mkdocs_build(os.path.join(ROOT, "mkdocs.yml"), folder)
    assert r.returncode == 0, r.stderr[-3000:]
    return folder


def test_the_site_builds_strict(site):
    for page in ("index.html", "getting-started/index.html", "reference/cli/index.html",
                 "measurements/audit_scale/index.html"):  # fmt: skip
        assert os.path.exists(os.path.join(site, page)), page


def test_the_api_page_names_every_public_name(hooks):
    import attnx

    page = hooks.api_page()
    for name in attnx.__all__:
        if name != "__version__":
            assert re.search(rf"^::: [\w.]+\.{name}$", page, re.M), name


# The rendered pages: what a reader sees ------------------------------------------------------------------------------
# Columns a table may have: measured in headless Chromium at 1280 px (each table's scrollWidth against its 720 px
# column, every page of the site), the 7-column tables of the measurements fit and a 12-column one did not.
MAX_COLUMNS = 7
# emphasis opened or closed inside a word: a `*` of a shape (`[N*head_dim, d_model]`) outside backticks
INTRAWORD_EMPHASIS = re.compile(r"[\w\]]<em>|</em>[\w\[]")


def _rendered(site: str) -> dict[str, str]:
    return {os.path.relpath(f, site): open(f, encoding="utf-8").read()
            for f in sorted(glob.glob(os.path.join(site, "**", "index.html"), recursive=True))}  # fmt: skip


def table_columns(page_html: str) -> list[int]:
    """The most cells of a row, for each table of a rendered page."""
    return [max((len(re.findall(r"<t[hd][ >]", row)) for row in re.findall(r"<tr.*?</tr>", table, re.S)), default=0)
            for table in re.findall(r"<table.*?</table>", page_html, re.S)]  # fmt: skip


def stray_backticks(page_html: str) -> int:
    """Backticks a reader sees: in the article's text outside code (a code span whose closing backtick is
    missing renders its opening one as text)."""
    article = re.search(r"<article.*?</article>", page_html, re.S)
    text = re.sub(r"<(pre|code)\b.*?</\1>", "", article.group(0) if article else "", flags=re.S)
    return re.sub(r"<[^>]+>", "", text).count("`")


def test_the_rendering_checks_fail_on_their_faults():
    """Each check below can fail: a shape's star, a bare backtick, a wide table."""
    import markdown

    html = markdown.markdown("`q_proj.weight` [N*head_dim, d_model] and `out_proj.weight` [d_model, N*v_head_dim]")
    assert INTRAWORD_EMPHASIS.search(html)
    assert stray_backticks(f"<article>{markdown.markdown('ends `attnx run pkg --input x.npy')}</article>") == 1
    row = "|" + " x |" * 8
    assert table_columns(markdown.markdown(f"{row}\n|{'---|' * 8}\n{row}", extensions=["tables"])) == [8]


def test_no_page_renders_a_shape_s_star_as_emphasis_or_a_bare_backtick(site):
    pages = _rendered(site)
    assert len(pages) > 30
    assert [p for p, h in pages.items() if INTRAWORD_EMPHASIS.search(h)] == []
    assert {p: n for p, h in pages.items() if (n := stray_backticks(h))} == {}


def test_no_table_of_the_site_is_wider_than_its_column(site):
    wide = {p: cols for p, h in _rendered(site).items() if (cols := [c for c in table_columns(h) if c > MAX_COLUMNS])}
    assert wide == {}


# The prose: a paragraph is one point ---------------------------------------------------------------------------------
# Words a paragraph (or one item of a list) may have on the pages a reader reads (issue 38: how-to pages start with
# the task and an example, the details under headings); measurements/ are records, each a report of one run.
MAX_PARAGRAPH_WORDS = 150
LIST_ITEM = re.compile(r"\n(?=(?:[-*]|\d+\.) )")


def long_paragraphs(text: str, limit: int = MAX_PARAGRAPH_WORDS) -> list[tuple[int, str]]:
    """(words, opening) of each paragraph or list item of a page's markdown over `limit` words: fenced blocks,
    tables, headings and HTML comments left out."""
    text = FENCE.sub("", text)
    found = []
    for block in re.split(r"\n\s*\n", text):
        block = block.strip()
        if not block or block[0] in "|#" or block.startswith("<!--"):
            continue
        for item in LIST_ITEM.split(block):
            if (words := len(item.split())) > limit:
                found.append((words, " ".join(item.split()[:8])))
    return found


def test_the_paragraph_check_fails_on_its_fault():
    long = " ".join(["word"] * (MAX_PARAGRAPH_WORDS + 1))
    assert long_paragraphs(f"# A page\n\n{long}\n\n```text\n{long}\n```\n") == [(MAX_PARAGRAPH_WORDS + 1, "word " * 7 + "word")]
    assert long_paragraphs(f"- {long[:600]}\n- {long[:600]}\n") == []  # two short items of one list
    assert long_paragraphs(f"| {long} |\n") == []


def test_no_paragraph_of_the_docs_is_over_150_words():
    prose = [p for p in PAGES if not p.startswith(os.path.join("docs", "measurements"))]
    assert len(prose) > 20
    assert {p: found for p in prose if (found := long_paragraphs(read(p)))} == {}
