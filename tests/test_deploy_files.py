"""compose.yaml and the Helm chart: no Docker engine here, so check what can be checked statically."""

from __future__ import annotations

from pathlib import Path

import yaml

from services.common.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def test_compose_services_are_wired():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert {"redis", "postgres", "sandbox"} <= set(services)
    known = {f"STAR_{name.upper()}" for name in Settings.model_fields}
    for name, svc in services.items():
        if "build" in svc:
            assert (ROOT / svc["build"] / "Dockerfile").is_file()
            unknown = set(svc.get("environment", {})) - known
            assert not unknown, f"{name}: settings that no service reads: {unknown}"
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown service {dep}"
        assert "healthcheck" in svc or svc.get("restart") == "no", f"{name} has no healthcheck"
    for volume in compose.get("volumes", {}):
        assert any(v.startswith(f"{volume}:") for s in services.values() for v in s.get("volumes", []))


def test_helm_chart_has_probes_and_values():
    chart = yaml.safe_load((ROOT / "k8s" / "star" / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "star"
    values = yaml.safe_load((ROOT / "k8s" / "star" / "values.yaml").read_text())
    template = (ROOT / "k8s" / "star" / "templates" / "sandbox.yaml").read_text()
    assert "path: /healthz" in template and "path: /readyz" in template
    for ref in ("sandbox.replicas", "sandbox.port", "sandbox.workers", "database.url", "redis.url", "image.repository"):
        assert f".Values.{ref}" in template
        node = values
        for part in ref.split("."):
            node = node[part]
