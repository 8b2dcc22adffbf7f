"""`POST /v1/feedback`: a user's reward for a recorded sample (bearer FEEDBACK token, issue 19).

    curl -s localhost:8000/v1/feedback -H "Authorization: Bearer $DLRL_FEEDBACK_TOKEN" \
         -d '{"id": "rec-3f...", "reward": 1.0}'          # or {"id": ..., "label": "accept"}
    -> {"id": "rec-3f...", "reward": 1.0, "duplicate": false}

The feedback token (`server.feedback_token`, else env `DLRL_FEEDBACK_TOKEN`) is not the admin
token and the admin token is not accepted here: a feedback client can attach one reward to
a record whose id it was given, nothing else. No token configured: the route is disabled
(403). Statuses: 200 (also for the same feedback again: `duplicate: true`), 400 bad body or
unknown label, 401 missing token, 403 wrong token or disabled, 404 unknown record id, 409 a
different reward for a record that already has one, 503 the store is unavailable.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Depends, Request

from rollout_client.protocol.feedback import FeedbackRequest, FeedbackResponse
from rollout_client.protocol.service import ErrorResponse
from server.api.auth import check_bearer
from server.api.errors import APIError
from server.api.openapi import error_responses
from server.api.state import server_state
from server.config import FEEDBACK_ENV_VAR
from store import FeedbackConflict, error_cause

log = logging.getLogger("dlrl.server")


async def require_feedback(request: Request) -> None:
    """FastAPI dependency: 403 disabled (no feedback token), 401 missing, 403 wrong token, 429 throttled."""
    check_bearer(server_state(request.app).feedback_token, request.headers.get("authorization"), what="feedback",
                 disabled_hint=f"set server.feedback_token or {FEEDBACK_ENV_VAR}", request=request)


router = APIRouter(tags=["feedback"], dependencies=[Depends(require_feedback)])


# FastAPI's `responses=` type: OpenAPI JSON per status
RESPONSES: dict[int | str, dict[str, Any]] = {**error_responses(400, 413, 503),
             **{code: {"model": ErrorResponse, "description": text} for code, text in (
                 (403, "Wrong feedback token (the admin token is not one), or feedback disabled on this server "
                       "(no feedback token configured)"),
                 (404, "No recorded sample with this id (never recorded, or pruned)"),
                 (409, "This record already has a different reward"))}}


@router.post("/v1/feedback", response_model=FeedbackResponse, responses=RESPONSES)
async def feedback(body: FeedbackRequest, request: Request) -> FeedbackResponse:
    st = server_state(request.app)
    recorder = st.recorder
    if recorder is None:  # create_app opens the store whenever a feedback token is set (server.recording.recording)
        raise APIError(503, "feedback store unavailable (no server.store open); retry later")
    if body.label is not None:
        labels = st.config.feedback_labels
        if body.label not in labels:
            raise APIError(400, f"label: {body.label!r} is not one of {sorted(labels)}", "label")
        reward = float(labels[body.label])
    else:
        assert body.reward is not None  # FeedbackRequest: exactly one of reward and label
        reward = float(body.reward)
    try:
        is_new = await st.executors.run_store(recorder.add_feedback, body.id, reward, body.label)  # its own pool
    except KeyError:
        raise APIError(404, f"id: no recorded sample {body.id!r} (never recorded, or pruned)", "id") from None
    except FeedbackConflict as e:
        raise APIError(409, f"reward: {e}", "reward") from None
    except Exception as e:  # the store itself failed (disk, database down): counted and logged by the recorder
        raise APIError(503, f"feedback store unavailable ({error_cause(e)}); retry later") from None
    if is_new:
        st.metrics.feedback.inc()
    return FeedbackResponse(id=body.id, reward=reward, duplicate=not is_new)
