"""Error responses: every failure is a JSON `{"error": {message, type, param, code}}` body.

`APIError(status, message, param)` is raised by the request handlers for what the server
refuses: a bad request (400), a request too large for it (413), a full queue (429), a
paused or missing model (503). The layers below raise errors as data, turned into HTTP
here only, by `server.api.handlers.install_error_handlers(app)`:
- `dllm.errors.FieldError` (the decoder's checks, the schemas' own rules) -> 400 with
  `param` = its field; `TooLong` (a prompt over max_model_len) -> 413;
- the engine's `RequestFailed` (a sequence failed) -> 500 with its message, `RequestExpired`
  -> the status its deadline was set with (408 / 503);
- pydantic validation errors (malformed JSON, wrong types, out-of-range values) -> 400
  with `param` naming the field;
- HTTP errors (404, 405, auth, `BodyTooLarge`) -> the same body shape;
- anything unexpected -> a logged 500.
"""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dllm.errors import FieldError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 413: "request_too_large",
          429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    """A client-visible error; `param` names the offending request field."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


class BodyTooLarge(StarletteHTTPException):
    """413 for a body found over the limit while it is read (FastAPI re-raises only HTTP errors
    met there, so this is one); it names the `body` field."""

    param = "body"

    def __init__(self, message: str):
        super().__init__(413, message)


def _printable(text: str | None) -> str | None:
    """Error text is echoed back as JSON: lone surrogates from the request become escapes."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": _printable(message), "type": _TYPES.get(status, "error"),
                      "param": _printable(param), "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


_UNION_TAGS = {"system", "developer", "user", "assistant", "tool"}  # chat message roles (discriminator)


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part.startswith(("constrained-", "function-"))
                                      or part in {"str", "int", "float", "bool", "list", "dict", "none"})


def _field_error(err: dict) -> FieldError | None:
    """The FieldError a schema's own rule raised (pydantic keeps it in the error's context)."""
    raised = err.get("ctx", {}).get("error")
    return raised if isinstance(raised, FieldError) else None


def _param_of(err: dict) -> str | None:
    loc = [p for p in err.get("loc", ()) if not _is_type_tag(p)]
    loc = [p for i, p in enumerate(loc) if not (i and isinstance(loc[i - 1], int) and p in _UNION_TAGS)]
    if loc and loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]
    if err.get("type", "").startswith("union_tag"):
        loc.append(str(err.get("ctx", {}).get("discriminator", "")).strip("'\""))
    raised = _field_error(err)
    if not loc or err.get("type") == "json_invalid":
        return raised.field if raised else ("body" if err.get("type") in ("json_invalid", "string_unicode") else None)
    if raised is not None and str(loc[-1]) != raised.field:  # a nested model's own rule: its field, under its path
        loc.append(raised.field)
    return ".".join(str(p) for p in loc)


def _rank(err: dict) -> tuple:
    """Most telling error first: a union reports one error per branch, mostly type mismatches of the
    branches the caller did not mean; a constraint error deeper in the input is the real one."""
    kind = err.get("type", "")
    return (kind.endswith("_type") or kind in ("model_attributes_type", "is_instance_of"), -len(err.get("loc", ())))


def _message(err: dict, param: str | None) -> str:
    kind = err.get("type")
    if kind == "json_invalid":
        return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}"
    if kind == "missing" and param:
        return f"{param}: field required"
    if kind == "extra_forbidden":  # admin / weight bodies (the generation API's own check says "did you mean")
        msg = "unrecognized request field; this server refuses fields it does not implement rather than ignore them"
    elif kind == "string_unicode":
        msg = "contains a lone surrogate or other invalid Unicode; strings must be valid Unicode"
    elif kind and kind.startswith("union_tag"):
        ctx = err.get("ctx", {})
        msg = f"{ctx.get('tag', '?')!r} is not one of {ctx.get('expected_tags', '?')}"
    elif (field_error := _field_error(err)) is not None:
        msg = field_error.message
    else:
        msg = str(err.get("msg", "invalid value"))
        for prefix in PYDANTIC_PREFIXES:  # a validator's own message, without pydantic's wrapping
            msg = msg.removeprefix(prefix)
    return f"{param}: {msg}" if param else msg


PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


NOT_AN_OBJECT = ("model_attributes_type", "dict_type", "model_type")


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    errors = sorted(exc.errors(), key=_rank)
    if not errors:
        return error_response(400, "invalid request")
    whole = [e for e in errors if tuple(e.get("loc", ())) == ("body",) and e.get("type") in NOT_AN_OBJECT]
    if whole:  # e.g. curl -d without -H "Content-Type: application/json": the body arrives as text
        got = whole[0].get("input")
        kind = "text (no Content-Type: application/json?)" if isinstance(got, (str, bytes)) else type(got).__name__
        return error_response(400, f"body: JSON object expected (send it with Content-Type: application/json), "
                                   f"got {kind}", "body")
    param = _param_of(errors[0])
    message = _message(errors[0], param)
    others = {_param_of(e) for e in errors if not _rank(e)[0]} - {param}
    if others:
        message += f" (and {len(others)} more error(s))"
    return error_response(400, message, param)
