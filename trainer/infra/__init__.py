"""What a run stands on: ranks (dist), the DeepSpeed engine, checkpoints, the rollout servers
(fleet, local servers, the publisher of weights), the fault hook, the run guards."""
