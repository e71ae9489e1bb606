"""A package's text: its tokenizer, chat template, special tokens and end-of-sequence ids, read from the Hugging Face
files a checkpoint ships (attnx build --model copies them into the package; attnx serve and GenerativeModel.text read
them back). Only the `tokenizers` library and jinja2 (the `serve` extra): no torch, no transformers.

    tokenizer.json           the tokenizer (required): tokenizers' own format, encode and decode
    tokenizer_config.json    the special tokens (bos_token, eos_token, ...) and the chat template (required)
    chat_template.jinja      the chat template where transformers 5 saves it apart (read first when present)
    generation_config.json   eos_token_id (an id or a list); without it, tokenizer_config's eos_token's id

Every file is untrusted input: a plain name inside the folder (attnx.runtimes._manifest.member_path's rule), a size
limit before it is read, JSON parsed with its errors caught, and the chat template run in jinja2's immutable sandbox.

The chat template renders as transformers' apply_chat_template(..., tokenize=False) does
(transformers/utils/chat_template_utils.py): ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks, loopcontrols),
its `tojson` filter, `raise_exception`, `strftime_now`, `dict` and `namespace` globals, the variables messages,
tools, documents, add_generation_prompt and the named special tokens (bos_token, eos_token, unk_token, sep_token,
pad_token, cls_token, mask_token); messages' None values dropped and reasoning fields aliased as there.

Streamed text decodes incrementally as vLLM and TGI do (IncrementalDetokenizer): a window of a few previous tokens and
the new ones is decoded, and its text past the previous tokens' is emitted once it does not end in U+FFFD (half a
UTF-8 character whose bytes span tokens); the pieces join to decode(all tokens).
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import Any

from attnx.errors import InputError, PackageError, UsageError
from attnx.runtimes._manifest import Check, member_path

__all__ = ["CHAT_TEMPLATE", "GENERATION_CONFIG", "GOLDEN_PROMPT", "TEXT_FILES", "TOKENIZER", "TOKENIZER_CONFIG",
           "IncrementalDetokenizer", "PackageText", "check_text", "has_tokenizer", "package_text", "text_files",
           "text_manifest"]

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
# The files a package's text is read from, in this order; the first two are required.
TEXT_FILES = (TOKENIZER, TOKENIZER_CONFIG, GENERATION_CONFIG, CHAT_TEMPLATE)
_REQUIRED = (TOKENIZER, TOKENIZER_CONFIG)

# Size limits, read before a file is: the largest tokenizer.json of a released model is ~33 MB (Gemma 3, 262k
# tokens); a tokenizer_config with every added token listed is ~1 MB (DeepSeek-V3: 0.2 MB); a template a few kB.
_LIMITS = {TOKENIZER: 128 * 1024**2, TOKENIZER_CONFIG: 16 * 1024**2, GENERATION_CONFIG: 1024**2,
           CHAT_TEMPLATE: 1024**2}

# transformers' named special tokens (SpecialTokensMixin.SPECIAL_TOKENS_ATTRIBUTES), passed to the chat template
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# transformers' names of a message's reasoning; the first is the one templates read (_REASONING_FIELDS)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Previous tokens decoded with a new one (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET): enough context for a
# tokenizer's decoder to space the new piece as it does inside the whole text (SentencePiece's leading '▁').
_WINDOW = 5

_REPLACEMENT = "\ufffd"


def _need(module: str) -> Any:
    """The optional library `module` (the serve extra's), or UsageError saying how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(f"a package's text needs the {module.split('.')[0]} library: pip install 'attnx[serve]'") \
            from None


def has_tokenizer(folder: str) -> bool:
    """Whether `folder` holds a tokenizer.json (a checkpoint that carries its text)."""
    return os.path.isfile(os.path.join(folder, TOKENIZER))


def _read(root: str, name: str) -> bytes | None:
    """The bytes of `name` inside `root`, or None where it is absent; InputError naming the file where it is not a
    plain file inside the folder, is larger than its limit, or cannot be read."""
    try:
        path = member_path(root, name, "the text file")
    except PackageError as e:
        raise InputError(str(e)) from None
    if not os.path.lexists(path):
        return None
    where = os.path.join(root, name)
    if not os.path.isfile(path):
        raise InputError(f"{where}: not a regular file")
    size = os.path.getsize(path)
    if size > _LIMITS[name]:
        raise InputError(f"{where}: {size} bytes, more than the {_LIMITS[name]} a {name} may hold: refused")
    try:
        with open(path, "rb") as f:
            return f.read(_LIMITS[name] + 1)
    except OSError as e:
        raise InputError(f"{where}: cannot be read ({e.strerror or type(e).__name__})") from None


def _json(root: str, name: str, data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InputError(f"{os.path.join(root, name)}: not JSON ({str(e)[:200] or type(e).__name__})") from None
    if not isinstance(value, dict):
        raise InputError(f"{os.path.join(root, name)}: not a JSON object")
    return value


def _token_text(value: Any, key: str, where: str) -> str | None:
    """A special token's text from tokenizer_config: a string, or an AddedToken's {"content": ...}; None if unset."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        value = value.get("content")
    if not isinstance(value, str):
        raise InputError(f"{where}: {key!r} is {value!r}, not a token's text")
    return value


class _Generation:
    """transformers' `{% generation %}` tag (its AssistantTracker) without the tracking: the body, rendered."""

    @staticmethod
    def extension() -> Any:
        import jinja2.ext
        import jinja2.nodes

        class Generation(jinja2.ext.Extension):
            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

            def _render(self, caller: Any) -> str:
                return caller()

        return Generation


def _compile_template(source: str, where: str) -> Any:
    """The chat template compiled in the environment transformers renders it in (chat_template_utils.py)."""
    _need("jinja2")
    import jinja2.ext
    import jinja2.sandbox
    import jinja2.utils

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # transformers' own: jinja2's escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateDict:
        # no attribute access to the dict type itself from the template
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # no underscore-prefixed attributes: a template may not reach CPython's internals
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set the attribute {name!r}")

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation.extension(), jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise InputError(f"{where}: the chat template does not compile ({str(e)[:200]})") from None


def _plain(value: Any, where: str) -> Any:
    """`value` as plain JSON data (what the template may see), or InputError: a message is JSON."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {k if isinstance(k, str) else _bad(k, where): _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    return _bad(value, where)


def _bad(value: Any, where: str) -> Any:
    raise InputError(f"{where} holds a {type(value).__name__}, not JSON data (strings, numbers, lists, objects)")


def _messages(messages: Any) -> list[dict[str, Any]]:
    """The chat as the template sees it (transformers' _normalize_chat_messages and _alias_reasoning_fields), or
    InputError naming the malformed message."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InputError("the chat's messages must be a non-empty list")
    chat = []
    for i, message in enumerate(messages):
        where = f"message {i}"
        if not isinstance(message, Mapping):
            raise InputError(f"{where} is a {type(message).__name__}, not an object with 'role' and 'content'")
        message = {k: v for k, v in _plain(message, where).items() if v is not None}
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise InputError(f"{where} has no 'role' string")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InputError(f"{where}'s 'content' is a {type(content).__name__}, not a string or a list of parts")
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


class PackageText:
    """A package's tokenizer (tokenizers' tokenizer.json), chat template and special tokens
    (tokenizer_config.json), eos ids (generation_config.json, else tokenizer_config's eos_token)."""

    def __init__(self, tokenizer: Any, config: Mapping[str, Any], eos_ids: frozenset[int],
                 chat_template: str | None, where: str) -> None:
        self._tokenizer = tokenizer
        self.eos_ids: frozenset[int] = eos_ids
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_TOKENS:
            text = _token_text(config.get(key), key, where)
            if text is not None:
                self.special_tokens[key] = text
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.chat_template: str | None = chat_template
        self._template = _compile_template(chat_template, where) if chat_template is not None else None
        self.where = where

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def vocab_size(self) -> int:
        """The number of ids the tokenizer can produce (its vocabulary with added tokens: the largest id + 1)."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @classmethod
    def from_folder(cls, folder: str, *, files: Collection[str] | None = None) -> PackageText:
        """The text of `folder` (a package or a checkpoint): InputError naming the file if a required one is missing,
        or any is unreadable, too large or malformed. files: the only ones read (a package's manifest lists its own:
        a file it does not hash is never read), the others taken as absent."""
        tokenizers = _need("tokenizers")
        root = os.path.realpath(os.fspath(folder))
        if not os.path.isdir(root):
            raise InputError(f"{folder!r} is not a folder: it holds no tokenizer")
        data = {name: _read(root, name) if files is None or name in files else None for name in TEXT_FILES}
        for name in _REQUIRED:
            if data[name] is None:
                raise InputError(f"{os.path.join(folder, name)} is missing: a package's text needs {' and '.join(_REQUIRED)}")
        where_tok = os.path.join(folder, TOKENIZER)
        _json(root, TOKENIZER, data[TOKENIZER])  # JSON first: the library's parser then sees a checked object
        try:
            tokenizer = tokenizers.Tokenizer.from_str(data[TOKENIZER].decode("utf-8"))
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception for a malformed file
            raise InputError(f"{where_tok}: not a tokenizer ({str(e).strip()[:200] or type(e).__name__})") from None
        config = _json(root, TOKENIZER_CONFIG, data[TOKENIZER_CONFIG])
        where_cfg = os.path.join(folder, TOKENIZER_CONFIG)
        template = cls._template_source(folder, config, data[CHAT_TEMPLATE])
        eos = cls._eos_ids(folder, root, tokenizer, config, data[GENERATION_CONFIG])
        return cls(tokenizer, config, eos, template, where_cfg)

    @staticmethod
    def _template_source(folder: str, config: Mapping[str, Any], jinja: bytes | None) -> str | None:
        """chat_template.jinja where present (transformers 5 reads it first), else tokenizer_config's chat_template:
        a string, or a list of {"name", "template"} of which the one named "default"."""
        if jinja is not None:
            try:
                return jinja.decode("utf-8")
            except UnicodeDecodeError:
                raise InputError(f"{os.path.join(folder, CHAT_TEMPLATE)}: not UTF-8 text") from None
        where = os.path.join(folder, TOKENIZER_CONFIG)
        value = config.get("chat_template")
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
            if isinstance(named.get("default"), str):
                return named["default"]
            raise InputError(f"{where}: 'chat_template' is a list of named templates without a 'default' one")
        raise InputError(f"{where}: 'chat_template' is a {type(value).__name__}, not a template")

    @staticmethod
    def _eos_ids(folder: str, root: str, tokenizer: Any, config: Mapping[str, Any],
                 generation: bytes | None) -> frozenset[int]:
        """generation_config's eos_token_id (an id or a list of ids), else the id of tokenizer_config's eos_token;
        empty when neither gives one (generation then ends at its token limit)."""
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        if generation is not None:
            where = os.path.join(folder, GENERATION_CONFIG)
            value = _json(root, GENERATION_CONFIG, generation).get("eos_token_id")
            if value is not None:
                ids = value if isinstance(value, list) else [value]
                if not all(type(i) is int and 0 <= i < vocab for i in ids):
                    raise InputError(f"{where}: eos_token_id {value!r} is not ids of the tokenizer's {vocab}")
                return frozenset(ids)
        where = os.path.join(folder, TOKENIZER_CONFIG)
        text = _token_text(config.get("eos_token"), "eos_token", where)
        if text is None:
            return frozenset()
        token_id = tokenizer.token_to_id(text)
        if token_id is None:
            raise InputError(f"{where}: eos_token {text!r} is not a token of {TOKENIZER}")
        return frozenset([token_id])

    # Text <-> ids ------------------------------------------------------------------------
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`; add_special_tokens: the tokenizer's post-processor adds its own (a bos token)."""
        if not isinstance(text, str):
            raise InputError(f"the text to encode is a {type(text).__name__}, not a string")
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of `ids`; special tokens (bos, eos, ...) left out by default, as OpenAI-compatible servers do."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The chat as the model's prompt text, as transformers' apply_chat_template(messages, tokenize=False,
        add_generation_prompt=...) renders it. InputError if the package has no chat template, a message is
        malformed, or the template refuses the chat (its raise_exception)."""
        if self._template is None:
            raise InputError(f"this package has no chat template ({self.where} has no 'chat_template')")
        import jinja2

        chat = _messages(messages)
        variables = {**self.special_tokens, "messages": chat, "tools": _plain(tools, "tools"), "documents": None,
                     "add_generation_prompt": bool(add_generation_prompt)}
        try:
            return self._template.render(**variables)
        except jinja2.exceptions.TemplateError as e:
            raise InputError(f"the chat template refused the chat: {str(e)[:300]}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise InputError(f"the chat template failed on the chat: {type(e).__name__}: {str(e)[:300]}") from None

    def detokenizer(self, prompt_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        """A stream's decoder: the text of each new token after `prompt_ids` as it completes. With prompt_ids, the
        pieces continue the prompt's text (the first may start with the space that parts them, as vLLM's do); without,
        they join to decode(the new tokens)."""
        return IncrementalDetokenizer(self, prompt_ids)


class IncrementalDetokenizer:
    """The text of one stream of tokens, piece by piece (vLLM's detokenize_incrementally, TGI's decode_token).

    prefix_offset..read_offset are tokens already emitted, kept as context; read_offset.. are tokens not yet emitted.
    A new token's text is decode(window) minus decode(context), emitted when it grows and does not end in U+FFFD."""

    def __init__(self, text: PackageText, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True) -> None:
        self._text = text
        self._skip = skip_special_tokens
        self._ids = [int(i) for i in prompt_ids]
        self._read = len(self._ids)
        self._prefix = max(self._read - _WINDOW, 0)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._text.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """The new text that is now complete (never half a UTF-8 character)."""
        self._ids.append(int(token_id))
        before = self._decode(self._prefix, self._read)
        now = self._decode(self._prefix)
        if len(now) > len(before) and not now.endswith(_REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        """What remains at the end: the text of tokens not yet emitted (U+FFFD where a character is left unfinished)."""
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._prefix, self._read)
        now = self._decode(self._prefix)
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before):]


# A package's text: what build records, what verify and load read back ---------------------------------
# The golden round trip's prompt: ASCII words, accents, CJK and an emoji (characters of 1 to 4 UTF-8 bytes).
GOLDEN_PROMPT = "The quick brown fox jumps over the lazy dog. Héllo, 世界 🙂"


def text_files(folder: str) -> list[str]:
    """The text files `folder` holds, in TEXT_FILES' order (what a package copies)."""
    return [name for name in TEXT_FILES if os.path.isfile(os.path.join(folder, name))]


def text_manifest(text: PackageText, files: Sequence[str], tokens: Sequence[int]) -> dict[str, Any]:
    """The manifest's "text" section: the files, eos ids, whether a chat template is there, the tokenizer's size,
    and the golden round trip verify repeats: GOLDEN_PROMPT's ids, `tokens` (greedy tokens of the model), their text
    and that text's ids (without special tokens)."""
    tokens = [int(t) for t in tokens]
    decoded = text.decode(tokens)
    return {"files": list(files), "tokenizer": TOKENIZER, "config": TOKENIZER_CONFIG,
            "generation_config": GENERATION_CONFIG if GENERATION_CONFIG in files else None,
            "eos": sorted(text.eos_ids), "chat_template": text.has_chat_template, "vocab": text.vocab_size,
            "golden": {"prompt": GOLDEN_PROMPT, "ids": text.encode(GOLDEN_PROMPT), "tokens": tokens,
                       "text": decoded, "text_ids": text.encode(decoded, add_special_tokens=False)}}


def package_text(root: str, manifest: Mapping[str, Any]) -> PackageText | None:
    """The package's text (its manifest's "text" section), or None where it carries none; InputError where the
    section is malformed or names a file the manifest does not hash."""
    section = manifest.get("text")
    if section is None:
        return None
    files = section.get("files") if isinstance(section, Mapping) else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise InputError("manifest.json: 'text.files' must be a list of file names")
    for name in files:
        if name not in TEXT_FILES:
            raise InputError(f"manifest.json: 'text.files' names {name!r}, not one of {', '.join(TEXT_FILES)}")
        if name not in manifest.get("files", {}):
            raise InputError(f"manifest.json: 'text.files' names {name!r}, which 'files' does not hash: refused")
    for name in _REQUIRED:
        if name not in files:
            raise InputError(f"manifest.json: 'text.files' lacks {name!r}")
    return PackageText.from_folder(root, files=files)


def _first_difference(got: Sequence[int], want: Sequence[int]) -> str:
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    at = lambda ids: ids[i] if i < len(ids) else "(end)"  # noqa: E731
    return f"{len(got)} ids, not the {len(want)} recorded: first difference at {i} ({at(got)}, recorded {at(want)})"


def check_text(root: str, manifest: Mapping[str, Any]) -> list[Check]:
    """verify's check of a package's text (none where it carries none): its files read as the package's text, the
    golden prompt encoded to the recorded ids, the golden tokens decoded to the recorded text and that text encoded
    to its recorded ids, the eos ids and the chat template as recorded. The files' hashes are checked with every file's."""
    try:
        text = package_text(root, manifest)
    except UsageError as e:
        return [Check("text", False, str(e))]
    if text is None:
        return []
    section = manifest["text"]
    golden = section.get("golden")
    if not (isinstance(golden, Mapping) and isinstance(golden.get("prompt"), str) and isinstance(golden.get("text"), str)
                    and all(isinstance(golden.get(k), list) and all(type(i) is int for i in golden[k])
                    for k in ("ids", "tokens", "text_ids"))):
        return [Check("text", False, "manifest.json: 'text.golden' must be {prompt, ids, tokens, text, text_ids}")]
    failures = []
    ids = text.encode(golden["prompt"])
    if ids != golden["ids"]:
        failures.append(f"the golden prompt {golden['prompt']!r} encodes to {_first_difference(ids, golden['ids'])}")
    decoded = text.decode(golden["tokens"])
    if decoded != golden["text"]:
        failures.append(f"the {len(golden['tokens'])} golden tokens decode to {decoded[:80]!r}, not the recorded "
                        f"{golden['text'][:80]!r}")
    again = text.encode(golden["text"], add_special_tokens=False)
    if again != golden["text_ids"]:
        failures.append(f"the golden text encodes to {_first_difference(again, golden['text_ids'])}")
    if sorted(text.eos_ids) != section.get("eos"):
        failures.append(f"the eos ids are {sorted(text.eos_ids)}, not the recorded {section.get('eos')}")
    if text.has_chat_template != section.get("chat_template"):
        failures.append(f"a chat template is {'' if text.has_chat_template else 'not '}there, against the manifest")
    if failures:
        return [Check("text", False, "; ".join(failures))]
    return [Check("text", True, f"{TOKENIZER} encodes the golden prompt to its {len(ids)} recorded ids, decodes "
                                f"{len(golden['tokens'])} golden tokens to the recorded text and encodes it back; eos "
                                f"{sorted(text.eos_ids)}, chat template: {'yes' if text.has_chat_template else 'no'}")]
