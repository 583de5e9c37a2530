"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every `/v1/` route, so
OpenAI clients raise their typed errors (BadRequestError, AuthenticationError, NotFoundError,
RateLimitError, ...) with a readable message. Other routes (probes, metrics) keep FastAPI's shape."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          429: "rate_limit_error", 503: "service_unavailable"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": _TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else None
        return JSONResponse(body, status_code=self.status, headers=headers)


def validation_error(err: RequestValidationError) -> OpenAIError:
    """400 naming what is wrong; fields we do not serve are listed as unsupported parameters."""
    errors = err.errors()
    unsupported = [str(e["loc"][-1]) for e in errors if e["type"] == "extra_forbidden"]
    if unsupported:
        return OpenAIError(400, f"unsupported parameter(s): {', '.join(unsupported)}; this server does not "
                                "serve them: leave them out",
                           param=unsupported[0], code="unsupported_parameter")
    first = errors[0]
    fields = [str(part) for part in first["loc"] if part != "body"]
    param = ".".join(fields) or None
    message = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}"
                        for e in errors)
    return OpenAIError(400, message, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    def is_api(request: Request) -> bool:
        return request.url.path.startswith("/v1/")

    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, err: OpenAIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        if is_api(request):
            return validation_error(err).response()
        return await request_validation_exception_handler(request, err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        if is_api(request):
            code = "invalid_api_key" if err.status_code == 401 else None
            return OpenAIError(err.status_code, str(err.detail), code=code).response()
        return await http_exception_handler(request, err)
