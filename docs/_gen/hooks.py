"""The docs' generated pages: a MkDocs hook (mkdocs.yml `hooks:`), not part of the installed package.

The reference pages are written from the code at build time, so they cannot go stale:

    reference/cli.md           every subcommand and flag, from the argparse parsers (attnx.cli.build_parser)
    reference/config.md        the config keys, from AttentionConfig's fields, the terms (attnx.model.terms.TERMS),
                               the rope table (attnx.model.rope) and the presets
    reference/capabilities.md  its tables between "<!-- generated: NAME -->" and "<!-- end generated -->" rewritten
                               from the registry (attnx.model.cores.update_markdown; tests/test_docs.py holds the
                               source page to the same tables)
    reference/api.md           one mkdocstrings block per name of attnx's public API (attnx.__all__) and a few more
    measurements/...           measurements/ of the repository, copied as it is (each measurement's README, script,
                               JSON and plot), its code blocks marked as records, not run (a comment before each fence)

mkdocstrings reads the source statically (griffe); attnx's subpackages live in top-level folders that
pyproject maps into the package (package-dir), so on_config lays out a tree of links in the package's
shape for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import inspect
import json
import os
import re
import shutil
import tempfile
from typing import Any

import mkdocs.plugins
from mkdocs.structure.files import File, Files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GENERATED = ("reference/cli.md", "reference/config.md", "reference/api.md")
NOT_RUN_RECORD = "<!-- not run: the record of a measurement (minutes to hours, on the machine its page names) -->"

_api_tree: str | None = None


# --- the CLI --------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    """Text for one cell of a Markdown table."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _help_text(text: str) -> str:
    """Help text (plain, as `attnx --help` prints it) as Markdown: a command in backticks as code, the other
    characters Markdown would read as markup escaped (a `*` in `*.safetensors` would open emphasis), and a docs page
    it names a link to that page."""
    parts = re.split(r"`([^`]+)`|\bdocs/([\w/-]+\.md)", " ".join(str(text).split()))
    out = []
    for i, part in enumerate(parts):  # text, code or None, a page or None, text, ...
        if part is None:
            continue
        if i % 3 == 1:
            out.append(f"<code>{html.escape(part)}</code>")
        elif i % 3 == 2:
            out.append(f"[docs/{part}](../{part})")
        else:  # (`<` has no backslash escape in Markdown: an entity)
            out.append(re.sub(r"([\\`*_\[\]])", r"\\\1", part).replace("<", "&lt;"))
    return "".join(out)


def _help_cell(text: str) -> str:
    return _cell(_help_text(text))


def _typed(value: Any) -> str:
    """A default as a user types it: a list comma-separated (as the flag takes it), 600.0 as 600."""
    if isinstance(value, (list, tuple)):
        return ",".join(_typed(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _value(typed: str) -> str:
    """A value as inline code that breaks only after a comma (docs/stylesheets/attnx.css, code.attnx-value):
    `decomposed` stays whole in a narrow column, a list of six backends still wraps."""
    return f'<code class="attnx-value">{",<wbr>".join(html.escape(part) for part in typed.split(","))}</code>'


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _flag_rows(parser: argparse.ArgumentParser) -> list[str]:
    """One row per argument: its name (a positional's is what it takes), what it takes, its default as typed,
    its help. An argument without help is an error of the build: the page cannot leave a cell empty."""
    formatter = parser._get_formatter()
    rows = ["| argument | takes | default | what it does |", "| --- | --- | --- | --- |"]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
            continue
        if not action.help:
            raise ValueError(f"{parser.prog} {'/'.join(action.option_strings) or action.dest}: no help to show")
        if action.option_strings:
            name = ", ".join(f"`{s}`" for s in action.option_strings)
        else:
            name = f"`{action.metavar or action.dest}`"
        if action.choices is not None:
            takes = ", ".join(f"`{c}`" for c in action.choices)
        elif action.nargs == 0:
            takes = "-"
        elif not action.option_strings:
            takes = "positional"
        else:
            takes = f"`{action.metavar or action.dest.upper()}`"
        default = action.default
        empty = default is None or default is False or default == argparse.SUPPRESS or default == []
        shown = "-" if empty or action.nargs == 0 else _value(_typed(default))
        if action.required and action.option_strings:
            shown = "required"
        rows.append(f"| {name} | {takes} | {_cell(shown)} | {_help_cell(formatter._expand_help(action))} |")
    return rows


def cli_page() -> str:
    """reference/cli.md: `attnx --help` and every subcommand's usage and arguments, from the parsers."""
    from attnx.cli import build_parser
    from attnx.commands import COMMANDS

    parser = build_parser()
    sub = _subparsers(parser)
    lines = [
        "# Command line",
        "",
        "<!-- generated from the argparse parsers (attnx.cli.build_parser) by docs/_gen/hooks.py: edit the parsers -->",
        "",
        "Generated from attnx's own parsers when the docs are built, so every subcommand and flag here is",
        "the one `attnx --help` shows. What the commands share (exit codes, errors, outputs written",
        "whole, signals, `ATTNX_THREADS`) is on [Behaviour of every command](behaviour.md).",
        "",
        "```text",
        parser.format_usage().strip(),
        "```",
        "",
        _help_text(parser.description or ""),
        "",
        *_flag_rows(parser),
        "",
        "| command | what it does |",
        "| --- | --- |",
    ]
    lines += [f"| [`attnx {name}`](#attnx-{name}) | {_help_cell(c.help)} |" for name, c in COMMANDS.items()]
    for name, command_parser in sub.choices.items():
        lines += [
            "",
            f"## attnx {name}",
            "",
            _help_cell(COMMANDS[name].help),
            "",
            "```text",
            command_parser.format_usage().strip(),
            "```",
            "",
        ]
        if command_parser.description and command_parser.description != COMMANDS[name].help:
            lines += [_help_text(command_parser.description), ""]
        lines += _flag_rows(command_parser)
        if command_parser.epilog:
            lines += ["", _help_text(command_parser.epilog)]
    return "\n".join(lines) + "\n"


# --- the config -----------------------------------------------------------------------------------

# What a key of AttentionConfig is, for the keys that no term of the formula owns (the terms' own keys
# are described by their term). A field with neither is an error of the build: the page cannot skip one.
PLAIN_KEYS = {
    "d_model": "width of x and y (and of memory's projections' output)",
    "n_heads": "N, the number of query heads",
    "head_dim": "width of q and k per head; required when n_heads does not divide d_model",
    "v_head_dim": "width of v per head",
    "kv_dim": "width of memory, the second sequence of cross-attention (d_model without cross)",
    "bias": "biases on all four projections",
    "scale": "the scores' scale; null is 1/sqrt(head_dim)",
}


# The JSON type of each Python type a config field is annotated with; an object is described in a section of
# its own (the anchor). A type not here is an error of the build: the page cannot show a Python type.
JSON_TYPES = {"int": "integer", "float": "number", "bool": "true or false", "str": "string", "None": "null",
              "Rope": "object ([rope](#rope))", "QKNorm": "object ([qk_norm](#qk_norm))",
              "RopeScaling": "object (below)", "Temperature": "object ([attn_temperature](#attn_temperature))",
              "Latent": "object ([latent](#latent))"}  # fmt: skip


def _json_type(annotation: str) -> str:
    """`int | None` as JSON says it: integer or null."""
    names = [name.strip() for name in str(annotation).split("|")]
    unknown = [name for name in names if name not in JSON_TYPES]
    if unknown:
        raise ValueError(f"docs/_gen/hooks.py JSON_TYPES: say what {unknown} is in JSON")
    return " or ".join(JSON_TYPES[name] for name in names)


def _json(value: Any) -> str:
    """A value as it is written in a config file: JSON, as inline code."""
    return f"`{json.dumps(value)}`"


def _default(field: dataclasses.Field) -> str:
    if field.default is dataclasses.MISSING:
        return "required"
    return _json(field.default)


def config_page() -> str:
    """reference/config.md: every key of AttentionConfig, what it is, the term that uses it, the rope table."""
    from attnx.model import PRESETS, AttentionConfig
    from attnx.model.rope import REFUSED_ROPE_TYPES, SCALING_PARAMS, Rope
    from attnx.model.terms import TERMS, Latent, QKNorm, Temperature

    owner = {key: term for term in TERMS.values() for key in term.keys}
    fields = dataclasses.fields(AttentionConfig)
    missing = [f.name for f in fields if f.name not in owner and f.name not in PLAIN_KEYS]
    stale = [k for k in PLAIN_KEYS if k not in {f.name for f in fields}]
    if missing or stale:
        raise ValueError(f"docs/_gen/hooks.py PLAIN_KEYS: describe {missing}, drop {stale}")
    lines = [
        "# Config keys",
        "",
        "<!-- generated from AttentionConfig, attnx.model.terms.TERMS and attnx.model.rope by docs/_gen/hooks.py -->",
        "",
        "A config is a JSON object with these keys (`attnx.AttentionConfig`, a frozen dataclass; `--config C.json`).",
        "Only `d_model` and `n_heads` are required. An unknown key, a wrong type or a non-positive size is one",
        "error that names the key. What each term computes is on [The formula and its terms](../concepts/formula.md).",
        "",
        "| key | type | default | what it is |",
        "| --- | --- | --- | --- |",
    ]
    for f in fields:
        term = owner.get(f.name)
        what = _help_cell(PLAIN_KEYS.get(f.name) or term.summary) + (f" (term `{term.name}`)" if term else "")
        lines.append(f"| `{f.name}` | {_json_type(f.type)} | {_default(f)} | {what} |")
    lines += ["", "## `rope`", "", "An object (`attnx.model.rope.Rope`; the default column is the resolved config's):",
              "", "| key | type | default |", "| --- | --- | --- |"]  # fmt: skip
    lines += [f"| `{f.name}` | {_json_type(f.type)} | {_default(f)} |" for f in dataclasses.fields(Rope)]
    lines += ["", "`theta` is required; `dim` absent or null is head_dim (every default is resolved and stored as a number). `scaling` null is plain rope (inv_freq_i = theta^(-2i/dim)); otherwise an",
              "object with `rope_type` and that type's parameters, transformers' names (`attnx.model.rope.SCALING_PARAMS`):",
              "", "| rope_type | its parameters | attention_factor |", "| --- | --- | --- |"]  # fmt: skip
    for kind, spec in SCALING_PARAMS.items():
        # one cell of parameters, so that no column is too narrow for original_max_position_embeddings
        params = [f"required: {', '.join(f'`{k}`' for k in spec.required)}"]
        if spec.defaults:
            params.append("defaults: " + ", ".join(f"`{k}` {_json(v)}" for k, v in spec.defaults.items()))
        if spec.resolve_only:
            params.append(f"read only to resolve a default: {', '.join(f'`{k}`' for k in spec.resolve_only)}")
        lines.append(f"| `{kind}` | {'; '.join(params)} | {'resolved when absent' if spec.attention_factor else '-'} |")
    lines += ["", "Refused by name:", ""]
    lines += [f"- `{kind}`: {_cell(why)}" for kind, why in REFUSED_ROPE_TYPES.items()]
    lines += ["", "## `qk_norm`", "", "An object (`attnx.model.terms.QKNorm`):", "", "| key | type | default |",
              "| --- | --- | --- |"]  # fmt: skip
    lines += [f"| `{f.name}` | {_json_type(f.type)} | {_default(f)} |" for f in dataclasses.fields(QKNorm)]
    lines += ["", "## `attn_temperature`", "", "An object (`attnx.model.terms.Temperature`), both keys required:", "",
              "| key | type | default |", "| --- | --- | --- |"]  # fmt: skip
    lines += [f"| `{f.name}` | {_json_type(f.type)} | {_default(f)} |" for f in dataclasses.fields(Temperature)]
    lines += ["", "## `latent`", "", "An object (`attnx.model.terms.Latent`: multi-head latent attention), every key "
              "required:", "", "| key | type | default |", "| --- | --- | --- |"]  # fmt: skip
    lines += [f"| `{f.name}` | {_json_type(f.type)} | {_default(f)} |" for f in dataclasses.fields(Latent)]
    lines += ["", "## Presets", "", "`--preset NAME`, `attnx.preset(NAME)`: the keys each sets, as a config file would "
              "(the others are their defaults).", "", "| preset | keys |", "| --- | --- |"]  # fmt: skip
    base = {f.name: f.default for f in fields}
    for name, config in PRESETS.items():
        data = config.to_dict()
        given = {k: v for k, v in data.items() if k in ("d_model", "n_heads") or base.get(k) != v}
        # the derived defaults (head_dim = d_model / n_heads, ...) are shown only where they were given
        derived = AttentionConfig(d_model=config.d_model, n_heads=config.n_heads).to_dict()
        given = {k: v for k, v in given.items() if k in ("d_model", "n_heads") or derived.get(k) != v}
        lines.append(f"| `{name}` | {_cell(_json(given))} |")
    return "\n".join(lines) + "\n"


# --- the capability tables ------------------------------------------------------------------------


def capabilities_page(text: str) -> str:
    """The capability page's source with its generated tables rewritten from the registry."""
    from attnx.model.cores import update_markdown

    return update_markdown(text)


# --- the Python API -------------------------------------------------------------------------------

# Beyond attnx.__all__: what the docs name (readers, the registry's questions, the buffer decoder).
API_MORE = {
    "The registry": ["attnx.model.cores.why_not", "attnx.model.cores.core_for", "attnx.model.cores.update_markdown"],
    "Reading graphs": ["attnx.export.read_cores", "attnx.export.read_weights", "attnx.export.build_model"],
    "Decoding": ["attnx.runtimes.decode.BufferDecoder"],
    "Serving a whole model": ["attnx.runtimes.model_package.GenerativeModel", "attnx.runtimes.generate.Engine",
                              "attnx.runtimes.sampling.Sampling", "attnx.runtimes.text.PackageText",
                              "attnx.runtimes.text.IncrementalDetokenizer"],
    "Comparison": ["attnx.runtimes.compare.compare_arrays"],
}


def api_page() -> str:
    """reference/api.md: a mkdocstrings block for each name attnx exports, and API_MORE."""
    import attnx

    lines = [
        "# Python API",
        "",
        "<!-- generated from attnx.__all__ by docs/_gen/hooks.py; the text is each object's docstring -->",
        "",
        "`import attnx` imports neither torch nor onnxruntime: the names below load their module on first use.",
        "",
        "## attnx",
        "",
    ]
    for name in attnx.__all__:
        if name == "__version__":
            continue
        obj = getattr(attnx, name)  # where it is defined (a lazy name imports its module: torch for two)
        module = obj.__module__ if inspect.isclass(obj) or inspect.isfunction(obj) else attnx._EXPORTS[name]
        lines += [f"::: {module}.{name}", "    options:", "      heading_level: 3", ""]
    for title, paths in API_MORE.items():
        lines += [f"## {title}", ""]
        for path in paths:
            lines += [f"::: {path}", "    options:", "      heading_level: 3", ""]
    return "\n".join(lines)


# --- the hook -------------------------------------------------------------------------------------


def _package_tree() -> str:
    """A folder holding attnx in the package's shape (links), for mkdocstrings' static reader."""
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        section = re.search(r"^\[tool\.setuptools\.package-dir\]\n(.*?)(?:^\[|\Z)", f.read(), re.M | re.S).group(1)
    mapping = dict(re.findall(r'^"([\w.]+)" = "([\w/]+)"', section, re.M))
    tree = tempfile.mkdtemp(prefix="attnx-docs-api-")
    for package, folder in sorted(mapping.items()):
        target = os.path.join(tree, *package.split("."))
        if package == "attnx":  # its own files, and the mapped subpackages inside it
            os.makedirs(target)
            for entry in os.listdir(os.path.join(ROOT, folder)):
                os.symlink(os.path.join(ROOT, folder, entry), os.path.join(target, entry))
        elif not os.path.lexists(target):
            os.symlink(os.path.join(ROOT, folder), target)
    return tree


@mkdocs.plugins.event_priority(100)  # before mkdocstrings reads its handler's paths
def on_config(config: Any) -> Any:
    global _api_tree
    _api_tree = _package_tree()
    config["plugins"]["mkdocstrings"].config["handlers"]["python"]["paths"] = [_api_tree]
    return config


def on_files(files: Files, config: Any) -> Files:
    for uri, make in zip(GENERATED, (cli_page, config_page, api_page)):
        files.append(File.generated(config, uri, content=make()))
    measurements = os.path.join(ROOT, "measurements")
    for folder, _, names in os.walk(measurements):
        for name in sorted(names):
            path = os.path.join(folder, name)
            uri = "measurements/" + os.path.relpath(path, measurements).replace(os.sep, "/")
            files.append(File.generated(config, uri, abs_src_path=path))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    uri = page.file.src_uri
    if uri == "reference/capabilities.md":
        return capabilities_page(markdown)
    if uri.startswith("measurements/"):
        # A link from measurements/ into docs/ (right on GitHub) is one level less deep on the site,
        # where docs/ is the root and measurements/ sits beside the pages.
        markdown = re.sub(r"\]\(((?:\.\./)+)docs/", r"](\1", markdown)
        # a record of a run: shown, marked (as tests/test_docs.py marks a block: a comment before its fence, which
        # no reader sees), never run
        return re.sub(r"^(?!<!-- not run: .* -->\n)(.*\n)(```(?:bash|python|sh)\n)", rf"\1{NOT_RUN_RECORD}\n\2",
                      markdown, flags=re.M)  # fmt: skip
    return markdown


def on_shutdown() -> None:
    if _api_tree:
        shutil.rmtree(_api_tree, ignore_errors=True)
