"""Structured logs: `server.log_format: json` writes one JSON object per line on stderr.

    use_json_logs()        # server.api.app does it for log_format=json (and align/train for theirs)
    log.info("request", extra={"request_id": rid, "version": 3, "duration_s": 0.12})
    -> {"ts": "2026-11-26T01:02:03.456Z", "level": "info", "logger": "dlrl.request",
        "message": "request", "request_id": "...", "version": 3, "duration_s": 0.12}

Every handler of the root logger gets the JSON formatter (a handler is added when there is none);
fields passed with `extra=` become keys of the event. uvicorn's own loggers propagate to the root
in this mode (server.cli passes `log_config=None`), so its lines are JSON too.
"""

from __future__ import annotations

import json
import logging
import time

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        event = {"ts": ts, "level": record.levelname.lower(), "logger": record.name,
                 "message": record.getMessage()}
        event.update({k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")})
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        return json.dumps(event, default=str)


def use_json_logs(level: int | str | None = None) -> None:
    """Switch the process to JSON-lines logging (idempotent)."""
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler())
    for handler in root.handlers:
        handler.setFormatter(JsonFormatter())
    if level is not None:
        root.setLevel(level.upper() if isinstance(level, str) else level)
