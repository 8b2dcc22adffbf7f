"""server.engine.engine: the engine core: Engine (schedule -> run -> postprocess in one thread), the Scheduler that owns
every sequence (ServerSequence: status, timings, deadline, KV pages), the runners (backends/).
"""
