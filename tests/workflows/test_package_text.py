"""A whole model's package carries its text (attnx build --model --tokenizer / --checkpoint): the tokenizer's files
copied and hashed, the manifest's "text" section, verify's golden round trip (and what it names when the files or
the record are altered), attnx.load's .text and generate_text; a tokenizer past the model's vocabulary refused.

One package is built here (the builder's llama, ~10 s), its text from a copy of its checkpoint's files with a chat
template added."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

import attnx
from attnx.cli import main
from attnx.errors import InputError
from attnx.runtimes._manifest import MANIFEST, MANIFEST_SUM
from attnx.runtimes.text import GOLDEN_PROMPT, TEXT_FILES, PackageText, check_text, package_text
from attnx.workflows._build_model import _text_source

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MODEL = FIXTURES / "genai" / "llama" / "fp32" / "model.onnx"
CHECKPOINT = FIXTURES / "genai" / "llama" / "checkpoint"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _text_folder(folder: Path) -> Path:
    """The checkpoint's text files, its tokenizer_config with TEMPLATE."""
    folder.mkdir()
    for name in TEXT_FILES:
        if (CHECKPOINT / name).exists():
            shutil.copy(CHECKPOINT / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("text")
    tok = _text_folder(root / "tok")
    assert main(["build", "--model", str(MODEL), "--checkpoint", str(CHECKPOINT), "--tokenizer", str(tok),
                 "--out", str(root / "pkg")]) == 0  # fmt: skip
    return root / "pkg"


def _rehash(pkg: Path, manifest: dict) -> None:
    """The manifest made to agree with the files as they are now, as a forger would."""
    for name in manifest["files"]:
        data = (pkg / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    (pkg / MANIFEST).write_bytes(data)
    (pkg / MANIFEST_SUM).write_text(f"{hashlib.sha256(data).hexdigest()}  {MANIFEST}\n")


def test_the_package_carries_its_text_and_verify_checks_it(built: Path, capsys):
    manifest = json.loads((built / MANIFEST).read_text())
    text = manifest["text"]
    assert text["files"] == ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    assert set(text["files"]) <= set(manifest["files"])  # hashed like every file
    assert (built / "tokenizer.json").read_bytes() == (CHECKPOINT / "tokenizer.json").read_bytes()
    assert text["eos"] == [2] and text["chat_template"] is True and text["vocab"] == 256
    golden = text["golden"]
    assert golden["prompt"] == GOLDEN_PROMPT and len(golden["tokens"]) == manifest["generations"]["steps"]
    assert golden["text"] and golden["text_ids"] == golden["tokens"]  # a WordLevel tokenizer: each token a word
    assert main(["verify", str(built)]) == 0
    out = capsys.readouterr().out
    assert "text " in out and "encodes the golden prompt to its" in out and "chat template: yes" in out


def test_load_gives_the_text_and_generate_text(built: Path):
    with attnx.load(str(built)) as model:
        assert isinstance(model.text, PackageText) and model.text.eos_ids == {2}
        assert model.text.render_chat([{"role": "user", "content": "t5"}]) == "<|user|>t5</s><|assistant|>"
        prompt = "t5 t9 t17"
        [got] = model.generate_text([prompt], max_new_tokens=6)
        [tokens] = model.generate([model.text.encode(prompt)], max_new_tokens=6, eos=[2])
        assert got == model.text.decode(tokens) and got.startswith("t")


def test_verify_names_an_altered_tokenizer_or_record(built: Path, tmp_path: Path):
    pkg = tmp_path / "pkg"
    shutil.copytree(built, pkg)
    manifest = json.loads((pkg / MANIFEST).read_text())
    # a forged tokenizer: two words' ids swapped, the manifest rehashed to match
    tokenizer = json.loads((pkg / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    word = next(w for w, i in vocab.items() if i == manifest["text"]["golden"]["tokens"][0])
    other = next(w for w in vocab if w != word and not w.startswith("<"))
    vocab[word], vocab[other] = vocab[other], vocab[word]
    (pkg / "tokenizer.json").write_text(json.dumps(tokenizer))
    _rehash(pkg, manifest)
    [check] = check_text(str(pkg), manifest)
    assert not check and "golden tokens decode to" in check.detail
    assert main(["verify", str(pkg)]) == 1
    # the record altered instead: the golden prompt's ids
    shutil.copy(built / "tokenizer.json", pkg / "tokenizer.json")
    manifest["text"]["golden"]["ids"][0] += 1
    _rehash(pkg, manifest)
    [check] = check_text(str(pkg), manifest)
    assert not check and "the golden prompt" in check.detail and "first difference at 0" in check.detail
    # a text file the manifest does not hash is never read
    del manifest["files"]["tokenizer_config.json"]
    with pytest.raises(InputError, match="'files' does not hash"):
        package_text(str(pkg), manifest)


def test_no_tokenizer_is_said_and_a_foreign_one_refused(tmp_path: Path, capsys, monkeypatch):
    said: list[str] = []
    assert _text_source(None, str(FIXTURES / "genai" / "llama" / "fp32"), said.append) is None
    assert said and said[0].startswith("no tokenizer: the package carries no text")
    with monkeypatch.context() as m:  # a checkpoint's tokenizer where the library is not installed: said, not fatal
        find = importlib.util.find_spec
        m.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tokenizers" else find(name, *a))
        assert _text_source(None, str(CHECKPOINT), said.append) is None
        assert "the tokenizers library is not installed" in said[-1]
    small = tmp_path / "ckpt"
    shutil.copytree(CHECKPOINT, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    with pytest.raises(InputError, match=r"ids go up to 255, past the model's vocabulary of 100"):
        _text_source(None, str(small), said.append)
    assert main(["build", "--model", str(MODEL), "--tokenizer", str(tmp_path / "none"), "--out",
                 str(tmp_path / "pkg")]) == 2  # fmt: skip
    assert "is not a folder" in capsys.readouterr().err and not (tmp_path / "pkg").exists()
    assert main(["build", "--preset", "tiny", "--tokenizer", str(CHECKPOINT), "--out", str(tmp_path / "p")]) == 2
    assert "--tokenizer is for a whole model's package (--model)" in capsys.readouterr().err
