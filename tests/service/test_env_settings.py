"""Settings from the environment (pydantic-settings): HEADBUDGET_<TABLE>__<KEY> over service.toml, the options of
`headbudget serve` (a flag wins), one-line refusals naming the variable, and the int8 default, on a real server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from headbudget.service.settings import SERVE_ENV, ConfigError, ServeSettings, load_config, serve_env
from tests.service.conftest import config_dict, service_env, start_server, toml_of

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test config as a file, with no HEADBUDGET_ variable inherited from the caller's environment."""
    import os

    for name in list(os.environ):
        if name.upper().startswith("HEADBUDGET_"):
            monkeypatch.delenv(name)
    path = tmp_path / "service.toml"
    path.write_text(toml_of(config_dict(max_batch_size=32)))
    return path


def test_variables_override_the_file_which_stays_the_base(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = load_config(config)
    monkeypatch.setenv("HEADBUDGET_SERVER__MAX_BATCH_SIZE", "8")
    monkeypatch.setenv("HEADBUDGET_STATE__REDIS_URL", "redis://redis:6379/0")
    monkeypatch.setenv("headbudget_server__fast_path", "false")  # names are case-insensitive
    monkeypatch.setenv("HEADBUDGET_TIERS__CHEAP__MAX_BUDGET", "0.3")
    monkeypatch.setenv("HEADBUDGET_DEVELOPMENT", '{"anonymous_tier": "cheap"}')  # a whole table as JSON
    cfg = load_config(config)
    assert (cfg.server.max_batch_size, cfg.server.fast_path, cfg.state.redis_url) == (8, False, "redis://redis:6379/0")
    assert cfg.tiers["cheap"].max_budget == 0.3 and cfg.development.anonymous_tier == "cheap"
    # everything not named comes from the file
    assert cfg.server.max_wait_ms == base.server.max_wait_ms == 5.0
    assert cfg.tiers["cheap"].default_budget == base.tiers["cheap"].default_budget
    assert cfg.tiers["quality"] == base.tiers["quality"] and cfg.keys == base.keys


def test_other_headbudget_variables_are_not_settings(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HEADBUDGET_SERVE (how serve hands its settings to workers), the data folder and the load test's keys
    share the prefix but are no setting: they neither change nor break the config."""
    settings = ServeSettings(model_dir=Path("/m"), config_path=config, precision="fp32", threads=2)
    monkeypatch.setenv(SERVE_ENV, settings.to_env())
    monkeypatch.setenv("HEADBUDGET_DATA", "/data")
    monkeypatch.setenv("HEADBUDGET_KEY_CHEAP", "hb-dev")
    monkeypatch.setenv("HEADBUDGET_SERVER__MAX_BATCH_SIZE", "4")
    assert load_config(config).server.max_batch_size == 4
    assert ServeSettings.from_env() == settings
    env = serve_env()
    assert (env.model_dir, env.precision, env.threads) == (None, None, None)


@pytest.mark.parametrize("name, value, message", [
    ("HEADBUDGET_SERVER__MAX_BATCH_SIZE", "abc", "HEADBUDGET_SERVER__MAX_BATCH_SIZE: Input should be a valid integer"),
    ("HEADBUDGET_SERVER__MAX_BATCH_SIZE", "0", "HEADBUDGET_SERVER__MAX_BATCH_SIZE: Input should be greater than"),
    ("HEADBUDGET_SERVER__MAX_BATCH_SIZ", "8", "HEADBUDGET_SERVER__MAX_BATCH_SIZ: Extra inputs are not permitted"),
    ("HEADBUDGET_STATE__ON_ERROR", "maybe", "HEADBUDGET_STATE__ON_ERROR: Input should be 'open' or 'closed'"),
    ("HEADBUDGET_SERVER", "{not json", "HEADBUDGET_SERVER: not valid JSON"),
    ("HEADBUDGET_SERVER", '{"queue_size": -1}', "HEADBUDGET_SERVER: Input should be greater than or equal to 1"),
    ("HEADBUDGET_TIERS__GOLD__MAX_BUDGET", "1", "HEADBUDGET_TIERS__GOLD: no tier 'gold' in the config file"),
    ("HEADBUDGET_TIERS__CHEAP__MAX_BUDGET", "0.2",
     "tiers.cheap (with HEADBUDGET_TIERS__CHEAP__MAX_BUDGET from the environment): Value error, default_budget"),
    ("HEADBUDGET_DEVELOPMENT__ANONYMOUS_TIER", "gold", "with HEADBUDGET_DEVELOPMENT__ANONYMOUS_TIER from the environment: "
     "Value error, development.anonymous_tier = 'gold' is not a defined tier"),
])
def test_a_bad_value_is_refused_in_one_line_naming_the_variable(config: Path, monkeypatch: pytest.MonkeyPatch,
                                                                name: str, value: str, message: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        load_config(config)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_serve_options_from_the_environment(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HEADBUDGET_MODEL_DIR", "/models/current")
    monkeypatch.setenv("HEADBUDGET_PRECISION", "fp32")
    monkeypatch.setenv("HEADBUDGET_THREADS", "2")
    monkeypatch.setenv("HEADBUDGET_CONFIG", str(config))
    env = serve_env()
    assert (env.model_dir, env.precision, env.threads, env.config) == (Path("/models/current"), "fp32", 2, config)
    for name, value in (("HEADBUDGET_THREADS", "0"), ("HEADBUDGET_PRECISION", "fp16"), ("HEADBUDGET_PORT", "x")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ConfigError, match=f"^{name}: "):
            serve_env()
        monkeypatch.delenv(name)


def _serve(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in service_env().items() if not k.upper().startswith("HEADBUDGET_")}
    return subprocess.run([sys.executable, "-m", "headbudget.cli", "serve", *args], capture_output=True, text=True,
                          timeout=120, env={**base, **env})


@pytest.mark.parametrize("env, message", [
    ({"HEADBUDGET_SERVER__MAX_BATCH_SIZE": "lots"}, "HEADBUDGET_SERVER__MAX_BATCH_SIZE: Input should be a valid integer"),
    ({"HEADBUDGET_PRECISION": "fp16"}, "HEADBUDGET_PRECISION: Input should be 'fp32' or 'int8'"),
    ({"HEADBUDGET_MODEL_DIR": "/nowhere"}, "HEADBUDGET_MODEL_DIR: folder '/nowhere' does not exist"),
])
def test_serve_refuses_a_bad_variable_in_one_line(tiny_checkpoint: Path, config: Path, env: dict[str, str],
                                                  message: str) -> None:
    args = ["--config", str(config)] + ([] if "HEADBUDGET_MODEL_DIR" in env else ["--model", str(tiny_checkpoint)])
    r = _serve(args, env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"headbudget serve: error: {message}"), r.stderr


def test_serve_without_a_model_names_both_ways(config: Path) -> None:
    r = _serve(["--config", str(config)], {})
    assert r.returncode == 2 and r.stderr.strip() == \
        "headbudget serve: error: --model is required (or set HEADBUDGET_MODEL_DIR)"


def _info(url: str) -> dict[str, object]:
    return dict(httpx.get(f"{url}/info", timeout=10).json())


@pytest.mark.slow
def test_real_server_takes_its_settings_from_the_environment(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """int8 by default; the batch size from HEADBUDGET_SERVER__MAX_BATCH_SIZE; HEADBUDGET_PRECISION=fp32 gives
    fp32 and a --precision flag beats it."""
    toml = toml_of(config_dict(max_batch_size=32))
    with start_server(tiny_checkpoint, toml, tmp_path / "default",
                      env={"HEADBUDGET_SERVER__MAX_BATCH_SIZE": "8"}) as s:
        info = _info(s.url)
        assert (info["model_dtype"], info["max_batch_requests"]) == ("int8", 8)
        assert "precision int8 (the default" in s.logs()
    with start_server(tiny_checkpoint, toml, tmp_path / "fp32", env={"HEADBUDGET_PRECISION": "fp32"}) as s:
        assert (_info(s.url)["model_dtype"], _info(s.url)["max_batch_requests"]) == ("float32", 32)
    with start_server(tiny_checkpoint, toml, tmp_path / "flag", extra=("--precision", "int8"),
                      env={"HEADBUDGET_PRECISION": "fp32"}) as s:
        assert _info(s.url)["model_dtype"] == "int8"
    assert json.loads((tiny_checkpoint / "config.json").read_text())  # the checkpoint itself is untouched
