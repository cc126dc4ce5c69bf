"""TextTokenizer against transformers' AutoTokenizer as the oracle."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.gateway.chat_template import ChatTemplateError, render_chat_template
from services.gateway.tokenizer import NoChatTemplateError, TextTokenizer
from tests.unit.gateway import CHATML_TEMPLATE, CORPUS, build_tiny_model_dir

REPO_ROOT = Path(__file__).resolve().parents[3]

TEXTS = [
    "Hello world!",
    " leading space and trailing ",
    "日本語のテキスト 🙂🚀 mixed with ASCII",
    "<|im_start|>user\nhi<|im_end|>",
    "tabs\tand\nnewlines\n\n",
    "x",
    *CORPUS[:7],
]

CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  And 🙂 times 日本?  "},
    ],
]


def _auto(path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def _check_against_transformers(path: Path) -> None:
    ours = TextTokenizer.from_dir(path)
    ref = _auto(path)
    for text in TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"], text
        ids = ours.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    for chat in CHATS:
        rendered = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ours.render_chat(chat) == rendered
        expected = ref.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        if isinstance(expected, dict) or hasattr(expected, "keys"):
            expected = expected["input_ids"]
        assert ours.encode_chat(chat) == list(expected)
    assert set(ours.all_special_ids) == set(ref.all_special_ids)


def test_tiny_matches_transformers(tiny_dir: Path) -> None:
    _check_against_transformers(tiny_dir)


def test_bos_from_tokenizer_json_post_processor(tmp_path: Path) -> None:
    path = build_tiny_model_dir(tmp_path, tokenizer_config={"add_bos_token": False})
    data = json.loads((path / "tokenizer.json").read_text())
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    (path / "tokenizer.json").write_text(json.dumps(data))
    ours = TextTokenizer.from_dir(path)
    assert ours.encode("Hello world!")[0] == ours.bos_token_id == 1
    # Chat input is tokenized without special tokens: the template already starts with <|im_start|>.
    chat_ids = ours.encode_chat(CHATS[0])
    assert chat_ids[0] == 1 and chat_ids[1] != 1
    _check_against_transformers(path)


def test_chat_template_jinja_file_wins(tmp_path: Path) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{{ eos_token }}"
    path = build_tiny_model_dir(tmp_path, template_file=template)
    ours = TextTokenizer.from_dir(path)
    assert ours.render_chat(CHATS[0]) == "[user]Hello!<|im_end|>"
    _check_against_transformers(path)


def test_model_metadata(tiny_dir: Path) -> None:
    tok = TextTokenizer.from_dir(tiny_dir)
    assert tok.vocab_size == 512  # the model's, from config.json, not the tokenizer's 400
    # generation_config first, then config, then the tokenizer's eos; deduplicated.
    assert tok.eos_token_ids == [2, 0]
    assert tok.eos_token_id == 2
    assert tok.bos_token_id == 1
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.id_to_token(10_000) is None


def test_metadata_fallbacks(tmp_path: Path) -> None:
    path = build_tiny_model_dir(tmp_path)
    (path / "config.json").unlink()
    (path / "generation_config.json").unlink()
    tok = TextTokenizer.from_dir(path)
    assert tok.vocab_size == 400
    assert tok.eos_token_ids == [2]


def test_no_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    tok = TextTokenizer.from_dir(build_tiny_model_dir(tmp_path, with_template=False))
    assert not tok.has_chat_template
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        tok.encode_chat(CHATS[0])
    assert isinstance(NoChatTemplateError("x"), ValueError)


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        TextTokenizer.from_dir(tmp_path)


def test_template_helpers_like_transformers() -> None:
    template = (
        "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('must start with user') }}{% endif %}"
        "{{ messages | tojson }}{% set ns = namespace(n=0) %}{% for m in messages %}"
        "{% set ns.n = ns.n + 1 %}{% if ns.n > 1 %}{% break %}{% endif %}{% endfor %}{{ ns.n }}"
        "{% generation %} gen{% endgeneration %}"
    )
    out = render_chat_template(template, [{"role": "user", "content": "<b>日本</b>"}])
    assert out == json.dumps([{"role": "user", "content": "<b>日本</b>"}], ensure_ascii=False) + "1 gen"
    with pytest.raises(ChatTemplateError, match="must start with user"):
        render_chat_template(template, [{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for %}", [])


def test_template_sandbox_blocks_escapes() -> None:
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.__class__.__mro__[1].__subclasses__() }}", [])
    with pytest.raises(Exception, match="underscore"):
        render_chat_template("{% set ns = namespace(_x=1) %}", [])


def test_trim_and_lstrip_blocks() -> None:
    template = "  {% for m in messages %}\n{{ m['content'] }}\n  {% endfor %}\n"
    assert render_chat_template(template, [{"role": "user", "content": "a"}]) == "a\n"


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_dir: Path) -> None:
    _check_against_transformers(smollm2_dir)
    tok = TextTokenizer.from_dir(smollm2_dir)
    assert tok.vocab_size == 49152
    assert tok.eos_token_ids == [2]


def test_gateway_imports_neither_torch_nor_transformers() -> None:
    code = (
        "import sys\n"
        "import services.gateway.tokenizer, services.gateway.chat_template, services.gateway.detokenizer\n"
        "import services.gateway.stop_strings, services.gateway.validation, services.gateway.raw_request\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "", f"gateway modules imported: {result.stdout}"


def test_chatml_template_sanity() -> None:
    assert "<|im_start|>" in CHATML_TEMPLATE


def test_missing_special_tokens_are_added(tmp_path: Path) -> None:
    path = build_tiny_model_dir(tmp_path, tokenizer_config={"additional_special_tokens": ["<tool>"]})
    ours = TextTokenizer.from_dir(path)
    tool_id = ours.backend.token_to_id("<tool>")
    assert tool_id is not None and tool_id in ours.all_special_ids
    text = "call <tool> now"
    assert tool_id in ours.encode(text)
    assert ours.decode(ours.encode(text)) == "call  now"
    ref = _auto(path)
    assert ours.encode(text) == ref(text)["input_ids"]
    assert ours.decode(ours.encode(text)) == ref.decode(ref(text)["input_ids"], skip_special_tokens=True)
