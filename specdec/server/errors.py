"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, and the validation errors of a request
body turned into one."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}}, like OpenAI's."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind, self.headers = (
            status, message, param, code, kind, headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def generation_failed(error: Exception) -> APIError:
    """A request whose generation raised: a 500 that names what failed, so that its client can tell a fault of the
    model (retry, or report it) from its own mistake. The other requests of the batch are not affected."""
    return APIError(500, f"the generation failed: {type(error).__name__}: {error}", code="generation_failed",
                    kind="server_error")


def validation_error(error: RequestValidationError) -> APIError:
    """The first problem pydantic found in a request body, as a 400 naming the field (its `param`)."""
    first = error.errors()[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', '')})")
    where = [str(part) for part in first["loc"] if part != "body"]
    message = f"{'.'.join(where)}: {first['msg']}" if where else f"the request body: {first['msg']}"
    return APIError(400, message, where[0] if where else None)
