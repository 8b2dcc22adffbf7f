"""server: the dlrl generation server (FastAPI + a continuous-batching block-diffusion engine).

    dlrl serve --config configs/tiny.yaml [server.host=H server.port=P server.max_batch=32 ...]  # --host/--port: aliases

Sub-packages (imports run downwards only; cli.py sits on top):

    api/        HTTP layer: app, routes_*, openai_api, generation, prompts, gate (refusals before the body),
                middleware, errors, auth, quotas, executors (bounded thread pools), likelihood, connections,
                state, lifecycle (graceful SIGTERM), openapi
    engine/     engine core: Engine (schedule -> run -> postprocess), Scheduler (owns every ServerSequence,
                its KV pages, post-processing), sequence.py, retry_after.py, backends/ (the Runner Protocol, native runner)
    weights/    the weight receiver's glue: weight_updates (apply through Engine.apply_update), weight_versions
    recording/  recording (samples -> feedback store), store_health

and config.py (ServerConfig), metrics.py, logs.py, cli.py (`dlrl serve`). Schemas live in
rollout_client.protocol.
"""
