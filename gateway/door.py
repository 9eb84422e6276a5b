"""The door: what a request may cost before it is let in, checked before its body is read.

An unauthenticated caller costs a header, nothing more: the API key is checked before any of
the body is read, parsed or spooled to disk, and every body is bounded in size and in time
before the app sees it:

- ``Content-Length`` above the route's limit: 413 at once, nothing read;
- a body without one (chunked) is counted as it is read, and refused with 413 as soon as it
  passes the limit (the app's own error for the half-read body is replaced by the 413);
- a body still arriving EDGEQ_GATEWAY_BODY_TIMEOUT_S after the request began: 408.

A refusal closes the connection (``Connection: close``), so the rest of a large body is not
read either. The routes' limits are here, in ``body_limit``, and nowhere else.

A pure ASGI middleware, not Starlette's BaseHTTPMiddleware: that one reads the body through
its own streams, and streamed responses (server-sent events) must pass through untouched.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from starlette.formparsers import MultiPartException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edgeq.gateway.auth import accepted_at, unauthorized
from edgeq.gateway.errors import ApiError
from edgeq.gateway.settings import JSON_MARGIN_BYTES, GatewaySettings

#: What an upload's body may hold beyond its file: the multipart boundaries, the part headers
#: and the ``purpose`` field take a few hundred bytes; this leaves room to spare.
MULTIPART_MARGIN_BYTES = 64 * 1024
#: The route whose body is a file upload (multipart); every other body is JSON.
UPLOAD_ROUTE = ("POST", "/v1/files")


@dataclass(frozen=True)
class BodyLimit:
    """The most bytes a route's body may have, and the settings that make it (for the 413)."""

    max_bytes: int
    made_of: str


def body_limit(settings: GatewaySettings, method: str, path: str) -> BodyLimit:
    """The body limit of the route ``method path``."""
    if (method, path.rstrip("/")) == UPLOAD_ROUTE:
        file_max = settings.gateway_file_max_bytes
        return BodyLimit(
            file_max + MULTIPART_MARGIN_BYTES,
            f"EDGEQ_GATEWAY_FILE_MAX_BYTES ({file_max}) plus {MULTIPART_MARGIN_BYTES} bytes "
            f"of multipart framing",
        )
    if settings.gateway_max_body_bytes is not None:
        return BodyLimit(settings.gateway_max_body_bytes, "EDGEQ_GATEWAY_MAX_BODY_BYTES")
    return BodyLimit(
        settings.json_body_max_bytes,
        f"EDGEQ_MAX_REQUEST_BYTES ({settings.max_request_bytes}) plus {JSON_MARGIN_BYTES} "
        f"bytes of JSON framing; EDGEQ_GATEWAY_MAX_BODY_BYTES sets it",
    )


def too_large(limit: BodyLimit, size: int | None) -> ApiError:
    said = f"{size} bytes" if size is not None else f"more than {limit.max_bytes} bytes"
    return ApiError(
        413,
        f"request body: {said}, more than the {limit.max_bytes} this route takes ({limit.made_of})",
        type="invalid_request_error",
        code="request_too_large",
        param="body",
    )


def too_slow(timeout_s: float) -> ApiError:
    return ApiError(
        408,
        f"request body: not received within {timeout_s:g} s of the request's start "
        f"(EDGEQ_GATEWAY_BODY_TIMEOUT_S)",
        type="invalid_request_error",
        code="request_timeout",
        param="body",
    )


class BodyRefused(MultiPartException):
    """Raised from ``receive`` when the body passes its limit or its deadline. A
    MultiPartException, so Starlette's form parser closes what it spooled before it lets the
    error go; whatever the app then answers, the door answers ``error`` instead."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(str(error))
        self.error = error


class GuardedBody:
    """``receive``, counting the body's bytes against ``limit`` and its time against
    ``deadline`` (a time.monotonic() reading); what it refused, once it has."""

    def __init__(
        self, receive: Receive, limit: BodyLimit, deadline: float, timeout_s: float
    ) -> None:
        self._receive = receive
        self._limit = limit
        self._deadline = deadline
        self._timeout_s = timeout_s
        self._read = 0
        self._body_done = False
        self.refused: ApiError | None = None

    async def receive(self) -> Message:
        if self.refused is not None:
            raise BodyRefused(self.refused)
        if self._body_done:  # after the body: http.disconnect, whenever it comes
            return await self._receive()
        try:
            async with asyncio.timeout(max(self._deadline - time.monotonic(), 0.0)):
                message = await self._receive()
        except TimeoutError:
            self.refused = too_slow(self._timeout_s)
            raise BodyRefused(self.refused) from None
        if message["type"] == "http.request":
            self._read += len(message.get("body", b""))
            if self._read > self._limit.max_bytes:
                self.refused = too_large(self._limit, None)
                raise BodyRefused(self.refused)
            self._body_done = not message.get("more_body", False)
        else:
            self._body_done = True
        return message


async def answer(error: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
    """``error`` as the response, closing the connection: the rest of the body is not read."""
    response = error.response()
    response.headers["Connection"] = "close"
    await response(scope, receive, send)


class Door:
    """The ASGI middleware that checks the key and bounds the body (see the module doc)."""

    def __init__(self, app: ASGIApp, settings: GatewaySettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        settings = self.settings
        path: str = scope["path"]
        if path == "/v1" or path.startswith("/v1/"):
            authorization = _header(scope, b"authorization")
            if not accepted_at(settings, path, authorization.decode("latin-1")):
                await answer(unauthorized(), scope, receive, send)
                return
        limit = body_limit(settings, scope["method"], path)
        declared = _header(scope, b"content-length")
        if declared:
            if not declared.isdigit():
                error = ApiError(
                    400,
                    "Content-Length: not a number of bytes",
                    type="invalid_request_error",
                    code="invalid_request",
                )
                await answer(error, scope, receive, send)
                return
            if int(declared) > limit.max_bytes:
                await answer(too_large(limit, int(declared)), scope, receive, send)
                return
        timeout_s = settings.gateway_body_timeout_s
        body = GuardedBody(receive, limit, started + timeout_s, timeout_s)
        replaced = False

        async def guarded_send(message: Message) -> None:
            # The app's own answer to a body the door cut short (FastAPI's "error parsing the
            # body", Starlette's form error) is replaced by the door's.
            nonlocal replaced
            if body.refused is None:
                await send(message)
            elif message["type"] == "http.response.start" and not replaced:
                replaced = True
                await answer(body.refused, scope, receive, send)

        try:
            await self.app(scope, body.receive, guarded_send)
        except BodyRefused as refused:
            if not replaced:
                await answer(refused.error, scope, receive, send)


def _header(scope: Scope, name: bytes) -> bytes:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return b""
