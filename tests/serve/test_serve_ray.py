"""`attnx serve --ray`: replicas of a verified package on Ray Serve behind one endpoint. The slow test runs the command
as a user does, on a local Ray cluster it starts (2 replicas of the llama fixture's package), and speaks to it with the
official openai client: the same greedy text from every replica, requests spread across both (each answer names its
replica), SIGTERM deletes the app, stops the cluster and exits 143. The fast tests hold the errors: the options
without --ray, a replica's failed check as attnx says it."""

from __future__ import annotations

import concurrent.futures
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnx.errors import CheckFailed, UsageError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PROMPTS = ["t5 t6 t7", "t9 t3", "t40 t41 t42 t43"]


def test_replica_options_need_ray(tmp_path):
    out = subprocess.run([sys.executable, "-m", "attnx.cli", "serve", str(tmp_path), "--replicas", "2"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2
    assert "--replicas deploys replicas on Ray Serve: give it with --ray" in out.stderr
    assert "Traceback" not in out.stderr


def test_serve_without_ray_never_imports_it():
    code = ("import sys, attnx.commands.serve, attnx.serve.server, attnx.serve._ray; "
            "sys.exit('ray' in sys.modules)")  # fmt: skip
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_ray_missing_says_what_to_install(monkeypatch):
    import importlib.util

    from attnx.serve import _ray

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    with pytest.raises(UsageError, match=r"needs Ray Serve, .*pip install 'attnx\[serve-ray\]'"):
        _ray.serve_on_ray("pkg", "local")


def test_a_replica_failure_is_said_as_attnx_says_it():
    from attnx.serve._ray import _replica_failure

    status = ("The deployment failed to start 1 times in a row.\nTraceback (most recent call last):\n  File x\n"
              "attnx.errors.CheckFailed: /pkg: verify failed: tokenizer.json: 5859 bytes, expected 5858 (grown)")  # fmt: skip
    failed = _replica_failure("Deploying application attnx failed", status)
    assert isinstance(failed, CheckFailed)
    assert str(failed) == "a replica: /pkg: verify failed: tokenizer.json: 5859 bytes, expected 5858 (grown)"
    usage = _replica_failure("failed", "attnx.errors.PackageError: /pkg: not an attnx package")
    assert isinstance(usage, UsageError) and "not an attnx package" in str(usage)
    other = _replica_failure("Deploying application attnx failed", "ValueError: boom\n")
    assert isinstance(other, CheckFailed) and str(other).endswith("(ValueError: boom)")


@pytest.mark.slow
def test_replicas_on_a_local_ray_cluster_answer_the_same_text_and_share_the_load(tmp_path):
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (the serve-ray extra)")
    from attnx.runtimes.package import load
    from attnx.workflows import build_model_package

    pkg = tmp_path / "pkg"
    build_model_package(str(FIXTURES / "exported" / "torch-dynamo" / "llama" / "sdpa-opset20" / "model.onnx"), pkg,
                        checkpoint=str(FIXTURES / "genai" / "llama" / "checkpoint"))  # fmt: skip
    with load(pkg) as model:
        eos = sorted(model.text.eos_ids)
        expected = {p: model.text.decode(model.generate([model.text.encode(p)], max_new_tokens=8, eos=eos)[0])
                    for p in PROMPTS}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "attnx.cli", "serve", str(pkg), "--ray", "--replicas", "2",
                             "--replica-cpus", "0.5", "--port", "0", "--served-model-name", "fx", "--grace", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        said = []
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and proc.poll() is None:
            said.append(proc.stderr.readline())
            if "serving http://" in said[-1]:
                break
        text = "".join(said)
        if "Ray could not start on this machine" in text:
            pytest.skip(f"Ray cannot start here: {text.strip().splitlines()[-1]}")
        listening = re.search(r"serving http://127\.0\.0\.1:(\d+)/v1 on Ray Serve", said[-1] if said else "")
        assert listening, text
        assert "verified and loaded: 2 replicas" in said[-2]  # announced once every replica verified
        import openai  # at the test, not the top: every worker imported it at collection (1 s)

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{listening.group(1)}/v1", api_key="none", max_retries=0,
                               timeout=60)  # fmt: skip

        def ask(prompt: str) -> tuple[str, str, str]:
            raw = client.completions.with_raw_response.create(model="fx", prompt=prompt, max_tokens=8, temperature=0)
            return prompt, raw.headers["x-attnx-replica"], raw.parse().choices[0].text

        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # at once: Serve's router spreads them
            answers = list(pool.map(ask, PROMPTS * 8))
        assert [t for _, _, t in answers] == [expected[p] for p, _, _ in answers]  # whichever replica answered
        assert len({r for _, r, _ in answers}) == 2, answers  # both replicas served
        streamed = client.completions.create(model="fx", prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == expected[PROMPTS[0]]

        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, stderr[-2000:]
    assert "the Serve app and its 2 replicas shut down, the local Ray cluster stopped" in stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize(("address", "where"), [("local", "Ray could not start on this machine"),
                                                 ("10.0.0.9:6379", "Ray Serve could not start there")])  # fmt: skip
def test_a_proxy_that_does_not_start_is_said_by_name(address, where):
    """Serve's controller kills an HTTP proxy not ready in time (a loaded host: ActorDiedError) and serve.start
    gives up after 60 s (TimeoutError): one UsageError naming the proxy, not an internal error."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (the serve-ray extra)")
    from attnx.serve._ray import _start_serve

    class Serve:
        def __init__(self, error):
            self.error = error

        def start(self, **_):
            raise self.error

    for error in (TimeoutError("HTTP proxies not available after 60s."), ray.exceptions.RayError("killed")):
        with pytest.raises(UsageError) as raised:
            _start_serve(ray, Serve(error), address, "127.0.0.1", 8000)
        assert str(raised.value).startswith(f"--ray {address}: {where}: Serve's HTTP proxy did not start (")
        assert type(error).__name__ in str(raised.value)


def test_a_local_cluster_gives_the_proxy_time_and_keeps_a_users_setting(monkeypatch):
    """The ready check's 5 s is raised for a local cluster's processes (they inherit the environment), a value the
    user set is kept, and both are gone from the environment once the cluster is closed."""
    import os

    from attnx._ray import RayConnection
    from attnx.serve._ray import LOCAL_SERVE_SETTINGS

    key = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
    monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    local = RayConnection("local")
    local.prepare(LOCAL_SERVE_SETTINGS)
    assert os.environ[key] == "60" and os.environ["RAY_AUTH_MODE"] == "token"
    local.close(None)
    assert key not in os.environ and "RAY_AUTH_MODE" not in os.environ
    monkeypatch.setenv(key, "7")
    local.prepare(LOCAL_SERVE_SETTINGS)
    assert os.environ[key] == "7"
    local.close(None)
    assert os.environ[key] == "7"
