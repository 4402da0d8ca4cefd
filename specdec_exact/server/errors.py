"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, and the validation errors of a request
body turned into one."""

from __future__ import annotations

import logging
import secrets

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

log = logging.getLogger("specdec.server")


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


def generation_failed(error: BaseException) -> APIError:
    """A request whose generation raised: a 500 its client can tell from its own mistake (retry, or report it). The
    message names the kind of fault and an incident id; what the exception said (paths, internals) goes to the
    server's log under that id, not to the client. The other requests of the batch are not affected."""
    return internal_error(error, "the generation failed", "generation_failed")


def internal_error(error: BaseException, what: str, code: str | None = None) -> APIError:
    """A 500 for an exception of the server's: logged whole under a new incident id, which the message names."""
    incident = secrets.token_hex(4)
    log.error("incident %s: %s", incident, what, exc_info=(type(error), error, error.__traceback__))
    return APIError(500, f"{what} ({type(error).__name__}): the server's log holds the details under incident "
                         f"{incident}", code=code, kind="server_error")


def validation_error(error: RequestValidationError) -> APIError:
    """The first problem pydantic found in a request body, as a 400 naming the field (its `param`)."""
    first = error.errors()[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', '')})")
    where = [str(part) for part in first["loc"] if part != "body"]
    message = f"{'.'.join(where)}: {first['msg']}" if where else f"the request body: {first['msg']}"
    return APIError(400, message, where[0] if where else None)
