"""`attnx serve` as a process: it verifies the package before it listens, serves the package's text through its own
tokenizer, and on SIGTERM mid-stream ends the stream cleanly (a last chunk with its finish_reason, then [DONE]) and
exits 143 with one line."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from attnx.runtimes.package import load
from attnx.workflows import build_model_package

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_attnx_serve_verifies_serves_text_and_drains_on_sigterm(tmp_path):
    pkg = tmp_path / "pkg"
    build_model_package(str(FIXTURES / "exported" / "torch-dynamo" / "llama" / "sdpa-opset20" / "model.onnx"), pkg,
                        checkpoint=str(FIXTURES / "genai" / "llama" / "checkpoint"))  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "attnx.cli", "serve", str(pkg), "--port", "0", "--max-batch", "2",
                             "--grace", "0", "--served-model-name", "fx"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        said = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            said.append(proc.stderr.readline())
            if "serving http://" in said[-1]:
                break
        listening = re.search(r"serving http://127\.0\.0\.1:(\d+)/v1", said[-1])
        assert listening, "".join(said)
        assert any("verified" in line for line in said[:-1])  # before it listened
        port = int(listening.group(1))
        import openai  # at the test, not the top: every worker imported it at collection (1 s)

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        answer = client.completions.create(model="fx", prompt="t5 t6 t7", max_tokens=8, temperature=0)
        with load(pkg) as model:
            ids = model.text.encode("t5 t6 t7")
            tokens = model.generate([ids], max_new_tokens=8, eos=sorted(model.text.eos_ids))[0]
            assert answer.choices[0].text == model.text.decode(tokens)

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": "fx", "prompt": [5, 6, 7], "max_tokens": 120,
                                                            "stream": True, "temperature": 0}))  # fmt: skip
        response = conn.getresponse()
        lines = [response.readline()]
        assert lines[0].startswith(b"data: {")
        proc.send_signal(signal.SIGTERM)  # mid-stream
        while lines[-1] and lines[-1] != b"data: [DONE]\n":
            lines.append(response.readline())
        conn.close()
        chunks = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
        assert lines[-1] == b"data: [DONE]\n"
        assert chunks[-1]["choices"][0]["finish_reason"] in {"length", "abort"}
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, stderr[-2000:]
    assert "attnx serve: terminated (SIGTERM): " in stderr and "drained" in stderr
    assert "Traceback" not in stderr
