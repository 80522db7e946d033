"""The address an external fleet's servers meet the learner at for the NCCL weight group: configured,
or this host's address on the route to the first server; and how RLConfig's `auto` resolves."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from services.weights.nccl import announced_master, resolve_master, route_address


def test_a_configured_address_is_announced_with_the_port_setting_or_its_own():
    servers = ["http://rollout-0.rollout:8080"]
    assert announced_master("10.4.2.7", 29731, servers) == ("10.4.2.7", 29731)
    assert announced_master("10.4.2.7:4000", 29731, servers) == ("10.4.2.7", 4000)
    assert announced_master("[fd00::7]", 29731, servers) == ("fd00::7", 29731)


def test_without_one_the_address_on_the_route_to_the_first_server_is_announced():
    assert route_address("http://127.0.0.1:8080") == "127.0.0.1"
    ours = socket.gethostbyname(socket.gethostname())
    try:
        found = route_address(f"http://{ours}:8080")
    except OSError:
        pytest.skip("this host has no address of its own to route to")
    assert found == ours
    assert announced_master(None, 29800, [f"http://{ours}:8080"]) == (ours, 29800)


def test_loopback_is_refused_for_servers_on_other_hosts(monkeypatch):
    import services.weights.nccl as nm

    monkeypatch.setattr(nm, "route_address", lambda url: "127.0.0.1")
    with pytest.raises(ValueError, match="STAR_NCCL_MASTER_ADDR"):
        announced_master(None, 29731, ["http://10.9.0.3:8080"])
    assert announced_master(None, 29731, ["http://127.0.0.1:8080"]) == ("127.0.0.1", 29731)  # one host: fine
    with pytest.raises(ValueError, match="none are configured"):
        announced_master(None, 29731, [])


def test_rl_config_auto_takes_the_settings_and_host_port_is_kept():
    settings = SimpleNamespace(nccl_master_addr="10.1.1.5", nccl_port=29999)
    assert resolve_master("auto", ["http://10.1.1.9:8080"], settings) == ("10.1.1.5", 29999)
    assert resolve_master("127.0.0.1:4242", [], settings) == ("127.0.0.1", 4242)


def test_the_settings_read_the_environment(monkeypatch):
    from services.common.settings import get_settings

    monkeypatch.setenv("STAR_NCCL_MASTER_ADDR", "10.7.0.2")
    monkeypatch.setenv("STAR_NCCL_PORT", "31000")
    get_settings.cache_clear()
    try:
        s = get_settings()
        assert (s.nccl_master_addr, s.nccl_port) == ("10.7.0.2", 31000)
    finally:
        get_settings.cache_clear()
