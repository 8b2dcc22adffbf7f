"""server.weights: the weight receiver's glue: in-place updates (stage, verify, apply through Engine.apply_update)
and the kept versions for rollback.
"""
