"""A server's Prometheus ``/metrics``: kvfuse, vLLM and llama-server (``--metrics``) all have one."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape_metrics(url: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus ``/metrics`` page: ``(name, labels, value)``."""
    import httpx

    out = []
    for line in httpx.get(url.rstrip("/") + "/metrics", timeout=10.0).text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def metric_total(
    samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str
) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(
        v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())
    )


def first_total(samples: list[tuple[str, dict[str, str], float]], *candidates: str) -> float:
    """The total of the first of ``candidates`` the page has (metric names change across
    versions: ``vllm:prefix_cache_hits_total`` or ``vllm:prefix_cache_hits``); 0 if none."""
    names = {n for n, _, _ in samples}
    return next((metric_total(samples, n) for n in candidates if n in names), 0.0)


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Counters' growth between two scrapes; gauges (peaks) as they are after."""
    gauges = {"kv_memory_peak_bytes"}
    return {k: round(v if k in gauges else v - before.get(k, 0.0), 4) for k, v in after.items()}
