"""The FastAPI app under the ingress: its error handlers and how routes are registered.

Every route is registered on `/v1/...` and on each pricing prefix (`/premium/v1/...`,
`/standard/v1/...`, `/economy/v1/...`); `endpoint_plan` reads which one a request came in on.
Unknown paths, bad JSON and unhandled errors answer in OpenAI's error shape. Owns nothing of
a request's handling (`router/ingress.py`).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from router.openai_schema import HTTPError

logger = logging.getLogger("ray.serve")
ENDPOINT_PLANS = ("premium", "standard", "economy")
PREFIXES = ("",) + tuple(f"/{p}" for p in ENDPOINT_PLANS)

app = FastAPI(title="specserve", docs_url=None, redoc_url=None)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Unknown paths and methods answer in OpenAI's error shape too."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return HTTPError(exc.status_code, str(exc.detail), code, headers=exc.headers).response()


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    return HTTPError(400, "the request is not valid", "invalid_value").response()


@app.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception) -> Response:
    """The last resort: logged here, never shown to the client."""
    logger.error("unhandled error on %s", request.url.path, exc_info=exc)
    return HTTPError(500, "internal error", "internal_error").response()


def routes(suffix: str, method: str = "post"):
    """Register one handler on `/v1/...` and on every pricing prefix."""
    def wrap(fn):
        for prefix in PREFIXES:
            getattr(app, method)(prefix + suffix)(fn)
        return fn
    return wrap


def endpoint_plan(request: Request) -> str:
    first = request.url.path[len(request.scope.get("root_path", "")):].lstrip("/").split("/")[0]
    return first if first in ENDPOINT_PLANS else "auto"


async def chain(first, stream):
    yield first
    if not first.done:
        async for chunk in stream:
            yield chunk
