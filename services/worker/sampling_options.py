"""One request's SamplingParams as the sampler reads them, resolved once when the worker first sees it.

Reading proto fields (HasField, defaults) for every row of every step costs more than the attribute reads of
a frozen dataclass, and most of these values only decide which rows join which vectorised stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.proto.meshserve.v1 import sampling_pb2
from services.common.sampling_checks import is_greedy


@dataclass(frozen=True)
class SamplingOptions:
    """Resolved sampling settings of one request; "off" values are the neutral ones (1.0 or 0)."""

    greedy: bool
    temperature: float
    # 0: off.
    top_k: int
    # 1.0: off.
    top_p: float
    # 0: off.
    min_p: float
    seed: int | None
    logprobs: bool
    # 0 unless logprobs is set too.
    top_logprobs: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    min_tokens: int
    # EOS ids and stop_token_ids (deduplicated): masked while fewer than min_tokens outputs exist.
    min_tokens_ids: tuple[int, ...]
    bias_ids: tuple[int, ...]
    bias_values: tuple[float, ...]
    # Any of the three penalties is on: the row needs token counts of its history.
    penalised: bool

    @classmethod
    def from_params(cls, params: sampling_pb2.SamplingParams, eos_token_ids: Sequence[int] = ()) -> SamplingOptions:
        """Resolve params; eos_token_ids are the model's EOS ids the scheduler sent (empty under ignore_eos)."""
        repetition = params.repetition_penalty if params.HasField("repetition_penalty") else 1.0
        frequency = params.frequency_penalty if params.HasField("frequency_penalty") else 0.0
        presence = params.presence_penalty if params.HasField("presence_penalty") else 0.0
        top_k = params.top_k if params.HasField("top_k") else 0
        bias = sorted(params.logit_bias.items())
        return cls(
            greedy=is_greedy(params),
            temperature=params.temperature if params.HasField("temperature") else 1.0,
            top_k=max(top_k, 0),
            top_p=params.top_p if params.HasField("top_p") else 1.0,
            min_p=params.min_p if params.HasField("min_p") else 0.0,
            seed=params.seed if params.HasField("seed") else None,
            logprobs=params.logprobs,
            top_logprobs=params.top_logprobs if params.logprobs else 0,
            repetition_penalty=repetition,
            frequency_penalty=frequency,
            presence_penalty=presence,
            min_tokens=params.min_tokens if params.HasField("min_tokens") else 0,
            min_tokens_ids=tuple(dict.fromkeys([*eos_token_ids, *params.stop_token_ids])),
            bias_ids=tuple(token for token, _ in bias),
            bias_values=tuple(value for _, value in bias),
            penalised=repetition != 1.0 or frequency != 0.0 or presence != 0.0,
        )
