"""Structured logging: one JSON object per line, with service name and any `extra=` fields (or, for
humans, a text line with those fields appended as key=value)."""

from __future__ import annotations

import logging
import sys
import time

import orjson

_STANDARD = set(vars(logging.LogRecord("", logging.INFO, "", 0, "", (), None)).keys()) | {"message", "asctime"}
_reserved: dict[object, frozenset[str]] = {}  # record factory -> the attributes its records carry without extra=


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        payload = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        payload.update(_fields(record))
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(payload, default=str).decode()


def _fields(record: logging.LogRecord) -> dict[str, object]:
    """The `extra=` fields a record carries. A library may install a record factory that adds attributes to
    every record (vLLM's adds `vllm_process_name` once an engine configures logging): those are not fields."""
    factory = logging.getLogRecordFactory()
    reserved = _reserved.get(factory)
    if reserved is None:
        reserved = _reserved[factory] = frozenset(
            _STANDARD | vars(factory("", logging.INFO, "", 0, "", (), None)).keys()
        )
    return {k: v for k, v in record.__dict__.items() if k not in reserved}


class TextFormatter(logging.Formatter):
    """`time service LEVEL logger: message key=value …`: the same fields as the JSON lines."""

    def __init__(self, service: str) -> None:
        super().__init__(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = {k: v for k, v in _fields(record).items() if k != "color_message"}  # uvicorn's coloured copy
        if not fields:
            return line
        head, sep, tail = line.partition("\n")  # a traceback stays below the fields
        extra = " ".join(
            f"{k}={orjson.dumps(v, default=str).decode() if not isinstance(v, str) else v}" for k, v in fields.items()
        )
        return f"{head} {extra}{sep}{tail}"


def configure_logging(service: str, level: str = "INFO", json: bool = True) -> None:
    """Route the root logger to stderr, as JSON lines (production) or plain text (humans)."""
    handler = logging.StreamHandler(sys.stderr)
    if json:
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(TextFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # one INFO line per HTTP request (every tool call of every agent) drowns what the service says
    if logging.getLevelName(level.upper()) == logging.INFO:
        logging.getLogger("httpx").setLevel(logging.WARNING)
