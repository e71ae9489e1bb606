"""A package's text (attnx.runtimes.text): the fixture checkpoint's WordLevel tokenizer read back, a chat template
rendered as transformers renders it, streamed decoding of a byte-level BPE (trained here) whose characters span
tokens, and every unreadable file refused by name."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from attnx.errors import InputError
from attnx.runtimes.text import TEXT_FILES, PackageText

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

CHECKPOINT = Path(__file__).resolve().parents[1] / "fixtures" / "genai" / "llama" / "checkpoint"

# A template with the usual turns: a system message first, user and assistant alternating (raise_exception),
# the bos and eos tokens, a loop control, tojson, and the generation prompt.
TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = none %}{% endif %}"
    "{% if system %}<<SYS>>{{ system }}<</SYS>>\n{% endif %}"
    "{% for message in messages %}\n"
    "    {% if message['role'] == 'skip' %}{% continue %}{% endif %}\n"
    "    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}\n"
    "    {% if message['role'] == 'user' %}[INST] {{ message['content'] | trim }} [/INST]\n"
    "    {% else %} {{ message['content'] | tojson }} {{ eos_token }}\n"
    "    {% endif %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

CHATS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " héllo <b>世界</b> "},
     {"role": "assistant", "content": "hi \"there\""}, {"role": "user", "content": "again", "name": None}],
]


@pytest.fixture
def templated(tmp_path: Path) -> Path:
    """The fixture checkpoint's text files with a chat template in its tokenizer_config."""
    for name in TEXT_FILES:
        if (CHECKPOINT / name).exists():
            shutil.copy(CHECKPOINT / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_fixture_checkpoint_reads_back():
    text = PackageText.from_folder(str(CHECKPOINT))
    assert text.eos_ids == frozenset({2}) and text.bos_token == "<s>" and text.eos_token == "</s>"
    assert not text.has_chat_template and text.vocab_size == 256
    ids = text.encode("hello world", add_special_tokens=False)
    assert ids and all(0 <= i < 256 for i in ids)
    assert text.decode(ids + [2]) == text.decode(ids)  # eos skipped by default
    assert "</s>" in text.decode(ids + [2], skip_special_tokens=False)
    with pytest.raises(InputError, match="no chat template"):
        text.render_chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers(templated: Path, add_generation_prompt: bool):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(templated))
    text = PackageText.from_folder(str(templated))
    assert text.has_chat_template
    for chat in CHATS:
        want = reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
        got = text.render_chat(chat, add_generation_prompt=add_generation_prompt)
        assert got == want
        assert got.startswith("<s>") and got.endswith("ASSISTANT:") == add_generation_prompt


def test_chat_template_refusals(templated: Path):
    text = PackageText.from_folder(str(templated))
    with pytest.raises(InputError, match="must alternate"):
        text.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    for bad, words in [([], "non-empty list"), (["hi"], "message 0 is a str"), ([{"content": "x"}], "no 'role'"),
                       ([{"role": "user", "content": 3}], "not a string or a list"),
                       ([{"role": "user", "content": object()}], "not JSON data")]:
        with pytest.raises(InputError, match=words):
            text.render_chat(bad)


def test_a_sandbox_escape_is_refused(templated: Path):
    config = json.loads((templated / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}"
    (templated / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="chat template"):
        PackageText.from_folder(str(templated)).render_chat([{"role": "user", "content": "x"}])


def test_streamed_pieces_join_to_the_whole_text(tmp_path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["hello world", "the quick brown fox"] * 20, trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    text = PackageText.from_folder(str(tmp_path))
    assert text.eos_ids == {1}  # no generation_config: tokenizer_config's eos_token's id
    sentence = "héllo 世界 🙂 hello world"
    ids = text.encode(sentence)
    assert text.decode(ids) == sentence
    # the prompt is the first word; every later token streamed, then eos
    prompt, new = text.encode("héllo"), text.encode(" 世界 🙂 hello world") + [1]
    stream = text.detokenizer(prompt)
    pieces = [stream.add(i) for i in new]
    pieces.append(stream.flush())
    assert "".join(pieces) == text.decode(new) and text.decode(prompt + new) == "héllo" + "".join(pieces)
    assert not any("\ufffd" in p for p in pieces)
    assert pieces.count("") >= 3  # 🙂's four bytes (and 世, 界's three) span tokens: nothing until complete
    # a stream cut inside a character ends with what remains, the replacement character included
    cut = text.detokenizer()
    first = [cut.add(i) for i in text.encode("🙂")[:2]]
    assert first == ["", ""] and cut.flush() == "\ufffd"


def test_unreadable_files_are_named(tmp_path: Path):
    with pytest.raises(InputError, match="tokenizer.json is missing"):
        PackageText.from_folder(str(tmp_path))
    shutil.copy(CHECKPOINT / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(InputError, match="tokenizer_config.json is missing"):
        PackageText.from_folder(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(InputError, match="tokenizer_config.json: not JSON"):
        PackageText.from_folder(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 999}))
    with pytest.raises(InputError, match="generation_config.json: eos_token_id 999"):
        PackageText.from_folder(str(tmp_path))
    os.remove(tmp_path / "generation_config.json")
    (tmp_path / "outside.json").write_text("{}")
    inner = tmp_path / "inner"
    inner.mkdir()
    shutil.copy(CHECKPOINT / "tokenizer.json", inner / "tokenizer.json")
    os.symlink(tmp_path / "outside.json", inner / "tokenizer_config.json")
    with pytest.raises(InputError, match="outside the package folder"):
        PackageText.from_folder(str(inner))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": 3}))
    with pytest.raises(InputError, match="tokenizer.json: not a tokenizer"):
        PackageText.from_folder(str(tmp_path))
