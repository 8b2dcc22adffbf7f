"""Wire schemas of the generation API (pydantic v2, no torch): defined once, used by both sides.

The server (`server/`) validates requests and builds responses with these models (and
publishes them in its OpenAPI document); the `RolloutClient` parses responses with them.
One module per API:

    common     field types, request rules, DecodingOptions, Usage, limits
    native     POST /generate: GenerateRequest -> GenerateResponse (Samples with their Trace)
    openai     POST /v1/completions, GET /v1/models (and OpenAIBase, shared with chat)
    chat       POST /v1/chat/completions (messages, responses, stream chunks)
    feedback   POST /v1/feedback
    service    /health, pause/status, and ErrorResponse (the error body of every endpoint)
    sample     Generated (a sample's fields, declared once) and SampleExtras (those of an OpenAI choice)
    rollout    Rollout: a sample as the trainer sees it

    from rollout_client.protocol.native import GenerateRequest
    GenerateRequest(prompt=["1+2=", "3+4="], n=4, max_tokens=16, strategy="dynamic", seed=0)

The decoding trace is `dllm.trace.Trace` and the strategy `dllm.strategy.Strategy` (both torch-free).
"""
