"""Histogram buckets, vLLM's where vLLM has the metric, so quantiles over both line up."""

from __future__ import annotations

# vllm:time_to_first_token_seconds
TIME_TO_FIRST_TOKEN = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# vllm:time_per_output_token_seconds and vllm:inter_token_latency_seconds
TOKEN_INTERVAL = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# vllm:e2e_request_latency_seconds, request_queue/inference/prefill/decode_time_seconds
REQUEST_LATENCY = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip
# vllm:iteration_tokens_total
ITERATION_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vllm:request_params_n
PARAMS_N = (1, 2, 5, 10, 20)
# The worker's step time: a CPU step is 10-300 ms, an accelerator's 5-50 ms, a long prefill seconds.
STEP_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Requests in one step (up to --max-num-seqs, 256 by default in vLLM).
BATCH_SIZE = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512, 1024)
# gRPC handling time: a health check is sub-millisecond, a generation stream minutes.
GRPC_HANDLING = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def one_two_five(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for token counts (build_1_2_5_buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(value)
        exponent += 1
