"""docker-compose.yml validates against the Compose Specification's JSON schema and is wired consistently:
ports on loopback only, mounted files present, the API's configuration valid, locust's keys known to it.

The schema is the copy that the PyPI package check-jsonschema ships (vendor.compose-spec, from the
compose-spec project, Apache-2.0), read from the installed package: nothing is downloaded at test time.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from importlib import resources
from pathlib import Path

import pytest
import yaml

from headbudget.service.settings import load_config
from tests.ops.promql import ROOT

COMPOSE = ROOT / "docker-compose.yml"
SERVICES = {"api", "redis", "prometheus", "grafana", "locust"}


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _validator():  # type: ignore[no-untyped-def]
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("check_jsonschema", reason="check-jsonschema (dev extra) ships the compose schema")
    schema_file = resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def test_compose_file_validates_against_the_compose_spec_schema() -> None:
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in _validator().iter_errors(_compose())]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(servces={}),
    lambda d: d["services"]["api"].update(restart_policy="always"),
    lambda d: d["services"]["redis"]["healthcheck"].update(interval=5),
    lambda d: d["services"]["api"]["depends_on"]["redis"].update(condition="when_ready"),
])
def test_schema_rejects_mistakes(mutate) -> None:  # type: ignore[no-untyped-def]
    """The validation is real: typical mistakes do not pass."""
    doc = copy.deepcopy(_compose())
    mutate(doc)
    assert list(_validator().iter_errors(doc))


def test_services_and_pinned_images() -> None:
    services = _compose()["services"]
    assert set(services) == SERVICES
    assert services["api"]["build"]["dockerfile"] == "Dockerfile"
    for name, svc in services.items():
        if "image" in svc and name != "api":
            assert re.fullmatch(r"[\w./-]+:[\w.-]+", svc["image"]) and not svc["image"].endswith(":latest"), name


def test_every_published_port_is_on_loopback() -> None:
    for name, svc in _compose()["services"].items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond this machine"


def test_bind_mounts_exist() -> None:
    for name, svc in _compose()["services"].items():
        for vol in svc.get("volumes", []):
            if isinstance(vol, dict) and vol["type"] == "bind" and not vol["source"].startswith("${"):
                assert (ROOT / vol["source"]).exists(), f"{name}: {vol['source']} does not exist"


def test_api_configuration_is_valid_and_shares_state_in_redis() -> None:
    api = _compose()["services"]["api"]
    mounts = {m["target"]: m for m in api["volumes"]}
    config_mount = mounts["/etc/headbudget/service.toml"]
    assert config_mount["read_only"] is True
    cfg = load_config(ROOT / config_mount["source"])
    assert int(api["environment"]["WORKERS"]) > 1
    assert cfg.state.redis_url.startswith("redis://redis:6379"), "workers > 1 need the shared Redis state"
    assert "/models/current" in mounts
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"
    assert int(api["stop_grace_period"].rstrip("s")) > cfg.server.graceful_timeout_s


def test_locust_keys_are_keys_of_the_compose_configuration() -> None:
    services = _compose()["services"]
    cfg = load_config(ROOT / next(m["source"] for m in services["api"]["volumes"]
                                  if m["target"] == "/etc/headbudget/service.toml"))
    hashes = {k.sha256: k.tier for k in cfg.keys}
    for tier in ("cheap", "balanced", "quality"):
        value = services["locust"]["environment"][f"HEADBUDGET_KEY_{tier.upper()}"]
        default = re.fullmatch(r"\$\{HEADBUDGET_KEY_\w+:-(.+)\}", value).group(1)
        assert hashes.get(hashlib.sha256(default.encode()).hexdigest()) == tier
        assert default in (ROOT / "docs" / "operations.md").read_text(), "document the development keys"
    locustfile = next(m for m in services["locust"]["volumes"] if m["type"] == "bind")
    assert (ROOT / locustfile["source"] / "locustfile.py").is_file()
    assert services["locust"]["command"][:2] == ["-f", f"{locustfile['target']}/locustfile.py"]


def test_prometheus_mounts_its_configuration_and_reaches_the_api() -> None:
    services = _compose()["services"]
    prom = services["prometheus"]
    mount = next(m for m in prom["volumes"] if isinstance(m, dict) and m["target"] == "/etc/prometheus")
    assert Path(ROOT / mount["source"], "prometheus.yml").is_file()
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert "127.0.0.1:8000:8000" in services["api"]["ports"]


def test_redis_keeps_usage_on_a_volume() -> None:
    redis = _compose()["services"]["redis"]
    cmd = redis["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes" and cmd[cmd.index("--dir") + 1] == "/data"
    assert any(str(v).endswith(":/data") for v in redis["volumes"])
