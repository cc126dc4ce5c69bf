"""One request's output: scheduler TokenEvents into GenerateResponses (detokenize, trim stops, stop strings)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.proto.meshserve.v1 import generation_pb2, sampling_pb2, scheduler_pb2
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.stop_strings import StopStringMatcher
from services.gateway.tokenizer import TextTokenizer

# The scheduler decides why a request stopped; these kinds mean the last token is a stop (EOS or a
# stop token id): it is returned in token_ids, but its text is not part of the answer.
_TRIMMED_STOP_KINDS = (scheduler_pb2.STOP_KIND_EOS, scheduler_pb2.STOP_KIND_STOP_TOKEN)


@dataclass
class Output:
    """One response to send, and what it means for the request."""

    response: generation_pb2.GenerateResponse
    # The request is over (the response carries finish_reason and usage).
    final: bool
    # A stop string ended it here, so the scheduler must be told to stop generating.
    stopped_by_string: bool = False


class OutputProcessor:
    """Turns one request's token events into responses, in order; one instance per request."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        prompt_token_ids: Sequence[int],
        sampling: sampling_pb2.SamplingParams,
        index: int = 0,
    ) -> None:
        skip_special = sampling.skip_special_tokens if sampling.HasField("skip_special_tokens") else True
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=skip_special)
        self._stops = StopStringMatcher(list(sampling.stop))
        # As in vLLM, stop strings match only in text generated after the first min_tokens tokens.
        self._min_tokens = sampling.min_tokens
        self._index = index
        self.usage = generation_pb2.Usage(prompt_tokens=len(prompt_token_ids))

    def process(self, event: scheduler_pb2.TokenEvent) -> Output:
        """The response for the request's next token event."""
        ids = list(event.token_ids)
        self.usage.completion_tokens += len(ids)
        self.usage.cached_tokens = max(self.usage.cached_tokens, event.num_cached_tokens)
        final = event.finish_reason != sampling_pb2.FINISH_REASON_UNSPECIFIED
        text_ids, stop_reason = ids, ""
        if final and ids and event.stop_kind in _TRIMMED_STOP_KINDS:
            text_ids = ids[:-1]
            if event.stop_kind == scheduler_pb2.STOP_KIND_STOP_TOKEN:
                stop_reason = str(event.stop_token_id if event.HasField("stop_token_id") else ids[-1])
        delta = self._detok.add(text_ids)
        if final:
            # Text held back for an unfinished multi-byte character is due now.
            delta += self._detok.flush()
        emit, matched = self._stops.feed(delta, may_stop=self.usage.completion_tokens > self._min_tokens)
        response = generation_pb2.GenerateResponse(
            text=emit, token_ids=ids, logprobs=event.logprobs, top_logprobs=event.top_logprobs, index=self._index
        )
        if matched is not None:
            response.finish_reason = sampling_pb2.FINISH_REASON_STOP
            response.stop_reason = matched
        elif final:
            response.text += self._stops.flush()
            response.finish_reason = event.finish_reason
            response.stop_reason = stop_reason
        done = matched is not None or final
        if done:
            response.usage.CopyFrom(self.usage)
        return Output(response, done, stopped_by_string=matched is not None and not final)
