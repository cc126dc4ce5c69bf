"""docs/metrics.md as data, and the metric names a PromQL expression reads.

docs/metrics.md is the contract between the services and everything that reads their metrics (deploy/prometheus
rules, the Grafana dashboard, the export tests), so the catalogue is parsed from that file rather than copied
into a list here that could drift from it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

METRICS_DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"

# Prometheus' metric name grammar (colons allowed: recording-rule style and our `meshserve:` prefix).
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_BACKTICKED = re.compile(r"`([^`]*)`")
# Series suffixes a histogram is exposed with; `_created` is never exported (docs/metrics.md).
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Series every scrape makes for every target, not exported by any service.
SCRAPE_SERIES = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped", "scrape_series_added"})


@dataclass(frozen=True)
class DocumentedMetric:
    """One row of a metric table in docs/metrics.md (the shorthand row gives two)."""

    name: str
    type: str  # counter, gauge or histogram
    section: str  # the `##` heading the table sits under
    vllm_alias: bool  # marked `v`: `--metrics-vllm-alias` exports a `vllm:` copy


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _expand_names(cell: str, where: str) -> list[str]:
    """The full names a first-column cell documents.

    A cell holds one backticked name, or a name and a suffix shorthand (`a_b_queries_total` / `_hits_total`):
    the shorthand replaces as many trailing `_`-separated parts of the full name as it has itself, so the row
    documents `a_b_queries_total` and `a_b_hits_total`.
    """
    names = _BACKTICKED.findall(cell)
    if not names:
        raise ValueError(f"{where}: no backticked metric name in the first column: {cell!r}")
    full = names[0]
    expanded = [full]
    for short in names[1:]:
        if not short.startswith("_"):
            expanded.append(short)
            continue
        parts = short.strip("_").split("_")
        stem = full.split("_")
        if len(stem) <= len(parts):
            raise ValueError(f"{where}: shorthand {short!r} is longer than {full!r}")
        expanded.append("_".join(stem[: -len(parts)]) + short)
    for name in expanded:
        if _METRIC_NAME.fullmatch(name) is None:
            raise ValueError(f"{where}: {name!r} is not a Prometheus metric name")
    return expanded


def documented_metrics(doc: Path = METRICS_DOC) -> list[DocumentedMetric]:
    """Every metric in docs/metrics.md's tables: those whose header's first cell is `name`.

    Prose (the kvstore's `meshserve:kvstore_*` paragraph) documents no exact names and so adds none; a name is
    only in the catalogue once a table row gives it. One name may be documented under two services (the
    scheduler and the worker could both export one), once each and with one type.
    Raises on a row that does not parse, a name given twice in one section or with two types, so a malformed
    edit of the doc fails the tests instead of silently changing the set.
    """
    metrics: list[DocumentedMetric] = []
    types: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()  # (section, name)
    section = ""
    columns: list[str] | None = None  # the header of the table being read, None outside a metric table
    for line_no, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("## "):
            section = stripped[3:].strip()
        if not stripped.startswith("|"):
            columns = None
            continue
        cells = _cells(stripped)
        if columns is None:
            columns = [c.lower() for c in cells] if cells and cells[0].lower() == "name" else []
            continue
        if not columns or all(set(c) <= set("-: ") for c in cells):
            continue  # a table of something else, or the header's separator row
        where = f"{doc}:{line_no}"
        row = dict(zip(columns, cells, strict=False))
        kind = row.get("type", "")
        if kind not in ("counter", "gauge", "histogram"):
            raise ValueError(f"{where}: unknown metric type {kind!r}")
        for name in _expand_names(cells[0], where):
            if (section, name) in seen:
                raise ValueError(f"{where}: {name} is documented twice under {section!r}")
            if types.setdefault(name, kind) != kind:
                raise ValueError(f"{where}: {name} is a {types[name]} elsewhere, here a {kind}")
            seen.add((section, name))
            metrics.append(DocumentedMetric(name, kind, section, row.get("v", "") == "v"))
    return metrics


def documented_metric_names(doc: Path = METRICS_DOC) -> set[str]:
    """The exact set of metric names docs/metrics.md's tables document (histograms by their base name)."""
    return {metric.name for metric in documented_metrics(doc)}


# --- PromQL -----------------------------------------------------------------------------------------------

# Words that are PromQL syntax, never a metric, when not followed by `(` (aggregations are followed by
# `by`/`without` or a space as often as by `(`, so they are listed too).
PROMQL_KEYWORDS = frozenset(
    {
        # aggregation operators
        "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
        "quantile", "limitk", "limit_ratio",
        # binary set and arithmetic operators spelled as words
        "and", "or", "unless", "atan2",
        # modifiers
        "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
        # number literals
        "inf", "nan",
    }
)  # fmt: skip

_TOKEN = re.compile(
    r"""
      (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
    | (?P<grafana>\$\{[^}]*\}|\$\w+|\[\[\w+\]\])       # Grafana template variables
    | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?[a-zA-Z]*)  # numbers, durations (5m)
    | (?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)
    | (?P<open>[({\[])
    | (?P<close>[)}\]])
    | (?P<other>\S)
    """,
    re.VERBOSE,
)
_NAME_MATCHER = re.compile(r"""__name__\s*=\s*(?:"((?:[^"\\]|\\.)*)"|'((?:[^'\\]|\\.)*)')""")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a Grafana target's, with `$variables`) selects.

    A name token is a metric unless it is a keyword, is called (`rate(`), or sits where no metric can: inside
    `{...}` matchers, `[...]` ranges, or the `(...)` label list after `by`, `without`, `on`, `ignoring`,
    `group_left` and `group_right`. `{__name__="x"}` selects `x`. Strings, numbers, durations and Grafana
    variables are skipped.
    """
    names: set[str] = {m.group(1) or m.group(2) for m in _NAME_MATCHER.finditer(expr)}
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr)]
    # What each open bracket holds: "labels" (matchers, grouping lists), "range" (`[5m:30s]`, where `:30s` would
    # otherwise read as a name) or "expr".
    stack: list[str] = []
    previous: str | None = None  # the last name token, to tell a grouping list's `(` from a call's
    for i, (kind, text) in enumerate(tokens):
        if kind == "open":
            grouping = text == "(" and previous in {"by", "without", "on", "ignoring", "group_left", "group_right"}
            stack.append("range" if text == "[" else "labels" if text == "{" or grouping else "expr")
            previous = None
            continue
        if kind == "close":
            if stack:
                stack.pop()
            previous = None
            continue
        if kind != "name":
            previous = None
            continue
        previous = text
        if stack and stack[-1] != "expr":
            continue
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if following == "(" or text.lower() in PROMQL_KEYWORDS:
            continue
        names.add(text)
    return names


def undocumented_metric_names(used: set[str], catalogue: list[DocumentedMetric] | None = None) -> set[str]:
    """The names of `used` that docs/metrics.md does not document.

    A histogram's `_bucket`/`_sum`/`_count` series count as its documented base name; the scrape's own series
    (`up`, ...) are allowed.
    """
    metrics = documented_metrics() if catalogue is None else catalogue
    names = {m.name for m in metrics}
    histograms = {m.name for m in metrics if m.type == "histogram"}
    missing: set[str] = set()
    for name in used:
        if name in names or name in SCRAPE_SERIES:
            continue
        base = next((name[: -len(s)] for s in HISTOGRAM_SUFFIXES if name.endswith(s)), None)
        if base is not None and base in histograms:
            continue
        missing.add(name)
    return missing
