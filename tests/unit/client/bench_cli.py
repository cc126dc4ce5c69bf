"""Shared by the bench command's tests: parse `meshserve bench` flags, and a model directory to name."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from services.cli import _build_parser


def parse_bench(*args: str) -> argparse.Namespace:
    """`meshserve bench ARGS` parsed as the CLI does."""
    return _build_parser().parse_args(["bench", *args])


def bench_parse_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The usage error `meshserve bench ARGS` exits with (code 2)."""
    with pytest.raises(SystemExit) as exc:
        parse_bench(*args)
    assert exc.value.code == 2
    return capsys.readouterr().err


def tiny_model_config(tmp_path: Path) -> Path:
    """A directory with only the config.json the bench reads (the vocabulary size)."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 300}))
    return path
