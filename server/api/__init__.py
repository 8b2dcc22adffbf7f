"""server.api: the HTTP layer: the FastAPI app, its routes (native, OpenAI, service, weights admin, feedback),
request handling (generation, prompts), middleware, errors, auth, quotas, connection limits, the
typed ServerState handlers reach, graceful shutdown.
"""
