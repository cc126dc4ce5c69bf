"""What the scheduler says about each request: one info line per event of its life, and its phase spans.

A gateway's Stream carries many requests, so nothing here relies on contextvars: every line names its
request_id and trace_id itself. Lines: submitted (routed to a worker), refused (admission said no),
requeued (moved off a lost or draining worker), finished, aborted, failed. Nothing runs per token: a
request costs a line when it is routed and one when it ends.

Spans (only with --otlp-endpoint): `queue` (arrival to first scheduled), `prefill` (first scheduled to
first token) and `decode` (first token to the end), children of the caller's span (the gateway's
`generate`), built when the request ends from the monotonic times it already records.
"""

from __future__ import annotations

import time

import structlog

from services.common.proto.meshserve.v1 import sampling_pb2, scheduler_pb2
from services.common.tracing import Attributes, Tracing, trace_id_of
from services.scheduler.request import Request
from services.scheduler.submissions import Failure, Submission

log = structlog.get_logger()


def _seconds(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(max(0.0, end - start), 6)


class RequestLog:
    """The scheduler's per-request log lines and spans (one per scheduler, held by the Cluster)."""

    def __init__(self, tracing: Tracing | None = None) -> None:
        self.tracing = tracing or Tracing("scheduler")

    def submitted(self, request: Request) -> None:
        """Admitted and placed on its worker's queue (worker None: parked until one attaches)."""
        log.info(
            "submitted",
            request_id=request.request_id,
            trace_id=request.trace_id,
            prompt_tokens=request.num_prompt_tokens,
            max_tokens=request.max_tokens,
            worker=request.worker_id or None,
        )

    def refused(self, submit: scheduler_pb2.SubmitRequest, failure: Failure) -> None:
        """Admission refused it (its caller gets the failure; nothing was queued)."""
        log.info(
            "refused",
            request_id=submit.request_id,
            trace_id=trace_id_of(submit.traceparent),
            code=failure.code.name,
            reason=failure.reason or None,
            why=failure.message,
        )

    def requeued(self, request: Request, from_worker: str, why: str) -> None:
        """Moved off a worker that was lost or is leaving: onto another's queue, or parked (worker "")."""
        log.info(
            "requeued",
            request_id=request.request_id,
            trace_id=request.trace_id,
            from_worker=from_worker or None,
            worker=request.worker_id or None,
            output_tokens=request.num_output_tokens,
            why=why,
        )

    def finished(self, sub: Submission, finish_reason: sampling_pb2.FinishReason.ValueType, now: float) -> None:
        """Ended by its stop rule (EOS, stop token, length)."""
        request = sub.request
        reason = sampling_pb2.FinishReason.Name(finish_reason)
        scheduled = request.first_scheduled_at
        log.info(
            "finished",
            request_id=request.request_id,
            trace_id=request.trace_id,
            finish_reason=reason,
            completion_tokens=request.num_output_tokens,
            cached_tokens=request.num_cached_tokens,
            worker=request.worker_id,
            preemptions=request.num_preemptions,
            queue_s=_seconds(request.arrival_time, scheduled),
            prefill_s=_seconds(scheduled, sub.first_token_at),
            decode_s=_seconds(sub.first_token_at, now),
        )
        self._spans(sub, now, reason)

    def aborted(self, sub: Submission | None, request_id: str) -> None:
        """Taken out before it finished: its caller went away, a stop string matched, or Abort was called."""
        if sub is None:
            log.info("aborted", request_id=request_id)
            return
        request = sub.request
        log.info(
            "aborted",
            request_id=request_id,
            trace_id=request.trace_id,
            completion_tokens=request.num_output_tokens,
            worker=request.worker_id or None,
        )
        self._spans(sub, time.monotonic(), "FINISH_REASON_ABORT")

    def failed(self, sub: Submission, failure: Failure) -> None:
        """Ended with an error status (a deadline, no worker for it, or the worker failed it)."""
        request = sub.request
        log.info(
            "failed",
            request_id=request.request_id,
            trace_id=request.trace_id,
            code=failure.code.name,
            reason=failure.reason or None,
            why=failure.message,
            worker=request.worker_id or None,
        )
        self._spans(sub, time.monotonic(), None, error=f"{failure.code.name}: {failure.message}")

    def _spans(self, sub: Submission, end: float, finish_reason: str | None, error: str | None = None) -> None:
        """The request's phases as spans, up to the one it ended in (which carries the error, if any)."""
        tracing = self.tracing
        if not tracing.enabled:
            return
        request = sub.request
        parent = request.trace
        common: dict[str, str | int] = {"meshserve.request_id": request.request_id}
        if request.worker_id:
            common["meshserve.worker_id"] = request.worker_id
        scheduled, first_token = request.first_scheduled_at, sub.first_token_at
        queue: Attributes = {**common, "gen_ai.usage.input_tokens": request.num_prompt_tokens}
        if scheduled is None:
            tracing.record_span("queue", parent, request.arrival_time, end, queue, error)
            return
        tracing.record_span("queue", parent, request.arrival_time, scheduled, queue)
        prefill: Attributes = {
            **common,
            "gen_ai.usage.input_tokens": request.num_prompt_tokens,
            "meshserve.cached_tokens": request.num_cached_tokens,
        }
        if first_token is None:
            tracing.record_span("prefill", parent, scheduled, end, prefill, error)
            return
        tracing.record_span("prefill", parent, scheduled, first_token, prefill)
        decode: dict[str, str | int | list[str]] = {
            **common,
            "gen_ai.usage.output_tokens": request.num_output_tokens,
            "meshserve.preemptions": request.num_preemptions,
        }
        if finish_reason is not None:
            decode["gen_ai.response.finish_reasons"] = [finish_reason]
        tracing.record_span("decode", parent, first_token, end, decode, error)
