"""attnx serve: the OpenAI API over a verified whole model's package (attnx build --model).

    protocol.py   the requests (pydantic, validated before any work; unsupported fields refused by name), the error
                  object
    serving.py    Service: one package's engine loop (attnx.runtimes.engine_loop.EngineLoop) behind the handlers:
                  tokenize (a chat through the package's template), submit, stream the text as it is decoded
    api.py        create_app: the FastAPI routes (/v1/completions, /v1/chat/completions, /v1/models, /health,
                  /metrics), every error OpenAI's error object
    metrics.py    the Prometheus metrics
    server.py     serve_package: verify the package, load it, start the loop, listen (uvicorn); SIGTERM drains
    _ray.py       serve_on_ray: `attnx serve --ray`, replicas of the package on Ray Serve behind one endpoint
    _replica.py   the Ray Serve deployment: each replica verifies and loads the package where it lands, create_app
                  serves it (imports Ray: imported by _ray.py alone)

The engine knows nothing of HTTP: it runs on a thread of its own, and the asyncio side only awaits its events.
Needs the `serve` extra (fastapi, uvicorn, tokenizers, jinja2, prometheus-client).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Service", "create_app"]

# loaded when first named (as attnx's own exports): `attnx --help` and `attnx serve --ray` import attnx.serve's
# modules without the web stack, which a package's host may not have installed
_EXPORTS = {"Service": "attnx.serve.serving", "create_app": "attnx.serve.api"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'attnx.serve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
