"""ServerState: everything a dlrl server's handlers reach, one typed object on the app.

    state = ServerState(client, config, admin_token=token, metrics=ServerMetrics())   # server.api.app
    attach(app, state)
    st = server_state(request.app)          # in a handler or a middleware (scope["app"])
    st.engine, st.config, st.metrics, st.prompts, st.recorder, st.weight_updates, st.is_draining
    # st.engine: the engine as the handlers reach it, server.core.client.CoreClient (the core may be another process)
    st.executors, st.refusals

`server.api.app.create_app` builds the whole state; an app made of the weight routes alone (tests
and benchmarks) attaches a ServerState of an in-process Engine and its own WeightUpdates (the routes
only use `weight_updates`) with the rest left at the defaults: the
default config, admin disabled unless `admin_token` is given, metrics of its own registry, no
recorder, the weight-update glue and the tokenizer worker built on first use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from starlette.applications import Starlette

from server.api.executors import Executors
from server.api.prompts import PromptEncoder
from server.config import ServerConfig
from server.metrics import ServerMetrics

if TYPE_CHECKING:
    from server.api.auth_guard import AuthGuard
    from server.api.connections import Refusals
    from server.core.client import CoreClient
    from server.core.thread import CoreThread
    from server.recording.recording import Recorder
    from server.weights.control import WeightControl


@dataclass(eq=False)
class ServerState:
    engine: CoreClient
    config: ServerConfig = field(default_factory=ServerConfig)
    admin_token: str = ""  # "" = admin endpoints disabled (server.api.auth)
    feedback_token: str = ""  # "" = POST /v1/feedback disabled (server.api.routes_feedback)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    recorder: Recorder | None = None  # server.recording.recording, None without server.store
    weight_updates: WeightControl | None = None  # the routes' weight-update glue (server.api.routes_weights)
    auth_guard: AuthGuard | None = None  # server.api.auth.auth_guard builds it on first use
    is_draining: bool = False  # set by server.api.lifecycle.drain; read by server.api.middleware.RequestGuard
    num_inflight: int = 0  # generation requests until their last byte is sent (server.api.middleware)
    refusals: Refusals | None = None  # server.api.connections.Refusals (the gate's): refusals counted, logged once per interval
    core_thread: CoreThread | None = None  # the engine core when it runs on a thread of this process (server.core.thread)

    @cached_property
    def executors(self) -> Executors:
        """The bounded thread pools of store I/O, weight work and the rest (server.api.executors), on first use."""
        return Executors.from_config(self.config)

    @cached_property
    def prompts(self) -> PromptEncoder:
        """The handlers' tokenizer worker (server.api.prompts), built on first use: an app of the
        weight routes alone (tests, benchmarks: an engine without a tokenizer) never needs one."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:  # the engine client loads it when it connects (the app's startup)
            raise RuntimeError("no tokenizer yet: the engine client is not connected")
        return PromptEncoder(tokenizer, self.engine.max_model_len)


def attach(app: Starlette, state: ServerState) -> ServerState:
    """Make `state` the one state of `app` (read back with `server_state`)."""
    app.state.server = state
    return state


def server_state(app: Starlette) -> ServerState:
    """The ServerState attached to `app` (a `Request.app`, or `scope["app"]` in a middleware)."""
    state = getattr(app.state, "server", None)
    if not isinstance(state, ServerState):
        raise RuntimeError("this app has no ServerState: build it with server.api.app.create_app, or "
                           "server.api.state.attach(app, ServerState(engine, ...))")
    return state


__all__ = ["ServerState", "attach", "server_state"]
