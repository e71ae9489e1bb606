"""attnx serve's routes (FastAPI): the OpenAI API over one Service, and nothing else. Every error is OpenAI's error
object (a wrong route, a wrong method, a body that is not JSON, a failure inside: never a traceback)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from attnx.serve.protocol import ServeError, error_body
from attnx.serve.serving import Service

__all__ = ["create_app"]

MAX_BODY_BYTES = 8 * 1024**2  # a prompt of a million characters is 1 MB of JSON; past 8 MB a body is refused


def create_app(service: Service) -> Any:
    """The FastAPI app serving `service` (started by the caller: Service.start)."""
    app = FastAPI(title="attnx serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    @app.exception_handler(ServeError)
    async def _serve_error(request: Request, e: ServeError) -> JSONResponse:
        service.reject(e)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {e.detail}", kind),
                            status_code=e.status_code, headers=getattr(e, "headers", None))  # fmt: skip

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:  # its traceback in the server's log alone
        service.metrics.requests.labels("error").inc()
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)

    async def body_of(request: Request) -> Any:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise ServeError(413, f"the body is {size} bytes, over the {MAX_BODY_BYTES} attnx serve reads")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ServeError(413, f"the body is over the {MAX_BODY_BYTES} bytes attnx serve reads")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise ServeError(400, f"the body is not JSON ({str(e)[:100]})") from None

    async def answer(request: Request, chat: bool) -> Response:
        result = await service.answer(await body_of(request), chat, request.receive)
        if result is None:  # the client left
            return Response(status_code=499)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await answer(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": service.name, "object": "model", "created": service.created, "owned_by": "attnx",
                "max_model_len": service.loop.max_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if service.healthy:
            return JSONResponse({"status": "ok"})
        state = "draining" if service.draining else "failed" if service.loop.failure else "starting"
        return JSONResponse({"status": state}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        data, content_type = service.metrics.render()
        return Response(data, media_type=content_type)

    return app
