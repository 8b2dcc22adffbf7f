"""GET /metrics of a prometheus registry on a port of its own: the base of the trainer's metrics
(trainer.monitor.train_metrics.TrainMetrics) and the align controller's (trainer.align.metrics.AlignMetrics).

    class TrainMetrics(MetricsEndpoint): ...   # sets self.registry, declares its metrics on it
    m.serve("127.0.0.1", 9300)                 # a thread; ValueError naming `port_key` when it cannot listen
    m.render()                                 # the exposition text, as GET /metrics answers it

Importing it turns off the `*_created` series for the whole process (as server/metrics.py does in a server).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest, start_http_server

disable_created_metrics()  # no `*_created` series: process-wide, for every trainer registry


class MetricsEndpoint:
    """GET /metrics of `self.registry` on a port of its own (the trainer's and the align controller's)."""

    registry: CollectorRegistry
    _server: Any = None
    port_key = "train.metrics_port"  # the config key named when the port cannot be served

    def serve(self, host: str, port: int) -> None:
        """Serve GET /metrics on host:port (a thread); ValueError naming `port_key` when it cannot listen."""
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise ValueError(f"{self.port_key}: cannot serve metrics on {host}:{port}: {e}") from None

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None
