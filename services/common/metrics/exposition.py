"""What a scrape returns: the registry's samples in Prometheus' text format, with the service's constant
labels and, when asked, a `vllm:` copy of the metrics vLLM also has.

Always the text format 0.0.4, whatever the scraper's Accept header says: prometheus-client's OpenMetrics
writer escapes `:` to `_` ("underscores" escaping) unless the scraper asks for `escaping=allow-utf-8`,
which Prometheus 2.x never does, so `meshserve:request_success_total` would be stored as
`meshserve_request_success_total`. `:` is a legal name character in the text format and passes untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import prometheus_client
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from services.common.metrics.names import PREFIX, VLLM_COUNTERPARTS, VLLM_PREFIX

# vLLM exports none either: a `_created` gauge per counter and histogram doubles the series and no
# dashboard reads them.
prometheus_client.disable_created_metrics()

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
ConstantLabels = Callable[[], Mapping[str, str]]


class Exposition:
    """One service's scrape: a collector over its registry (what generate_latest renders)."""

    def __init__(
        self,
        registries: Sequence[CollectorRegistry] = (REGISTRY,),
        *,
        constant_labels: ConstantLabels | None = None,
        vllm_alias: bool = False,
    ) -> None:
        """`constant_labels` is read at every scrape: the model name a service learns later (from its
        first worker) labels every series from then on, and no series stays behind under an old value."""
        # The process's default registry holds the gRPC server metrics; a service whose own metrics live
        # elsewhere (tests run several gateways in one process) passes both.
        self.registries = list(dict.fromkeys(registries))
        self.constant_labels = constant_labels
        self.vllm_alias = vllm_alias

    def collect(self) -> Iterator[Metric]:
        """The registry's families with the constant labels added, then their vLLM copies."""
        labels = dict(self.constant_labels()) if self.constant_labels is not None else {}
        families = [_with_labels(family, labels) for registry in self.registries for family in registry.collect()]
        yield from families
        if self.vllm_alias:
            for family in families:
                if family.name.startswith(PREFIX) and family.name.removeprefix(PREFIX) in VLLM_COUNTERPARTS:
                    yield _renamed(family, PREFIX, VLLM_PREFIX)

    def render(self) -> bytes:
        """The text a /metrics answer carries (CONTENT_TYPE)."""
        return generate_latest(self)  # type: ignore[arg-type]


def _with_labels(family: Metric, labels: Mapping[str, str]) -> Metric:
    if not labels:
        return family
    out = Metric(family.name, family.documentation, family.type, family.unit)
    out.samples = [sample._replace(labels={**labels, **sample.labels}) for sample in family.samples]
    return out


def _renamed(family: Metric, old: str, new: str) -> Metric:
    out = Metric(new + family.name.removeprefix(old), family.documentation, family.type, family.unit)
    out.samples = list(_rename_samples(family.samples, old, new))
    return out


def _rename_samples(samples: Iterable[Sample], old: str, new: str) -> Iterator[Sample]:
    for sample in samples:
        yield sample._replace(name=new + sample.name.removeprefix(old))
