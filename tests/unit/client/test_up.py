"""`meshserve up` flags and its prints, without starting any service."""

from __future__ import annotations

import argparse
import os

import pytest

from services.client import up


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return parser.parse_args(argv)


def test_workers_has_num_workers_as_an_alias() -> None:
    assert _parse().workers == 1
    assert _parse("--workers", "3").workers == 3
    assert _parse("--num-workers", "2").workers == 2


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_workers_must_be_a_positive_count(value: str) -> None:
    with pytest.raises(SystemExit):
        _parse("--workers", value)


def test_routing_reaches_the_scheduler_only_when_given() -> None:
    assert "--routing" not in up.scheduler_args(_parse())
    for policy in up.ROUTING_POLICIES:
        assert up.scheduler_args(_parse("--routing", policy))[-2:] == ["--routing", policy]
    with pytest.raises(SystemExit):
        _parse("--routing", "random")


def test_say_survives_a_closed_pipe() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # what `| tee` looks like once Ctrl-C killed tee
    with os.fdopen(write_end, "w") as stream:
        up.say("meshserve: stopping...", stream)
        up.say("meshserve: again", stream)
