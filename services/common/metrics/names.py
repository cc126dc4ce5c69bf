"""Metric naming, decided once: our prefix, vLLM's, and which of our metrics have a vLLM counterpart."""

from __future__ import annotations

# Documented in docs/metrics.md; a dashboard query for these names finds them (see exposition.py for why
# the `:` survives a scrape).
PREFIX = "meshserve:"
# `--metrics-vllm-alias` copies the metrics below under this prefix, so vLLM dashboards and the Gateway API
# Inference Extension read us unchanged.
VLLM_PREFIX = "vllm:"
# The label every request and engine series carries, as vLLM's do.
MODEL_NAME_LABEL = "model_name"

# Our names (without the prefix) that mean what vLLM's metric of the same name means.
VLLM_COUNTERPARTS = frozenset(
    {
        # gateway: what a client sees
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_success",
        "prompt_tokens",
        "generation_tokens",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_params_n",
        "request_params_max_tokens",
        # scheduler: queue, batch, KV blocks
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "iteration_tokens_total",
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
    }
)


def metric(name: str) -> str:
    """The full name of one of our metrics."""
    return PREFIX + name


def status_code_label(code_name: str) -> str:
    """A gRPC status as Go spells it (`INVALID_ARGUMENT` -> `InvalidArgument`, `CANCELLED` -> `Canceled`),
    the spelling go-grpc-prometheus' `grpc_code` label and every gRPC dashboard use."""
    if code_name == "OK":
        return "OK"
    if code_name == "CANCELLED":
        return "Canceled"
    return "".join(part.capitalize() for part in code_name.split("_"))
