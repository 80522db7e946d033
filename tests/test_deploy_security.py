"""Secure defaults of the deployment files: Redis requires a password everywhere (chart, Compose),
secrets are stable across renders when given or taken from an existing Secret, NetworkPolicies
fence the release's pods."""

from __future__ import annotations

import pytest

from tests.test_deploy_files import _by_kind, render_chart, validation_problems


def _redis(docs):
    return _by_kind(docs, "StatefulSet")["star-redis"]["spec"]["template"]["spec"]["containers"]


def test_redis_requires_a_password_from_the_secret():
    docs = render_chart()
    assert validation_problems(docs) == []
    redis, exporter = _redis(docs)
    assert "--requirepass" in redis["command"] and "$(STAR_REDIS_PASSWORD)" in redis["command"]
    assert "--protected-mode" not in redis["command"]  # on, Redis's default
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in redis["env"] + exporter["env"]}
    assert (
        refs["STAR_REDIS_PASSWORD"]
        == refs["REDISCLI_AUTH"]
        == refs["REDIS_PASSWORD"]
        == {"name": "star-secrets", "key": "STAR_REDIS_PASSWORD"}
    )
    generated = _by_kind(docs, "Secret")["star-secrets"]["stringData"]["STAR_REDIS_PASSWORD"]
    assert len(generated) >= 32
    # every service gets it through the shared Secret; the URL in the ConfigMap carries none
    assert "@" not in _by_kind(docs, "ConfigMap")["star-env"]["data"]["STAR_REDIS_URL"]


def test_a_given_password_is_stable_across_renders():
    values = {"redis": {"auth": {"password": "given-pw-1234"}}}
    first, second = (_by_kind(render_chart(values), "Secret")["star-secrets"]["stringData"] for _ in range(2))
    assert first["STAR_REDIS_PASSWORD"] == second["STAR_REDIS_PASSWORD"] == "given-pw-1234"


def test_an_existing_secret_replaces_the_generated_password():
    docs = render_chart({"redis": {"auth": {"existingSecret": "my-redis"}}})
    assert validation_problems(docs) == []
    assert "STAR_REDIS_PASSWORD" not in _by_kind(docs, "Secret")["star-secrets"]["stringData"]
    redis, _ = _redis(docs)
    assert {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in redis["env"]}[
        "STAR_REDIS_PASSWORD"
    ] == "my-redis"
    sandbox = _by_kind(docs, "Deployment")["star-sandbox"]["spec"]["template"]["spec"]["containers"][0]
    assert {"secretRef": {"name": "my-redis"}} in sandbox["envFrom"]


def test_existing_secrets_reach_every_pod_and_make_renders_repeatable():
    """GitOps renders offline (`helm template`: no live Secret to read back), so only given secrets are
    stable: with both existing Secrets and the database password given, two renders are the same, and
    every pod of ours, the controller Job's and a multi-node learner's included, reads both Secrets."""
    from tests.test_deploy_files import _pod_specs

    values = {
        "redis": {"auth": {"existingSecret": "my-redis"}},
        "auth": {"existingSecret": "my-token"},
        "postgresql": {"auth": {"password": "pg-pw"}},
        "train": {"enabled": True},
        "learner": {"nodes": 2},
    }
    first, second = render_chart(values), render_chart(values)
    assert first == second
    assert validation_problems(first) == []
    secret = _by_kind(first, "Secret")["star-secrets"]["stringData"]
    assert "STAR_REDIS_PASSWORD" not in secret and "STAR_API_TOKEN" not in secret
    checked = 0
    for owner, template in _pod_specs(first):
        for c in template["spec"]["containers"] + template["spec"].get("initContainers", []):
            if not c["image"].startswith("ghcr.io/star-train/star:"):
                continue
            refs = [r["secretRef"]["name"] for r in c.get("envFrom", []) if "secretRef" in r]
            assert {"my-redis", "my-token"} <= set(refs), f"{owner['metadata']['name']}/{c['name']}: {refs}"
            checked += 1
    assert checked >= 10
    # the Redis server and its exporter read the password from the same existing Secret
    redis, exporter = _redis(first)
    refs = [e["valueFrom"]["secretKeyRef"] for e in redis["env"] + exporter["env"]]
    assert refs and all(r == {"name": "my-redis", "key": "STAR_REDIS_PASSWORD"} for r in refs)
    # without them, an offline render makes new random secrets each time (an online install reads them
    # back from the live Secret instead): what docs/deployment.md warns about
    plain = [_by_kind(render_chart(), "Secret")["star-secrets"]["stringData"] for _ in range(2)]
    assert plain[0]["STAR_REDIS_PASSWORD"] != plain[1]["STAR_REDIS_PASSWORD"]


def test_network_policy_admits_only_the_release_and_the_named_peers():
    docs = render_chart({"networkPolicy": {"httpFrom": [{"namespaceSelector": {"matchLabels": {"name": "ingress"}}}]}})
    assert validation_problems(docs) == []
    policy = _by_kind(docs, "NetworkPolicy")["star-ingress"]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app.kubernetes.io/instance": "star"}
    own, metrics, http = policy["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "star"}}}]}
    assert {p["port"] for p in metrics["ports"]} == {8000, 9121}
    assert http["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert "NetworkPolicy" not in {d["kind"] for d in render_chart({"networkPolicy": {"enabled": False}})}


@pytest.mark.parametrize("service", ["redis"])
def test_compose_redis_requires_a_password(service):
    import yaml

    from tests.test_deploy_files import ROOT

    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    command = " ".join(compose["services"][service]["command"])
    assert "--requirepass" in command and "STAR_REDIS_PASSWORD" in command
    assert "STAR_REDIS_PASSWORD" in compose["x-star-env"]
