"""The gateway's one error type: an HTTP status and a message, rendered in OpenAI's error shape, and the
one mapping of the store's named errors onto it."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import pydantic_core
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from lightning_dagster.store.errors import Conflict, InvalidInput, NotFound, StoreUnavailable
from lightning_dagster.types import IllegalTransition

log = logging.getLogger("lightning_dagster.gateway")


class GatewayError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def store_error(exc: BaseException) -> GatewayError | None:
    """The HTTP answer to a named error of the store (None: not one, a 500): input it cannot hold 422 (the
    message starts with the column), a conflicting write or an illegal attempt move 409, an unknown id
    404, a locked or read-only store 503."""
    if isinstance(exc, InvalidInput):
        return GatewayError(422, str(exc), param=str(exc).split(":", 1)[0])
    if isinstance(exc, Conflict | IllegalTransition):
        return GatewayError(409, str(exc))
    if isinstance(exc, NotFound):
        return GatewayError(404, str(exc))
    if isinstance(exc, StoreUnavailable):
        return GatewayError(503, str(exc))
    return None


def error_response(request: Request, err: GatewayError) -> Response:
    log.info("%s %s -> %d: %s", request.method, request.url.path, err.status, err.message)
    return Response(pydantic_core.to_json(err.body()), status_code=err.status, media_type="application/json")


def http_exception_response(exc: HTTPException) -> Response:
    """A Starlette `HTTPException` (a router's 404 or 405, an endpoint's own) as FastAPI's default handler
    answers it: `{"detail": ...}` with its headers (`Allow` of a 405), no body for a 204 or 304."""
    if exc.status_code in (204, 304):
        return Response(status_code=exc.status_code, headers=exc.headers)
    body = pydantic_core.to_json({"detail": exc.detail})
    return Response(body, exc.status_code, headers=exc.headers, media_type="application/json")


async def client_gone(request: Request, exc: ClientDisconnect | None = None) -> Response:
    """The answer to a request whose client closed the connection before its body arrived: logged at info,
    never as a server error (nothing is written, the connection is gone)."""
    log.info(
        "%s %s: the client closed the connection before its body arrived", request.method, request.url.path
    )
    return Response(status_code=400)


def answered(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint with the gateway's errors and the store's named errors as their HTTP answers, as the
    app's exception handlers give them: for endpoints reached without the app's middleware (`fastpath`,
    Agent Lightning's `Dispatch`)."""

    async def run(request: Request) -> Response:
        try:
            return await endpoint(request)
        except HTTPException as exc:
            return http_exception_response(exc)
        except ClientDisconnect:
            return await client_gone(request)
        except Exception as exc:
            err = exc if isinstance(exc, GatewayError) else store_error(exc)
            if err is None:
                raise
            return error_response(request, err)

    return run
