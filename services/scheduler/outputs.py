"""A step's results become TokenEvents for their callers, the request phases' metrics, and each ended
request's log line and spans."""

from __future__ import annotations

import time

import grpc

from services.common.errors import Reason
from services.common.proto.meshserve.v1 import scheduler_pb2
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.request_log import RequestLog
from services.scheduler.submissions import Failure, Submission
from services.scheduler.worker_scheduler import RequestOutput


class OutputProcessor:
    """Sends each request's new tokens (and its end) to its caller's sink, counting what finished."""

    def __init__(self, metrics: SchedulerMetrics, request_log: RequestLog | None = None) -> None:
        self.metrics = metrics
        self.request_log = request_log or RequestLog()
        self.num_finished = 0

    def process(self, outputs: list[RequestOutput], submissions: dict[str, Submission]) -> None:
        now = time.monotonic()
        for out in outputs:
            sub = submissions.get(out.request.request_id)
            if sub is None or sub.finished:
                continue
            if out.error is not None:
                sub.finished = True
                if out.error_field:
                    failure = Failure(
                        grpc.StatusCode.INVALID_ARGUMENT, f"{out.error_field}: {out.error}", out.error_field, out.error
                    )
                else:
                    failure = Failure(
                        grpc.StatusCode.INTERNAL, f"the worker failed: {out.error}", reason=Reason.WORKER_FAILED
                    )
                self.request_log.failed(sub, failure)
                sub.send(failure)
                continue
            sub.send(self._event(sub, out, now))

    def _event(self, sub: Submission, out: RequestOutput, now: float) -> scheduler_pb2.TokenEvent:
        req = out.request
        event = scheduler_pb2.TokenEvent(token_ids=out.new_token_ids)
        if req.sampling.logprobs:
            event.logprobs.extend(out.new_logprobs)
            event.top_logprobs.extend(out.new_top_logprobs)
        if sub.first_token_at is None and out.new_token_ids:
            sub.first_token_at = now
            event.num_cached_tokens = req.num_cached_tokens
        if out.finish_reason is not None:
            event.finish_reason = out.finish_reason.finish_reason()
            event.stop_kind = req.stop_kind
            if req.stop_token_id is not None:
                event.stop_token_id = req.stop_token_id
            sub.finished = True
            self.finished()
            self.metrics.request_phases(req, sub.first_token_at, now)
            self.request_log.finished(sub, event.finish_reason, now)
        return event

    def finished(self) -> None:
        """Count one request that ended with a finish reason (aborts included), for GetStats."""
        self.num_finished += 1
