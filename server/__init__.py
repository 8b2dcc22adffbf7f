"""server: the dlrl generation server (FastAPI + a continuous-batching block-diffusion engine).

    dlrl serve --config configs/tiny.yaml [server.host=H server.port=P server.max_batch=32 ...]  # --host/--port: aliases

Files: config.py (ServerConfig), engine.py + scheduler.py (continuous batching in a
background thread), backends/ (native dllm decoder; LMDeploy placeholder), app.py
(create_app), routes_generate.py / routes_service.py (thin routes), generation.py and
openai_api.py (request handling; top-k logprobs are the backend's, by dllm.replay),
openapi.py (the truthful OpenAPI document), middleware.py (body limit, drain 503),
lifecycle.py (graceful SIGTERM), errors.py, metrics.py, auth.py (admin bearer token),
cli.py (`dlrl serve`). Schemas live in rollout_client.protocol.
"""
