"""The sampling surface and structured outputs end to end: real processes (scheduler, workers, gateway with its
OpenAI HTTP front) on the tiny random Llama, every answer checked against a reference computed here (transformers
fp32 logits, transformers' own logits processors, `json` + `jsonschema`, `re.fullmatch`)."""

from __future__ import annotations

import asyncio
import functools
import json
import random
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest
import torch
from openai import AsyncOpenAI

from services.client.client import GenerationClient, build_request, sampling_params
from services.common.errors import field_violations
from services.common.ports import free_port
from services.common.proto.meshserve.v1 import generation_pb2, sampling_pb2
from tests.support.calls import expect_invalid, stream
from tests.support.suite import Suite, start_suite
from tests.support.tiny_model import transformers_greedy

VOCAB = 512
BLOCK_SIZE = 16  # the worker's default off NPU (--block-size unset)
MAX_MODEL_LEN = 768  # below the tiny model's 1024 positions, so the flag (not the model) sets the limit
WORKER_ARGS = ["--kv-cache-memory", "64MiB", "--max-model-len", str(MAX_MODEL_LEN)]
STOP = sampling_pb2.FINISH_REASON_STOP
LENGTH = sampling_pb2.FINISH_REASON_LENGTH

# Every kind of field, bounded so that a sampled answer always closes well inside max_tokens.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
# A long answer (at least 200 characters, so about as many tokens) for the migration test to strike in.
LONG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "story": {"type": "string", "minLength": 200, "maxLength": 220},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["story", "rating"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def suite_http(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Suite, int]]:
    """One worker (the migration test adds a second), prefix caching on, the OpenAI HTTP front on."""
    port = free_port()
    suite = start_suite(
        tiny_model_dir,
        tmp_path_factory.mktemp("sampling-logs"),
        worker_args=WORKER_ARGS,
        scheduler_args=["--max-num-batched-tokens", "512"],
        gateway_args=["--http-port", str(port)],
    )
    yield suite, port
    suite.stop()


def _http(port: int) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=300)


async def _model_name(client: AsyncOpenAI) -> str:
    return (await client.models.list()).data[0].id


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(length)]


def _eos_id(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    eos = config["eos_token_id"]
    # The same id from the tokenizer's side (what the gateway reads), so neither file alone decides it.
    assert [t["id"] for t in tokenizer["added_tokens"] if t["content"] == "</s>"] == [eos]
    return int(eos)


def _repeats(tokens: Sequence[int]) -> int:
    """Tokens that already occurred earlier in the output."""
    return len(tokens) - len(set(tokens))


@functools.cache
def _oracle(model_dir: str) -> Any:
    """transformers' own model on the same directory, fp32, EOS never stopping generate."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def _reference_logprobs(model_dir: Path, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
    """[len(output), vocab]: log_softmax of transformers' fp32 logits at each output position."""
    model = _oracle(str(model_dir))
    ids = torch.tensor([[*prompt, *output]], dtype=torch.int64)
    with torch.inference_mode():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    start = len(prompt) - 1
    return torch.log_softmax(logits[start : start + len(output)], dim=-1)


def _reference_repetition_penalty(model_dir: Path, prompt: Sequence[int], penalty: float, n: int) -> list[int]:
    """Greedy generate with transformers' RepetitionPenaltyLogitsProcessor (over prompt + output)."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    model = _oracle(str(model_dir))
    ids = torch.tensor([list(prompt)], dtype=torch.int64)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty)]),
        )
    return [int(t) for t in out[0, len(prompt) :].tolist()]


def _check_top(reference: torch.Tensor, ids: Sequence[int], values: Sequence[float], k: int) -> None:
    """ids/values are the k most likely tokens of one reference row (log-probs), most likely first."""
    assert len(ids) == len(values) == k
    ref_values, ref_ids = torch.topk(reference, k)
    for j in range(k):
        # The value at rank j is the reference's j-th largest, and it is the value of the id reported with it.
        assert values[j] == pytest.approx(float(ref_values[j]), abs=1e-4), (j, ids, ref_ids.tolist())
        assert float(reference[ids[j]]) == pytest.approx(values[j], abs=1e-4), (j, ids, ref_ids.tolist())
        # The id itself, unless the reference has a near-tie there (then either order is right).
        tie = any(abs(float(ref_values[i]) - float(ref_values[j])) < 1e-4 for i in range(k) if i != j)
        if not tie:
            assert ids[j] == int(ref_ids[j]), (j, ids, ref_ids.tolist())


# ---------------------------------------------------------------------------------------------- logprobs


async def test_logprobs_and_top20_equal_transformers(suite_http: tuple[Suite, int], tiny_model_dir: Path) -> None:
    suite, port = suite_http
    prompt = _prompt(101, 23)
    params = sampling_params(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=20)
    async with GenerationClient(suite.address) as client:
        full = await client.complete(build_request(token_ids=prompt, sampling=params), timeout=120)
        streamed = [r async for r in client.generate(build_request(token_ids=prompt, sampling=params), timeout=120)]
    output = list(full.token_ids)
    assert output == transformers_greedy(tiny_model_dir, prompt, 16)
    reference = _reference_logprobs(tiny_model_dir, prompt, output)
    assert len(full.logprobs) == len(full.top_logprobs) == 16
    for i, token in enumerate(output):
        assert full.logprobs[i] == pytest.approx(float(reference[i, token]), abs=1e-4), i
        top = full.top_logprobs[i]
        _check_top(reference[i], list(top.token_ids), list(top.logprobs), 20)
        # Greedy: the sampled token is the most likely one.
        assert top.token_ids[0] == token
    # The stream carries them too, one entry per token id (this run hits the first one's cached prefix, so
    # the reference decides, not bit equality with the first run).
    assert [t for r in streamed for t in r.token_ids] == output
    streamed_logprobs = [lp for r in streamed for lp in r.logprobs]
    streamed_top = [t for r in streamed for t in r.top_logprobs]
    assert len(streamed_logprobs) == len(streamed_top) == 16
    for i, token in enumerate(output):
        assert streamed_logprobs[i] == pytest.approx(float(reference[i, token]), abs=1e-4), i
        _check_top(reference[i], list(streamed_top[i].token_ids), list(streamed_top[i].logprobs), 20)
    assert full.choices[0].logprobs == full.logprobs

    # HTTP completions (token-id prompt, logprobs=k): the sampled token's logprob and its k alternatives.
    http = _http(port)
    completion = await http.completions.create(
        model=await _model_name(http),
        prompt=prompt,
        max_tokens=16,
        temperature=0.0,
        logprobs=5,
        extra_body={"ignore_eos": True},
    )
    [choice] = completion.choices
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert len(choice.logprobs.token_logprobs) == 16
    for i, token in enumerate(output):
        assert choice.logprobs.token_logprobs[i] == pytest.approx(float(reference[i, token]), abs=1e-4), i
    assert choice.logprobs.top_logprobs is not None
    for i, alternatives in enumerate(choice.logprobs.top_logprobs):
        # Keyed by token text (two ids may decode alike), so check values: each is one of the reference top 6.
        ref_top = torch.topk(reference[i], 6).values.tolist()
        assert alternatives
        for value in alternatives.values():
            assert min(abs(value - r) for r in ref_top) < 1e-4, (i, alternatives, ref_top)
        assert max(alternatives.values()) == pytest.approx(ref_top[0], abs=1e-4)

    # HTTP chat: logprobs of the same greedy answer as the gRPC chat path, against transformers.
    messages = [("user", "Name a colour.")]
    async with GenerationClient(suite.address) as client:
        chat_ref = await client.complete(
            build_request(messages=messages, sampling=sampling_params(max_tokens=8, temperature=0.0, ignore_eos=True))
        )
    chat = await http.chat.completions.create(
        model=await _model_name(http),
        messages=[{"role": r, "content": c} for r, c in messages],  # type: ignore[misc]
        max_completion_tokens=8,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    entries = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert entries is not None and len(entries) == 8
    chat_prompt = _chat_prompt_ids(tiny_model_dir, messages)
    assert chat_ref.usage.prompt_tokens == len(chat_prompt)
    chat_reference = _reference_logprobs(tiny_model_dir, chat_prompt, list(chat_ref.token_ids))
    for i, (entry, token) in enumerate(zip(entries, chat_ref.token_ids, strict=True)):
        assert entry.logprob == pytest.approx(float(chat_reference[i, token]), abs=1e-4), i
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            torch.topk(chat_reference[i], 3).values.tolist(), abs=1e-4
        )


def _chat_prompt_ids(model_dir: Path, messages: Sequence[tuple[str, str]]) -> list[int]:
    """The templated chat prompt, by transformers' tokenizer and the model's own chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids: Any = tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in messages], add_generation_prompt=True, tokenize=True
    )
    if not isinstance(ids, list):  # newer releases return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


# ---------------------------------------------------------------------------------------------- penalties


async def test_repetition_penalty_breaks_a_loop_as_transformers(
    suite_http: tuple[Suite, int], tiny_model_dir: Path
) -> None:
    # A prompt of one repeated token sends the tiny model into a one-token loop.
    prompt = [192] * 4
    n = 48
    base = sampling_params(max_tokens=n, temperature=0.0, ignore_eos=True)
    penalised = sampling_params(max_tokens=n, temperature=0.0, ignore_eos=True, repetition_penalty=1.5)
    suite, _ = suite_http
    async with GenerationClient(suite.address) as client:
        looping, damped = await asyncio.gather(
            stream(client, build_request(token_ids=prompt, sampling=base)),
            stream(client, build_request(token_ids=prompt, sampling=penalised)),
        )
    assert looping.token_ids == transformers_greedy(tiny_model_dir, prompt, n)
    assert _repeats(looping.token_ids) >= n // 2, f"the prompt no longer loops: {looping.token_ids}"
    assert damped.token_ids == _reference_repetition_penalty(tiny_model_dir, prompt, 1.5, n)
    assert _repeats(damped.token_ids) <= _repeats(looping.token_ids) // 4, damped.token_ids


# ---------------------------------------------------------------------------------------------- min_tokens


async def test_min_tokens_holds_off_a_forced_eos(suite_http: tuple[Suite, int], tiny_model_dir: Path) -> None:
    suite, _ = suite_http
    eos = _eos_id(tiny_model_dir)
    prompt = _prompt(202, 12)

    def request(**extra: Any) -> generation_pb2.GenerateRequest:
        params = sampling_params(max_tokens=20, temperature=0.0, **extra)
        params.logit_bias[eos] = 100.0
        return build_request(token_ids=prompt, sampling=params)

    async with GenerationClient(suite.address) as client:
        forced, held = await asyncio.gather(stream(client, request()), stream(client, request(min_tokens=5)))
    assert forced.token_ids == [eos]
    assert forced.finish_reason == STOP and forced.text == ""
    assert forced.usage is not None and forced.usage.completion_tokens == 1
    # Five tokens with EOS banned (greedy among the rest: transformers' greedy when that is not EOS), then EOS.
    greedy = transformers_greedy(tiny_model_dir, prompt, 5)
    assert eos not in greedy
    assert held.token_ids == [*greedy, eos]
    assert held.finish_reason == STOP
    assert held.usage is not None and held.usage.completion_tokens == 6


# ---------------------------------------------------------------------------------------------- n samples


async def test_n_samples_seeded_distinct_and_share_prefix_blocks(
    suite_http: tuple[Suite, int], tiny_model_dir: Path
) -> None:
    suite, _ = suite_http
    prompt = _prompt(303, 100)  # 6 full blocks of 16, new to this suite
    full_blocks = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    params = sampling_params(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)

    def request(p: sampling_pb2.SamplingParams, n: int, ids: Sequence[int] = prompt) -> generation_pb2.GenerateRequest:
        r = build_request(token_ids=ids, sampling=p)
        r.n = n
        return r

    async with GenerationClient(suite.address) as client:
        await suite.wait_idle()
        before = await suite.stats()
        first = await client.complete(request(params, 4), timeout=120)
        after = await suite.stats()
        second = await client.complete(request(params, 4), timeout=120)
        # Sample i is seeded seed + i: the same tokens as a lone request with that seed.
        singles = await asyncio.gather(
            *(
                client.complete(
                    request(sampling_params(max_tokens=16, temperature=1.0, seed=1234 + i, ignore_eos=True), 1),
                    timeout=120,
                )
                for i in range(4)
            )
        )
        # Greedy samples that share blocks within one step still compute the right KV: all equal transformers.
        greedy_prompt = _prompt(304, 90)
        greedy = await client.complete(
            request(sampling_params(max_tokens=12, temperature=0.0, ignore_eos=True), 4, greedy_prompt), timeout=120
        )

    choices = [list(c.token_ids) for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert all(len(c) == 16 for c in choices)
    assert choices == [list(c.token_ids) for c in second.choices], "the same seed gave other samples"
    assert len({tuple(c) for c in choices}) == 4, f"samples are not independent: {choices}"
    assert choices == [list(s.token_ids) for s in singles]
    assert list(first.token_ids) == choices[0] and first.text == first.choices[0].text
    assert first.usage.prompt_tokens == len(prompt) and first.usage.completion_tokens == 4 * 16

    # Samples 1..3 found sample 0's full prompt blocks in the prefix cache.
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    assert queries == 4 * len(prompt), (before, after)
    assert hits >= 3 * full_blocks, f"samples did not share prefix blocks: {hits} hits of {queries} queries"
    assert first.usage.cached_tokens >= full_blocks

    expected = transformers_greedy(tiny_model_dir, greedy_prompt, 12)
    assert [list(c.token_ids) for c in greedy.choices] == [expected] * 4
    assert greedy.usage.cached_tokens >= (len(greedy_prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


# ---------------------------------------------------------------------------------------------- grammars


async def _constrained(
    suite: Suite, grammar: sampling_pb2.Grammar, seeds: Sequence[int], max_tokens: int, prompt: str = "Answer:"
) -> list[generation_pb2.CompleteResponse]:
    async with GenerationClient(suite.address) as client:
        requests = []
        for seed in seeds:
            params = sampling_params(max_tokens=max_tokens, temperature=1.0, seed=seed)
            params.grammar.CopyFrom(grammar)
            requests.append(build_request(prompt=prompt, sampling=params))
        return list(await asyncio.gather(*(client.complete(r, timeout=300) for r in requests)))


async def test_json_schema_50_samples_validate(suite_http: tuple[Suite, int]) -> None:
    suite, _ = suite_http
    answers = await _constrained(suite, sampling_pb2.Grammar(json_schema=json.dumps(SCHEMA)), range(50), 300)
    texts = [a.text for a in answers]
    assert [a.finish_reason for a in answers] == [STOP] * 50, texts
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 25, "seeds barely change the output"


async def test_regex_and_choice_outputs_match(suite_http: tuple[Suite, int]) -> None:
    suite, _ = suite_http
    pattern = r"[0-9]{3}-[0-9]{4}"
    choices = ["alpha", "beta", "gamma delta", "42", "red fox"]
    grammar = sampling_pb2.Grammar()
    grammar.choice.choices.extend(choices)
    phones, picks = await asyncio.gather(
        _constrained(suite, sampling_pb2.Grammar(regex=pattern), range(20), 40),
        _constrained(suite, grammar, range(100, 120), 40),
    )
    for answer in phones:
        assert answer.finish_reason == STOP and re.fullmatch(pattern, answer.text), answer.text
    for answer in picks:
        assert answer.finish_reason == STOP and answer.text in choices, answer.text
    assert len({a.text for a in phones}) > 10
    assert len({a.text for a in picks}) > 1


async def test_response_format_over_http_validates(suite_http: tuple[Suite, int]) -> None:
    _, port = suite_http
    http = _http(port)
    model = await _model_name(http)
    messages: Any = [{"role": "user", "content": "Describe a person as JSON."}]

    async def json_object(seed: int) -> Any:
        return await http.chat.completions.create(
            model=model,
            messages=messages,
            max_completion_tokens=400,
            temperature=1.0,
            seed=seed,
            response_format={"type": "json_object"},
        )

    async def json_schema(seed: int) -> Any:
        return await http.chat.completions.create(
            model=model,
            messages=messages,
            max_completion_tokens=300,
            temperature=1.0,
            seed=seed,
            n=2,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
        )

    objects = await asyncio.gather(*(json_object(s) for s in range(8)))
    schemas = await asyncio.gather(*(json_schema(s) for s in range(4)))
    for completion in objects:
        [choice] = completion.choices
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)
    for completion in schemas:
        assert len(completion.choices) == 2
        for choice in completion.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)


async def test_bad_grammar_refused_at_the_edge(suite_http: tuple[Suite, int]) -> None:
    suite, port = suite_http
    http = _http(port)
    long_params = sampling_params(max_tokens=60, temperature=0.0, ignore_eos=True)
    async with GenerationClient(suite.address) as client:
        running = client.generate(build_request(token_ids=_prompt(505, 20), sampling=long_params), timeout=300)
        first = await anext(running)
        assert first.token_ids, "the well-behaved stream has not started"

        bad = sampling_params(max_tokens=10)
        bad.grammar.regex = "[0-9"
        assert await expect_invalid(client, build_request(prompt="x", sampling=bad)) == ["sampling.grammar.regex"]
        with pytest.raises(openai.BadRequestError) as info:
            await http.chat.completions.create(
                model=await _model_name(http),
                messages=[{"role": "user", "content": "x"}],
                max_completion_tokens=10,
                extra_body={"guided_regex": "[0-9"},
            )
        assert info.value.status_code == 400 and info.value.param == "guided_regex"
        assert "regex" in info.value.message
        # A schema keyword the engine cannot enforce, through response_format.
        with pytest.raises(openai.BadRequestError) as schema_info:
            await http.chat.completions.create(
                model=await _model_name(http),
                messages=[{"role": "user", "content": "x"}],
                max_completion_tokens=10,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "not": {"required": ["a"]}}},
                },
            )
        assert schema_info.value.status_code == 400 and schema_info.value.param == "response_format"

        tokens = list(first.token_ids)
        finish = 0
        async for response in running:
            tokens.extend(response.token_ids)
            finish = response.finish_reason
    assert finish == LENGTH and len(tokens) == 60


async def test_max_tokens_past_max_model_len(suite_http: tuple[Suite, int]) -> None:
    suite, port = suite_http
    # A long prompt, so that what fits is a short answer.
    prompt = _prompt(606, MAX_MODEL_LEN - 40)
    too_many = MAX_MODEL_LEN - len(prompt) + 1
    async with GenerationClient(suite.address) as client:
        request = build_request(token_ids=prompt, sampling=sampling_params(max_tokens=too_many))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.complete(request, timeout=60)
        # Exactly what fits is accepted.
        fits = build_request(token_ids=prompt, sampling=sampling_params(max_tokens=too_many - 1, ignore_eos=True))
        ok = await client.complete(fits, timeout=300)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in field_violations(err)] == ["sampling.max_tokens"]
    details = err.details() or ""
    assert "sampling.max_tokens" in details
    assert str(too_many) in details and str(MAX_MODEL_LEN) in details, details
    assert len(ok.token_ids) == too_many - 1 and ok.finish_reason == LENGTH

    http = _http(port)
    with pytest.raises(openai.BadRequestError) as http_info:
        await http.completions.create(model=await _model_name(http), prompt=prompt, max_tokens=too_many)
    assert http_info.value.status_code == 400
    assert http_info.value.param == "max_tokens"
    assert str(too_many) in http_info.value.message and str(MAX_MODEL_LEN) in http_info.value.message


# ---------------------------------------------------------------------------------------------- migration
# Last in the file: it adds a worker to the module's suite and kills one.


async def test_constrained_stream_survives_kill_9(suite_http: tuple[Suite, int], tiny_model_dir: Path) -> None:
    suite, _ = suite_http

    def request(seed: int | None) -> generation_pb2.GenerateRequest:
        temperature = 0.0 if seed is None else 1.0
        params = sampling_params(max_tokens=500, temperature=temperature, seed=seed)
        params.grammar.json_schema = json.dumps(LONG_SCHEMA)
        return build_request(token_ids=prompt, sampling=params)

    # Six full blocks: the kv router keeps both streams on the worker that cached them (the one to kill).
    prompt = _prompt(707, 100)
    seeds: list[int | None] = [None, 7]
    async with GenerationClient(suite.address) as client:
        # Undisturbed, on the one worker there is.
        undisturbed = await asyncio.gather(*(stream(client, request(s)) for s in seeds))
        for answer in undisturbed:
            assert answer.finish_reason == STOP, answer.text
            jsonschema.validate(json.loads(answer.text), LONG_SCHEMA)

        suite.add_worker(tiny_model_dir, WORKER_ARGS)
        await suite.wait_workers(2)
        before = await suite.stats()

        received = [0] * len(seeds)

        async def watched(i: int) -> Any:
            texts: list[str] = []
            tokens: list[int] = []
            finish = 0
            async for response in client.generate(request(seeds[i]), timeout=300):
                texts.append(response.text)
                tokens.extend(response.token_ids)
                received[i] = len(tokens)
                if response.finish_reason:
                    finish = response.finish_reason
            return "".join(texts), tokens, finish

        tasks = [asyncio.create_task(watched(i)) for i in range(len(seeds))]
        # Strike once both streams are well under way (each answer is 200+ tokens).
        while min(received) < 20:
            assert not any(t.done() for t in tasks), "a stream ended before the kill"
            await asyncio.sleep(0.005)
        serving = [w.worker_id for w in (await suite.stats()).workers if w.num_running]
        assert len(serving) == 1, f"the streams run on {serving}, not on the worker holding their prefix"
        victim = next(w for w in suite.workers if w.name == serving[0])
        victim.process.kill()
        victim.process.wait()
        at_kill = list(received)
        results = await asyncio.gather(*tasks)
        after = await suite.wait_idle(timeout=120)

    assert max(at_kill) < min(len(a.token_ids) for a in undisturbed), "the kill came after the streams ended"
    assert after.num_workers_lost == before.num_workers_lost + 1
    assert after.num_requeued >= before.num_requeued + len(seeds)
    assert [w.worker_id for w in after.workers] == [w.worker_id for w in before.workers if w.worker_id != victim.name]
    for (text, tokens, finish), expected in zip(results, undisturbed, strict=True):
        assert finish == STOP
        assert tokens == expected.token_ids
        assert text == expected.text
        jsonschema.validate(json.loads(text), LONG_SCHEMA)
