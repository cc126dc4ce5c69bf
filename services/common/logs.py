"""structlog configuration: JSON off a terminal, console on one, request ids from contextvars.

Every line about one request carries `request_id` and `trace_id` (the W3C trace id its traceparent names,
services/common/tracing.py), in every service: grep either across the gateway's, the scheduler's and the
workers' logs to follow it. The gateway binds both in contextvars (one task per request); the scheduler and
the worker, where one stream or step carries many requests, pass them on each line.
"""

from __future__ import annotations

import logging
import sys

import structlog

REQUEST_ID_KEY = "request_id"
TRACE_ID_KEY = "trace_id"


def configure_logging(service: str, level: str = "info", fmt: str = "auto") -> None:
    """Route structlog (and stdlib logging) to stderr with the service name on every line."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    )
    numeric = logging.getLevelNamesMapping()[level.upper()]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service)
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr)
