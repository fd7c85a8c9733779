"""The gateway's one error type: an HTTP status and a message, rendered in OpenAI's error shape, and the
one mapping of the store's named errors onto it."""

from __future__ import annotations

import logging

import pydantic_core
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
    """The HTTP answer to a named error of the store (None: not one, a 500)."""
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


async def client_gone(request: Request, exc: ClientDisconnect | None = None) -> Response:
    """A client gone before its body arrived: logged at info, never as a server error."""
    log.info(
        "%s %s: the client closed the connection before its body arrived", request.method, request.url.path
    )
    return Response(status_code=400)
