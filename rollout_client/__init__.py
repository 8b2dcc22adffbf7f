"""rollout_client: async HTTP client of the dlrl generation API, plus its wire schemas.

No torch here: trainers and tools import it without the model stack.

    from rollout_client import RolloutClient
    rollouts = await RolloutClient(["http://127.0.0.1:8000"]).generate(["1+1="], n=4)

See `rollout_client.client` for an end-to-end example and `rollout_client.protocol`
for every request/response schema.
"""

from dllm.trace import Trace
from rollout_client.client import RolloutClient, RolloutError
from rollout_client.protocol.native import GenerateRequest, GenerateResponse, Sample
from rollout_client.protocol.rollout import Rollout

__all__ = ["RolloutClient", "RolloutError", "GenerateRequest", "GenerateResponse", "Rollout", "Sample",
           "Trace"]
