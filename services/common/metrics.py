"""Prometheus metrics with a registry per service instance.

A registry per instance (not the process-global one) lets tests and the embedded mode run
several services in one process without duplicate-metric errors.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Tool calls and HTTP handlers live in the 50 µs – 1 s range.
LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Metrics:
    """Factory for a service's metrics, all named `star_<service>_<name>`."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry()

    def _name(self, name: str) -> str:
        return f"star_{self.service}_{name}"

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(self._name(name), doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(self._name(name), doc, labels, registry=self.registry)

    def histogram(self, name: str, doc: str, labels: tuple[str, ...] = (), buckets=LATENCY_BUCKETS) -> Histogram:
        return Histogram(self._name(name), doc, labels, registry=self.registry, buckets=buckets)

    def render(self) -> bytes:
        return generate_latest(self.registry)
