"""The OpenAPI document tells the truth: schemathesis fuzzes every route of a real server.

Every check runs (no 5xx, documented status codes, content types and headers, response
bodies matching their schemas, schema-invalid requests rejected, schema-valid requests
accepted, auth enforced). A schema-valid request may still be answered 413 ("does not fit
this server": the token count of a text, prompt + max_tokens and prompts x n depend on the
tokenizer and the server's limits, which no JSON schema can state), so 413 joins the
statuses a valid request may get, and so does 408 (a request's own `timeout` passed: how long
a request takes is not in its schema either); everything else a schema allows must be accepted.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from server.api.state import server_state
from server.metrics import CONTENT_TYPE

CONFIG = """
[generation]
max-examples = 12
[checks]
max_response_time = 120
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "401", "403", "404", "408", "409", "413", "429"]
[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "413"]
"""


@pytest.fixture(scope="module")
def fuzz_server(make_server):
    """Its own server with small limits (cheap generations); its admin token is never given to the fuzzer.
    One torch thread while it runs: on a shared 2-core box two spinning OpenMP threads per
    forward make the ~1000 requests many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield make_server(max_batch=16, max_queue=16, max_model_len=24, admin_token="not-for-the-fuzzer")
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_schemathesis_finds_no_failure(fuzz_server, tmp_path):
    """`schemathesis run --checks all` (examples, coverage and fuzzing phases, 12 examples per
    operation, fixed seed) against the live server reports no failure of any check."""
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    cli = Path(sys.executable).with_name("schemathesis")
    cmd = [str(cli), "--config-file", str(config), "run", fuzz_server.url + "/openapi.json", "--checks", "all",
           "--phases", "examples,coverage,fuzzing", "--workers", "1", "--seed", "20240613",
           "--request-timeout", "120", "--no-color"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    report = out.stdout + out.stderr
    assert out.returncode == 0 and "Failures:" not in report, report[-20000:]
    assert " passed" in report.split("SUMMARY")[-1]


def test_document_states_statuses_limits_and_types(fuzz_server):
    doc = httpx.get(fuzz_server.url + "/openapi.json").json()
    paths = doc["paths"]
    for path, ops in paths.items():
        for op in ops.values():
            assert "422" not in op["responses"], path
            if "requestBody" in op:
                assert {"400", "413"} <= set(op["responses"]), path
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        assert {"200", "400", "404", "408", "413", "429", "503"} <= set(paths[path]["post"]["responses"])
    for path in ("/admin/pause", "/weights/begin", "/weights/commit"):
        responses = paths[path]["post"]["responses"]
        assert {"401", "403"} <= set(responses) and paths[path]["post"]["security"] == [{"bearerAuth": []}]
        assert responses["401"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "409" in paths["/weights/begin"]["post"]["responses"]
    assert "503" in paths["/ready"]["get"]["responses"]
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == [CONTENT_TYPE]
    assert httpx.get(fuzz_server.url + "/metrics").headers["content-type"] == CONTENT_TYPE
    assert "text/event-stream" in paths["/v1/completions"]["post"]["responses"]["200"]["content"]
    models = doc["components"]["schemas"]
    gen = models["GenerateRequest"]
    assert len(gen["oneOf"]) == 2 and gen["additionalProperties"] is False  # exactly one of prompt / prompt_ids
    ids = gen["properties"]["prompt_ids"]["anyOf"][0]
    engine = fuzz_server.engine
    assert ids["minItems"] == 1 and ids["maxItems"] == engine.max_model_len - 1
    assert ids["items"]["maximum"] == engine.backend.vocab_size - 1
    assert ids["items"]["not"] == {"enum": [engine.backend.mask_token_id]}
    text = gen["properties"]["prompt"]["anyOf"][0]
    assert text["minLength"] == 1 and text["maxLength"] == server_state(fuzz_server.app).prompts.max_chars
    steps = [s for s in gen["properties"]["steps"]["anyOf"] if s.get("type") == "integer"][0]
    assert steps["maximum"] == engine.backend.block_size
    temperature = gen["properties"]["temperature"]["anyOf"]
    assert {"type": "null"} in temperature  # null = the default
    assert "not" in models["CompletionRequest"]  # echo + logprobs is refused
