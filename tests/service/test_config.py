"""service.toml parsing, `headbudget keys`, the client against an in-process app, and the import boundary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from headbudget.client import AsyncClient, HeadbudgetError
from headbudget.service.accounting.auth import hash_key
from headbudget.service.settings import ConfigError, load_config, parse_config
from tests.service.conftest import KEYS, config_dict, running_app

ROOT = Path(__file__).resolve().parents[2]


def test_committed_example_config_is_valid() -> None:
    config = load_config(ROOT / "service.toml")
    assert {"cheap", "balanced", "quality"} <= set(config.tiers)
    assert config.development.anonymous_tier is None  # no anonymous access unless an operator says so
    assert config.tiers["quality"].priority > config.tiers["cheap"].priority


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["tiers"]["cheap"].update(default_budget=0.9), "above max_budget"),
    (lambda d: d["tiers"]["cheap"].update(max_budget=1.5), "max_budget"),
    (lambda d: d["tiers"]["flex"].update(min_budget=0.05), "min_budget"),
    (lambda d: d["tiers"]["cheap"].update(rate_limit=0), "rate_limit"),
    (lambda d: d["tiers"]["cheap"].update(colour="red"), "colour"),
    (lambda d: d["keys"].append({"sha256": "0" * 64, "tier": "gold"}), "gold"),
    (lambda d: d["keys"].append({"sha256": "not-a-hash", "tier": "cheap"}), "sha256"),
    (lambda d: d.update(development={"anonymous_tier": "gold"}), "gold"),
    (lambda d: d.update(tiers={}), "at least one"),
    (lambda d: d.update(state={"on_error": "maybe"}), "on_error"),
])
def test_bad_configs_are_refused(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    d = config_dict()
    mutate(d)
    with pytest.raises(ConfigError, match=message):
        parse_config(d)


def test_load_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("[tiers\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "bad.toml")


def test_keys_add_prints_a_key_once_and_stores_only_its_hash(tmp_path: Path) -> None:
    config = tmp_path / "service.toml"
    config.write_text((ROOT / "service.toml").read_text())
    cmd = [sys.executable, "-m", "headbudget.cli", "keys", "add", "--tier", "cheap", "--config", str(config),
           "--name", "alice"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip()
    assert key.startswith("hb_") and len(key) > 30 and key not in r.stderr
    text = config.read_text()
    assert key not in text and hash_key(key) in text
    loaded = load_config(config)
    assert [(k.tier, k.name) for k in loaded.keys] == [("cheap", "alice")]
    listed = subprocess.run([sys.executable, "-m", "headbudget.cli", "keys", "list", "--config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert "alice" in listed.stdout and key not in listed.stdout
    bad = subprocess.run([*cmd[:6], "gold", *cmd[7:]], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "gold" in bad.stderr


# The engine interface speaks execution plans, which models/ owns: the service may load the plan and
# what it is made of (torch-free, numpy only), and nothing else of models/, training or torch.
PLAN_MODULES = ("headbudget.models", "headbudget.models.plan", "headbudget.models.budget", "headbudget.models.config",
                "headbudget.models.model_types")


def test_service_imports_no_torch_and_only_the_plan_of_models() -> None:
    code = ("import sys, headbudget.service.app, headbudget.service.server, headbudget.client; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('headbudget.models', "
            f"'headbudget.training', 'torch.')) and m not in {PLAN_MODULES!r}]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.anyio
async def test_async_client_round_trip() -> None:
    async with running_app() as (inner, app, _):
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient("http://test", api_key=KEYS["balanced"], transport=transport) as hb:
            answer = await hb.classify(["a", "b"], budget=0.5)
            assert [r.budget_applied for r in answer.results] == [0.5, 0.5]
            fb = await hb.feedback(answer.request_id, answer.results[0].label)
            assert fb.correct
            assert (await hb.models()).data[0].heads_total == 8
            assert (await hb.ready()).status == "ready"
            assert "headbudget_requests_total" in await hb.metrics()
            with pytest.raises(HeadbudgetError) as e:
                await hb.classify("x", budget=0.05)
            assert e.value.status == 422 and e.value.code == "invalid_request"
        async with AsyncClient("http://test", api_key=KEYS["cheap"], transport=transport) as cheap:
            with pytest.raises(HeadbudgetError) as e:
                await cheap.classify("x", budget=1.0)
            assert e.value.status == 403 and e.value.request_id


def test_the_tiers_default_budgets_are_the_engines_prepacked_budgets(tmp_path: Path) -> None:
    from headbudget.service.settings import ServeSettings

    config = parse_config(config_dict())  # cheap 0.25, balanced 0.5, quality 1.0 (flex: its own default)
    budgets = config.default_budgets()
    assert budgets == tuple(sorted({t.default_cap for t in config.tiers.values()})) and 0.25 in budgets
    settings = ServeSettings(model_dir=tmp_path, config_path=tmp_path / "service.toml")
    assert settings.engine_options(budgets).prepacked_budgets == budgets
    assert settings.engine_options().prepacked_budgets == (0.25, 0.5)  # the engine's own default otherwise


@pytest.mark.parametrize("path", ["service.toml", "docker/service.toml", "docker/service.compose.toml",
                                  "deploy/kubernetes/base/service.toml"])
def test_every_shipped_config_meters_every_tier(path: str) -> None:
    """A deployment without compute quotas would limit tenants per request only, whatever each one costs."""
    cfg = load_config(Path(__file__).resolve().parents[2] / path)
    for tier in cfg.tiers.values():
        assert tier.compute_per_minute and tier.max_request_compute, (path, tier.name)
