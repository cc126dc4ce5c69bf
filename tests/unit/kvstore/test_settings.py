"""kvstore flags: defaults, sizes, backend URLs; bad values name the field."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from services.common.settings import add_settings_arguments, settings_from_args
from services.gateway.settings import DEFAULT_PORT as GATEWAY_PORT
from services.kvstore.settings import DEFAULT_PORT, KVStoreSettings
from services.scheduler.settings import DEFAULT_PORT as SCHEDULER_PORT
from services.worker.settings import DEFAULT_PORT as WORKER_PORT


def _parse(argv: list[str]) -> KVStoreSettings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, KVStoreSettings)
    return settings_from_args(KVStoreSettings, parser.parse_args(argv))


def test_defaults() -> None:
    settings = _parse([])
    assert settings.port == DEFAULT_PORT == 50054
    assert DEFAULT_PORT not in (GATEWAY_PORT, SCHEDULER_PORT, WORKER_PORT)
    assert settings.backend_kind == "memory"
    assert settings.capacity_bytes == 4 << 30
    assert settings.staging_capacity_bytes == 256 << 20
    assert (settings.redis_max_connections, settings.ttl_seconds) == (16, 0)


def test_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_CAPACITY", "512MiB")
    assert _parse([]).capacity_bytes == 512 << 20
    settings = _parse(
        ["--backend", "redis://10.0.0.5:6380/2", "--ttl-seconds", "3600", "--redis-max-connections", "4",
         "--capacity", "1GiB"]
    )  # fmt: skip
    assert settings.backend_kind == "redis"
    assert (settings.ttl_seconds, settings.redis_max_connections, settings.capacity_bytes) == (3600, 4, 1 << 30)


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--backend", "mysql://x"], "backend"),
        (["--backend", "redis://"], "backend"),
        (["--capacity", "lots"], "capacity"),
        (["--capacity", "0"], "capacity"),
        (["--staging-capacity=-1MiB"], "staging_capacity"),
        (["--redis-max-connections", "0"], "redis_max_connections"),
        (["--ttl-seconds", "-1"], "ttl_seconds"),
    ],
)
def test_bad_values_name_the_field(argv: list[str], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        _parse(argv)


def test_the_kvstore_verb_takes_these_flags() -> None:
    from services.cli import _build_parser

    ns = _build_parser().parse_args(["kvstore", "--port", "0", "--backend", "redis://127.0.0.1:6379/0"])
    assert ns.verb == "kvstore"
    settings = settings_from_args(KVStoreSettings, ns)
    assert (settings.port, settings.backend_kind) == (0, "redis")
