"""BackendUnavailable, torch-free: `dlrl serve`'s supervisor checks the backend (server.engine.backends.check_backend)
before any model is loaded, in a process that never imports torch."""

from __future__ import annotations


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here (missing package, no GPU, ...)."""
