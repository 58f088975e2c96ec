"""Structured logging for the server: one JSON object per line (``ts``, ``level``, ``event``
and the event's fields), so logs can be grepped, shipped and parsed without guessing."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

LOGGER_NAME = "fctkit.server"
_FIELDS = "fctkit_fields"


class JsonLinesFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        entry.update(getattr(record, _FIELDS, {}))
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def configure_logging(level: str = "info", stream: TextIO | None = None) -> logging.Logger:
    """Send the server's log to ``stream`` (stderr by default) as JSON lines."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers.clear()
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonLinesFormatter())
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
    return logger


def log_event(event: str, level: int = logging.INFO, exc_info: bool = False, **fields: Any) -> None:
    """Log ``event`` with ``fields`` as one JSON line."""
    logging.getLogger(LOGGER_NAME).log(level, event, extra={_FIELDS: fields}, exc_info=exc_info)
