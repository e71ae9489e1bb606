"""attnx serve's API as clients use it: the official openai client against the app on a free loopback port (uvicorn on
a thread), over the llama fixture's package and its 256-word tokenizer with a chat template added. Greedy text is
attnx generate's tokens decoded; stop strings cut across tokens; a client that leaves frees its row; a full queue
answers 429; bad bodies answer 400 with OpenAI's error object; /health, /v1/models, /metrics."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from attnx.runtimes.engine_loop import EngineLoop
from attnx.runtimes.model_package import engine_for
from attnx.runtimes.package import load
from attnx.runtimes.text import PackageText
from attnx.serve import Service, create_app
from attnx.workflows import build_model_package

if TYPE_CHECKING:
    import openai

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CHECKPOINT = FIXTURES / "genai" / "llama" / "checkpoint"
# roles as words of the fixture's vocabulary (t10 the user, t11 the assistant), the generation prompt t12
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}t10 {% else %}t11 {% endif %}{{ m['content'] }} "
            "{% endfor %}{% if add_generation_prompt %}t12{% endif %}")  # fmt: skip
NAME = "llama-fixture"


class _Gate:
    """The package's text, whose decoder can hold the engine's thread: hold(n) makes the n-th token decoded from
    then on wait (inside its request's listener, between two steps) until release()."""

    def __init__(self, text: PackageText) -> None:
        self._text = text
        self.count, self.at = 0, None
        self.entered, self.opened = threading.Event(), threading.Event()
        self.opened.set()

    def __getattr__(self, name: str):
        return getattr(self._text, name)

    def hold(self, at: int) -> None:
        self.count, self.at = 0, at
        self.entered.clear()
        self.opened.clear()

    def release(self) -> None:
        self.at = None
        self.opened.set()

    def detokenizer(self, prompt=()):
        inner, gate = self._text.detokenizer(prompt), self

        class Decoder:
            def add(self, token: int) -> str:
                gate.count += 1
                if gate.at is not None and gate.count == gate.at:
                    gate.entered.set()
                    gate.opened.wait(60)
                return inner.add(token)

            def flush(self) -> str:
                return inner.flush()

        return Decoder()


def _start(service: Service):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.01)
    assert server.started

    def stop() -> None:
        server.should_exit = True
        thread.join(30)
        service.close()
        sock.close()

    return sock.getsockname()[1], stop


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(port, service, model, text): the package served with 2 rows and a queue of 1."""
    root = tmp_path_factory.mktemp("serve")
    build_model_package(str(FIXTURES / "exported" / "torch-dynamo" / "llama" / "sdpa-opset20" / "model.onnx"),
                        root / "pkg", checkpoint=str(CHECKPOINT))  # fmt: skip
    text_dir = root / "text"
    text_dir.mkdir()
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(CHECKPOINT / name, text_dir / name)
    config = json.loads((CHECKPOINT / "tokenizer_config.json").read_text())
    (text_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    text = PackageText.from_folder(str(text_dir))
    model = load(root / "pkg")
    service = Service(EngineLoop(engine_for(model.runner, model.manifest, 2), max_queue=1), NAME, _Gate(text))
    port, stop = _start(service.start())
    yield port, service, model, text
    stop()
    model.close()


# The official client is imported where a test uses it: imported at the top, every worker paid it (1 s of CPU) while
# collecting the whole suite.
def _rate_limited() -> type[Exception]:
    import openai

    return openai.RateLimitError


def _client(port: int) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)


def _greedy(model, text: PackageText, ids: list[int], new: int) -> str:
    return text.decode(model.generate([ids], max_new_tokens=new, eos=sorted(text.eos_ids))[0])


def _post(port: int, path: str, body, *, raw: bool = False) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body if raw else json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, dict(response.getheaders()), json.loads(data)


def test_completions_whole_and_streamed_are_generates_greedy_text(served):
    port, service, model, text = served
    client = _client(port)
    prompt = "t5 t6 t7 t8 t9"
    ids = text.encode(prompt)
    want = _greedy(model, text, ids, 20)
    whole = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0)
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (5, 20, 25)
    chunks = list(client.completions.create(model=NAME, prompt=ids, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices


def test_chat_renders_the_template_and_streams_the_same_text(served):
    port, service, model, text = served
    client = _client(port)
    messages = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7"},
                {"role": "user", "content": "t8 t9 t20"}]  # fmt: skip
    ids = text.encode("t10 t5 t6 t11 t7 t10 t8 t9 t20 t12", add_special_tokens=False)
    want = _greedy(model, text, ids, 16)
    whole = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=16, temperature=0)
    assert whole.choices[0].message.content == want and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_stop_string_across_tokens_is_cut_from_the_text(served):
    """A stop string that starts inside one token's text and ends inside the next's: the text before it, whole and
    streamed (no part of it ever sent), finish_reason stop, and the row ended at the token that completed it."""
    port, service, model, text = served
    client = _client(port)
    ids = text.encode("t5 t6 t7 t8 t9")
    tokens = model.generate([ids], max_new_tokens=20, eos=sorted(text.eos_ids))[0]
    full = text.decode(tokens)
    third = len(text.decode(tokens[:3]))
    stop = full[third - 2: third + 3]  # the third token's last two characters and the fourth's first three
    cut = full[: full.find(stop)]
    whole = client.completions.create(model=NAME, prompt=ids, max_tokens=20, temperature=0, stop=[stop, "zz"])
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == 4
    streamed = list(client.completions.create(model=NAME, prompt=ids, max_tokens=20, temperature=0, stop=stop,
                                              stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_a_request_alone_and_beside_others_gets_the_same_text(served):
    port, service, model, text = served
    client = _client(port)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 256, n)] for n in (4, 11, 7)]
    alone = [client.completions.create(model=NAME, prompt=p, max_tokens=24, temperature=0).choices[0].text
             for p in prompts]  # fmt: skip
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        for _ in range(20):  # a queue of one: a request refused (429) asks again
            try:
                answer = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=24, temperature=0)
            except _rate_limited():
                time.sleep(0.05)
                continue
            results[i] = answer.choices[0].text
            return

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results.get(i) for i in range(len(prompts))] == alone
    assert alone == [_greedy(model, text, p, 24) for p in prompts]


def test_a_client_that_leaves_mid_stream_frees_its_row(served):
    port, service, model, text = served
    gate = service.text
    before = service.finished["cancelled"]
    gate.hold(4)  # the engine waits at the request's fourth token: three were streamed
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps({"prompt": [5, 6, 7], "max_tokens": 100, "stream": True,
                                                            "temperature": 0}))  # fmt: skip
        response = conn.getresponse()
        assert response.status == 200
        assert gate.entered.wait(60)
        assert response.readline().startswith(b"data: {")
        conn.close()  # the client leaves
        while service.answering:  # the stream saw it leave: its request is cancelled
            time.sleep(0.01)
    finally:
        conn.close()
        gate.release()
    while service.loop.running:
        time.sleep(0.01)
    assert service.finished["cancelled"] == before + 1
    metrics = _get(port, "/metrics")[1]
    assert 'attnx_requests_total{outcome="cancelled"}' in metrics and "attnx_batch_rows 0.0" in metrics


def test_a_full_queue_answers_429_with_retry_after(served):
    """Two rows, a queue of one: the engine held inside a request's first token, a second request waits, the third
    is refused; once the engine goes on, both accepted requests are answered."""
    port, service, model, text = served
    gate = service.text
    answers: dict[str, int] = {}

    def ask(key: str, ids: list[int]) -> None:
        answers[key] = _post(port, "/v1/completions", {"prompt": ids, "max_tokens": 3})[0]

    gate.hold(1)
    first = threading.Thread(target=ask, args=("first", [5, 6]))
    first.start()
    assert gate.entered.wait(60)
    second = threading.Thread(target=ask, args=("second", [7, 8]))
    second.start()
    while service.loop.waiting < 1:
        time.sleep(0.01)
    try:
        with pytest.raises(_rate_limited()) as refused:
            _client(port).completions.create(model=NAME, prompt=[9], max_tokens=3)
    finally:
        gate.release()
    first.join(60)
    second.join(60)
    assert refused.value.response.headers["retry-after"] == "1"
    assert refused.value.body["code"] == "queue_full" and refused.value.body["type"] == "rate_limit_error"
    assert answers == {"first": 200, "second": 200}


@pytest.mark.parametrize(("body", "status", "param", "said"), [
    (b"{not json", 400, None, "not JSON"),
    ([1, 2], 400, None, "not an object"),
    ({"max_tokens": 4}, 400, "prompt", "prompt: Field required"),
    ({"prompt": "t5", "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ({"prompt": "t5", "temperature": 3}, 400, "temperature", "less than or equal to 2"),
    ({"prompt": "t5", "n": 2, "logprobs": 1, "tools": [], "frobnicate": 1}, 400, "n", "n=2, logprobs=1, frobnicate"),
    ({"prompt": [5, 999]}, 400, "prompt", "token id 999 is outside the vocabulary"),
    ({"prompt": [5] * 100, "max_tokens": 40}, 400, "prompt", "maximum context length is 128 tokens"),
    ({"prompt": "t5", "model": "gpt-4"}, 404, "model", "The model `gpt-4` does not exist"),
    ({"prompt": ["t5", "t6"]}, 400, "prompt", "2 prompts"),
])  # fmt: skip
def test_bad_bodies_are_answered_with_the_error_object(served, body, status, param, said):
    port = served[0]
    got, _, answer = _post(port, "/v1/completions", body, raw=isinstance(body, bytes))
    assert got == status
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert said in answer["error"]["message"] and answer["error"]["param"] == param
    assert "Traceback" not in json.dumps(answer)


def test_chat_errors_and_unknown_routes_are_error_objects(served):
    port = served[0]
    status, _, answer = _post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]})  # fmt: skip
    assert status == 400 and "image_url" in answer["error"]["message"]
    status, _, answer = _post(port, "/v1/embeddings", {"input": "t5"})
    assert status == 404 and answer["error"]["type"] == "not_found_error"


def _get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path)
    response = conn.getresponse()
    data = response.read().decode()
    conn.close()
    return response.status, data


def test_health_models_and_metrics(served):
    port, service, model, text = served
    assert _get(port, "/health") == (200, '{"status":"ok"}')
    models = _client(port).models.list()
    assert [m.id for m in models.data] == [NAME]
    status, metrics = _get(port, "/metrics")
    assert status == 200
    for name in ("attnx_requests_total", "attnx_prompt_tokens_total", "attnx_generation_tokens_total",
                 "attnx_time_to_first_token_seconds_bucket", "attnx_time_between_tokens_seconds_bucket",
                 "attnx_queue_depth", "attnx_batch_rows"):  # fmt: skip
        assert f"\n{name}" in metrics, name


def test_a_package_without_text_serves_token_ids_alone(served, tmp_path):
    """No tokenizer: token-id prompts on /v1/completions, answered with the new ids (token_ids); a string prompt, a
    stop string and a chat are refused with the reason. Once it drains: 503 for /health and new requests."""
    port, service, model, text = served
    loop = EngineLoop(engine_for(model.runner, model.manifest, 1), max_queue=2)
    bare = Service(loop, "bare").start()
    bare_port, stop = _start(bare)
    try:
        ids = [5, 6, 7]
        answer = _client(bare_port).completions.create(model="bare", prompt=ids, max_tokens=6, temperature=0)
        assert answer.choices[0].text == "" and answer.choices[0].token_ids == model.generate([ids], max_new_tokens=6)[0]
        for path, body, said in [("/v1/completions", {"prompt": "t5"}, "send the prompt as a list of token ids"),
                                 ("/v1/completions", {"prompt": [5], "stop": "x"}, "stop strings cannot be matched"),
                                 ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}]},
                                  "token-id prompts")]:  # fmt: skip
            status, _, error = _post(bare_port, path, body)
            assert status == 400 and said in error["error"]["message"]
        bare.close()  # as SIGTERM's drain does: the port still open, nothing accepted
        assert _get(bare_port, "/health") == (503, '{"status":"draining"}')
        status, headers, error = _post(bare_port, "/v1/completions", {"prompt": [5]})
        assert status == 503 and error["error"]["code"] == "unavailable"
    finally:
        stop()


@pytest.mark.slow  # imports torch and transformers (~10 s)
def test_chat_text_is_transformers_greedy_generate_with_the_same_template(served):
    """The chat's prompt as transformers' apply_chat_template makes it (the same template, the same tokenizer file)
    and transformers' greedy generate decoded by transformers: the server's answer, character for character."""
    import torch
    from transformers import PreTrainedTokenizerFast

    from tests.fixtures.fixturelib import load_eager

    port = served[0]
    messages = [{"role": "user", "content": "t40 t41 t42"}]
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(CHECKPOINT / "tokenizer.json"), chat_template=TEMPLATE)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    model = load_eager(CHECKPOINT)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=0)  # fmt: skip
    want = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    answer = _client(port).chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    assert answer.choices[0].message.content == want
