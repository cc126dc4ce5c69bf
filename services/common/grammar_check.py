"""Checks on SamplingParams.grammar, and its translation into an llguidance grammar (torch-free).

The gateway calls check_grammar so that a bad grammar is refused with a field path before it is queued;
the worker calls llguidance_grammar to get the same grammar text it then compiles against the model's
tokenizer. llguidance validates a grammar without any tokenizer (JSON schema keywords it does not
implement, regex syntax, GBNF/Lark syntax), in well under a millisecond for typical grammars, and its
wheel has no Python dependencies, so this module never pulls in torch.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from services.common.proto.meshserve.v1 import sampling_pb2
from services.common.sampling_checks import InvalidField

# Caps from protos/meshserve/v1/sampling.proto, checked before anything is parsed so that no request
# buys unbounded compile work.
MAX_GRAMMAR_BYTES = 65536
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
# Engine messages can quote the grammar back; a client needs the first lines, not a 64 KiB echo.
MAX_ENGINE_MESSAGE_CHARS = 600

# JSON output format for json_schema and json_object: json.dumps' default separators and no other
# whitespace. Free whitespace lets a small model (or a uniform sampler) spin on spaces and newlines
# until max_tokens; fixed separators keep the output one line, as OpenAI's structured outputs does.
JSON_FORMAT: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_FIELD = "sampling.grammar"


def grammar_kind(grammar: sampling_pb2.Grammar) -> str | None:
    """The grammar's oneof member, or None when no constraint is set."""
    return grammar.WhichOneof("kind")


def is_constrained(params: sampling_pb2.SamplingParams) -> bool:
    """Whether the request's output is constrained by a grammar (the worker builds a matcher for it)."""
    return params.HasField("grammar") and grammar_kind(params.grammar) is not None


def check_grammar(grammar: sampling_pb2.Grammar) -> None:
    """Raise InvalidField for a grammar over its caps or one llguidance cannot compile (no tokenizer needed)."""
    if grammar_kind(grammar) is None:
        return
    text = llguidance_grammar(grammar)
    # Default parser limits, as the worker compiles with: what passes here compiles there.
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, None)
    if is_error:
        raise InvalidField(_field_of(grammar), _engine_problem(grammar, messages[0] if messages else "invalid"))


def llguidance_grammar(grammar: sampling_pb2.Grammar) -> str:
    """The llguidance grammar definition for `grammar`, after its caps; InvalidField when it cannot be built.

    The result is not yet validated (check_grammar does that; the worker's compile reports the same errors).
    """
    kind = grammar_kind(grammar)
    if kind is None:
        raise InvalidField(_FIELD, "no grammar kind is set; set one of json_object, json_schema, regex, choice, ebnf")
    matcher = llguidance.LLMatcher
    if kind == "json_object":
        if not grammar.json_object:
            raise InvalidField(
                f"{_FIELD}.json_object", "json_object must be true; to leave the output unconstrained, unset grammar"
            )
        return matcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_FORMAT)
    if kind == "choice":
        choices = _checked_choices(grammar.choice.choices)
        # JSON string literals are valid Lark string literals (escapes included), so any text is safe here.
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    source: str = getattr(grammar, kind)
    field = f"{_FIELD}.{kind}"
    size = len(source.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise InvalidField(field, f"{kind} is {size} bytes; the limit is {MAX_GRAMMAR_BYTES}, shorten it")
    if not source.strip():
        raise InvalidField(field, f"{kind} is empty; send a {_WHAT[kind]} or unset grammar")
    if kind == "json_schema":
        schema = _parsed_schema(source)
        try:
            return matcher.grammar_from_json_schema(schema, overrides=JSON_FORMAT)
        except ValueError as err:
            raise InvalidField(field, f"{_clip(str(err))}; send a JSON schema object") from err
    if kind == "regex":
        return matcher.grammar_from_regex(source)
    try:
        return llguidance.grammar_from("gbnf", source)
    except ValueError as err:
        raise InvalidField(field, f"{_clip(str(err))}; fix the grammar (GBNF syntax, root rule named root)") from err


_WHAT = {
    "json_schema": "JSON schema (a JSON object)",
    "regex": "regular expression",
    "ebnf": "GBNF grammar with a root rule",
}


def _checked_choices(choices: Any) -> list[str]:
    field = f"{_FIELD}.choice.choices"
    if not choices:
        raise InvalidField(field, "choice needs at least one string; add the allowed outputs or unset grammar")
    if len(choices) > MAX_CHOICES:
        raise InvalidField(field, f"at most {MAX_CHOICES} choices are allowed; got {len(choices)}")
    for i, choice in enumerate(choices):
        if not choice:
            raise InvalidField(f"{field}[{i}]", "choices must not be empty strings; remove it")
        if len(choice) > MAX_CHOICE_CHARS:
            raise InvalidField(
                f"{field}[{i}]", f"choice is {len(choice)} characters; the limit is {MAX_CHOICE_CHARS}, shorten it"
            )
    return list(choices)


def _parsed_schema(source: str) -> dict[str, Any]:
    field = f"{_FIELD}.json_schema"
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as err:
        raise InvalidField(
            field,
            f"is not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); send the schema as JSON text",
        ) from err
    if not isinstance(schema, dict):
        raise InvalidField(field, f"must be a JSON object (a schema); got a JSON {type(schema).__name__}")
    return schema


def _field_of(grammar: sampling_pb2.Grammar) -> str:
    kind = grammar_kind(grammar)
    return f"{_FIELD}.choice.choices" if kind == "choice" else f"{_FIELD}.{kind}"


def _engine_problem(grammar: sampling_pb2.Grammar, message: str) -> str:
    kind = grammar_kind(grammar)
    fix = {
        "json_schema": "fix the schema: drop the keywords named as unimplemented, or correct the type or pattern",
        "regex": "fix the expression (Rust regex syntax: no look-around or back-references)",
        "ebnf": "fix the grammar (GBNF syntax, root rule named root)",
        "choice": "change the choices",
        "json_object": "report this: json_object needs no input",
    }[kind or "json_object"]
    return f"the grammar engine refused it: {_clip(message)}; {fix}"


def _clip(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ENGINE_MESSAGE_CHARS else message[:MAX_ENGINE_MESSAGE_CHARS] + "..."
