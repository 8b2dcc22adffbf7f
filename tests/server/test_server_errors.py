"""The route edge maps the lower layers' errors-as-data to the API's error bodies (server.api.errors).

A minimal app with the server's handlers whose routes raise what the decoder, the wire
schemas and the engine raise; FastAPI's TestClient drives it (no model needed).
"""

from fastapi import FastAPI
from fastapi.testclient import TestClient

from dllm.errors import FieldError, TooLong
from server.api.handlers import install_error_handlers
from server.engine.engine import RequestExpired, RequestFailed

RAISES = {
    "field": FieldError("steps", "must be an integer in [1, block_size=4], got 9"),
    "too_long": TooLong("max_tokens", "prompt (3 tokens) + max_tokens (99) exceeds max_model_len=64"),
    "failed": RequestFailed("sample 1: sampling failed: probabilities not finite"),
    "expired": RequestExpired("request timed out after 2.0 s (server.max_request_s)", 503),
    "timeout": RequestExpired("request timed out after 0.5 s (its timeout)", 408),
}


def make_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/raise/{name}")
    async def _raise(name: str):
        raise RAISES[name]

    return app


def test_errors_as_data_become_the_api_error_bodies():
    client = TestClient(make_app())
    want = {
        "field": (400, "invalid_request_error", "steps", "steps: must be an integer in [1, block_size=4], got 9"),
        "too_long": (413, "request_too_large", "max_tokens",
                     "max_tokens: prompt (3 tokens) + max_tokens (99) exceeds max_model_len=64"),
        "failed": (500, "error", None, "sample 1: sampling failed: probabilities not finite"),
        "expired": (503, "service_unavailable", None, "request timed out after 2.0 s (server.max_request_s)"),
        "timeout": (408, "timeout_error", None, "request timed out after 0.5 s (its timeout)"),
    }
    for name, (status, kind, param, message) in want.items():
        r = client.get(f"/raise/{name}")
        assert r.status_code == status, (name, r.text)
        assert r.json() == {"error": {"message": message, "type": kind, "param": param, "code": status}}, name
        assert ("retry-after" in r.headers) == (status == 503), name
    assert FieldError("steps", "x").renamed("n").field == "n" and str(FieldError("a", "b")) == "a: b"
