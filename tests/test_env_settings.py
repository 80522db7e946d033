"""Environment variables carry addresses, ports and secrets; a process's other settings come from its typed
config (the recipe, or the file the controller writes for it). So no module of `services/` reads a `STAR_*`
variable by hand outside services/common/settings.py, except the allow-listed ones below."""

from __future__ import annotations

import re
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[1] / "services"
READ = re.compile(r"""(?:os\.environ\.get|os\.getenv|os\.environ\[|environ\.get)\(?\s*["'](STAR_[A-Z0-9_]+)["']""")
# Each of these is an address, a port range, a secret or a path read where no Settings object is at hand:
ALLOWED = {
    "STAR_EPISODES_URL",  # address: the episode API, read by the outside trainers' adapters (services/environments)
    "STAR_API_TOKEN",  # secret: their bearer token
    "STAR_DB_URL",  # address: the world, set by `star sandbox|reward serve --db` for their uvicorn workers
    "STAR_PORT_SLICE",  # ports: the slice of free ports a test worker draws from (services/common/redis.py)
    "STAR_FLEET_ENV",  # path: the env file `star up` writes the fleet's addresses to (services/controller/local.py)
    "STAR_QA_INDEX",  # path: the passage index `star qa serve --index` hands its uvicorn workers
}


def env_reads() -> dict[str, list[str]]:
    """Each STAR_* variable read by hand in services/, with where."""
    found: dict[str, list[str]] = {}
    for path in sorted(SERVICES.rglob("*.py")):
        if path == SERVICES / "common" / "settings.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in READ.findall(line):
                found.setdefault(name, []).append(f"{path.relative_to(SERVICES.parent)}:{number}")
    return found


def test_services_read_only_addresses_ports_and_secrets_from_the_environment():
    unexpected = {name: where for name, where in env_reads().items() if name not in ALLOWED}
    assert unexpected == {}, "a setting read from the environment: make it a field of the role's typed config"


def test_the_check_sees_a_read():
    assert READ.findall('x = float(os.environ.get("STAR_REDIS_DOWN_LIMIT_S", "300"))') == ["STAR_REDIS_DOWN_LIMIT_S"]
