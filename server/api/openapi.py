"""The OpenAPI document of a server, made to tell the truth about what it accepts and answers.

    install_openapi(app)        # server.api.app.create_app does it; GET /openapi.json serves the result

On top of FastAPI's generated document it:
- replaces FastAPI's 422 (this server answers validation errors with 400) and adds the
  `ErrorResponse` body to every error status a route can answer: 400 for a malformed body
  or parameter, 413 for a body over `server.max_body_bytes`, 401/403/429 and a bearer security
  scheme on admin routes (the feedback token's on `/v1/feedback`), 503 on generation routes
  while the server drains;
- writes the served model's limits into the request schemas, so that a schema-valid request
  is accepted: token ids in [0, vocab) and not the mask id (`logit_bias` keys too), `steps` up to the block size,
  `max_tokens` and prompt lengths below `max_model_len`, text prompts up to the cheap
  character bound (`server.api.prompts.PromptEncoder.max_chars`), `n` and prompt lists up to
  `max_queue`. What a schema cannot say -- the token count of a text, prompt + max_tokens,
  prompts x n -- is a documented 413 ("does not fit this server"); feedback labels are the
  server's `feedback_labels`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from rollout_client.protocol.common import MAX_N
from rollout_client.protocol.service import ErrorResponse
from server.api.state import server_state

# the OpenAPI document and its nodes are JSON that FastAPI builds and reads (typed the same way there)

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
ADMIN_PREFIXES = ("/admin/", "/weights/")  # behind server.api.auth.require_admin
FEEDBACK_PATHS = ("/v1/feedback",)          # behind the feedback token (server.api.routes_feedback)
DESCRIPTIONS = {
    400: "Bad request: the field named in `error.param` is invalid",
    401: "Missing or malformed bearer token",
    403: "Wrong admin token, or admin endpoints disabled (no token configured)",
    404: "Not found (e.g. a model that is not served here)",
    408: "The request's own `timeout` passed before it finished: aborted, its cache freed",
    409: "Conflict (weight update version or state)",
    413: "Does not fit this server: body over server.max_body_bytes, prompt or prompt + max_tokens over "
         "max_model_len, or prompts x n over max_queue",
    429: "Queue full (sequences or tokens), an API key over its quota, or too many wrong tokens from this client "
         "(server.auth_max_failures); retry after the Retry-After header",
    503: "Not ready, stopped, or shutting down (draining), or past server.max_request_s (aborted)",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a route: each status with the error body and its meaning."""
    return {code: {"model": ErrorResponse, "description": DESCRIPTIONS[code]} for code in codes}


def _add_errors(op: dict[str, Any], codes: list[int]) -> None:
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    for code in codes:
        responses.setdefault(str(code), {"description": DESCRIPTIONS[code],
                                         "content": {"application/json": {"schema": ERROR_REF}}})


def _document_errors(schema: dict[str, Any], is_feedback_on: bool = True) -> None:
    for path, ops in schema.get("paths", {}).items():
        for op in ops.values():
            codes = []
            if op.get("requestBody") or op.get("parameters"):
                codes.append(400)
            if op.get("requestBody"):
                codes.append(413)
            if path.startswith(ADMIN_PREFIXES):
                codes += [401, 403, 429]
                op["security"] = [{"bearerAuth": []}]
                if path.startswith("/weights/"):
                    codes += [400, 404, 409, 413, 503]
            if path in GENERATION_PATHS:
                codes.append(503)
            if path in FEEDBACK_PATHS:
                codes.append(403)
                if is_feedback_on:  # else disabled: 403 whatever the request carries
                    codes += [401, 429]
                    op["security"] = [{"feedbackAuth": []}]
            _add_errors(op, sorted(set(codes)))
    comps = schema.setdefault("components", {})
    schemes = comps.setdefault("securitySchemes", {})
    schemes["bearerAuth"] = {"type": "http", "scheme": "bearer", "description": "the admin token"}
    schemes["feedbackAuth"] = {"type": "http", "scheme": "bearer", "description": "the feedback token "
                               "(server.feedback_token), not the admin token"}
    for name in ("HTTPValidationError", "ValidationError"):
        comps.get("schemas", {}).pop(name, None)


def _limit_prompt(node: Any, limits: dict[str, int]) -> None:
    """Walk a prompt / prompt_ids field schema and bound its strings, token ids and lists."""
    if not isinstance(node, dict):
        return
    for sub in node.get("anyOf", []) + node.get("oneOf", []):
        _limit_prompt(sub, limits)
    kind, items = node.get("type"), node.get("items")
    if kind == "integer":
        node.update(maximum=limits["vocab"] - 1, **({"not": {"enum": [limits["mask"]]}} if limits["mask"] >= 0 else {}))
    elif kind == "string":
        node["maxLength"] = limits["chars"]
    elif kind == "array" and isinstance(items, dict):
        node["maxItems"] = limits["ids"] if items.get("type") == "integer" else limits["prompts"]
        _limit_prompt(items, limits)


def _limit_bias(node: Any, limits: dict[str, int]) -> None:
    """logit_bias keys: the decimal ids of the vocabulary, not the mask id."""
    for sub in (node or {}).get("anyOf", []):
        if sub.get("type") == "object":
            names = {"pattern": ids_below(limits["vocab"])}
            sub["propertyNames"] = names | ({"not": {"const": str(limits["mask"])}} if limits["mask"] >= 0 else {})


def ids_below(n: int) -> str:
    """A regex of the decimal integers 0 .. n-1 (no leading zeros), e.g. 64 -> ^(?:[0-9]|[1-5][0-9]{1}|6[0-2]|63)$."""
    top = str(n - 1)
    d = len(top)
    if d == 1:
        return f"^(?:[0-{top}])$"
    alts = ["[0-9]"] + [f"[1-9][0-9]{{{k - 1}}}" for k in range(2, d)]  # every shorter number
    for i in range(d):  # numbers of d digits: equal to top up to i, then a smaller digit, then anything
        lo, hi = (1 if i == 0 else 0), int(top[i]) - 1
        if hi >= lo:
            rest = d - i - 1
            alts.append(top[:i] + f"[{lo}-{hi}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    return "^(?:" + "|".join([*alts, top]) + ")$"


def _limit_requests(schema: dict[str, Any], app: FastAPI) -> None:
    st = server_state(app)
    engine, backend = st.engine, st.engine.backend
    limits = {"vocab": backend.vocab_size, "mask": backend.mask_token_id, "ids": engine.max_model_len - 1,
              "chars": st.prompts.max_chars, "prompts": engine.scheduler.max_queue}
    models = schema.get("components", {}).get("schemas", {})
    for name in ("GenerateRequest", "CompletionRequest", "ChatCompletionRequest"):
        props = models.get(name, {}).get("properties", {})
        for field in ("prompt", "prompt_ids"):
            if field in props:
                _limit_prompt(props[field], limits)
        _limit_bias(props.get("logit_bias"), limits)
        bounds = {"steps": backend.block_size, "max_tokens": engine.max_model_len - 1,
                  "max_completion_tokens": engine.max_model_len - 1,
                  "n": min(MAX_N, engine.scheduler.max_queue)}
        for field, top in bounds.items():
            for sub in props.get(field, {}).get("anyOf", []):
                if sub.get("type") == "integer":
                    sub["maximum"] = min(sub.get("maximum", top), top)


def _limit_feedback(schema: dict[str, Any], app: FastAPI) -> None:
    """The labels a feedback may carry are the server's `feedback_labels`."""
    props = schema.get("components", {}).get("schemas", {}).get("FeedbackRequest", {}).get("properties", {})
    labels = sorted(server_state(app).config.feedback_labels)
    for sub in props.get("label", {}).get("anyOf", []):
        if sub.get("type") == "string":
            sub["enum"] = labels


def install_openapi(app: FastAPI) -> None:
    """Serve the corrected document at GET /openapi.json (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            _document_errors(schema, bool(server_state(app).feedback_token))
            _limit_requests(schema, app)
            _limit_feedback(schema, app)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema
