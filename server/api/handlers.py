"""The app's exception handlers: each error of server.api.errors' list turned into its JSON error response,
and counted in `dlrl_requests_total` for the generation routes.

    install_error_handlers(app)        # server.api.app, once
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dllm.errors import FieldError, TooLong
from server.api.errors import APIError, BodyTooLarge, error_response, validation_error_response
from server.api.state import server_state
from server.engine.engine import RequestExpired, RequestFailed

log = logging.getLogger("dlrl.server")


COUNTED = ("/generate", "/v1/completions", "/v1/chat/completions")


def _count(request: Request, status: int) -> None:
    if request.url.path in COUNTED:
        server_state(request.app).metrics.observe_request(request.url.path, status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        _count(request, exc.status)
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(FieldError)
    async def _field_error(request: Request, exc: FieldError) -> JSONResponse:
        status = 413 if isinstance(exc, TooLong) else 400
        _count(request, status)
        return error_response(status, str(exc), exc.field)

    @app.exception_handler(RequestExpired)
    async def _request_expired(request: Request, exc: RequestExpired) -> JSONResponse:
        status = exc.deadline_status
        _count(request, status)
        return error_response(status, str(exc), None, {"Retry-After": "1"} if status == 503 else None)

    @app.exception_handler(RequestFailed)
    async def _request_failed(request: Request, exc: RequestFailed) -> JSONResponse:
        _count(request, 500)
        return error_response(500, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        _count(request, 400)
        return validation_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        param = exc.param if isinstance(exc, BodyTooLarge) else None
        if param:
            _count(request, exc.status_code)
        return error_response(exc.status_code, message, param, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        _count(request, 500)
        return error_response(500, f"internal error: {type(exc).__name__}")
