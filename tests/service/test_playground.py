"""/docs and /playground in headless Chromium that can reach 127.0.0.1 only: Swagger UI renders from the installed
package's assets, and the playground shows what the API answers for the same request, errors included."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.browser import Browser, chromium
from tests.conftest import make_random_checkpoint
from tests.service.conftest import KEYS, Server, config_dict, engine_factory_available, start_server, toml_of

pytestmark = pytest.mark.slow
if (_why := engine_factory_available()) is not None:
    pytest.skip(_why, allow_module_level=True)

TEXT = "the match went to extra time before the home side scored"
# A made-up sweep (test data, not a measurement), so that the page has a curve to draw.
SWEEP: dict[str, Any] = {"dense_accuracy": 0.9, "points": [{"budget": round(0.1 + 0.05 * i, 2), "accuracy_hard": 0.6 + 0.015 * i}
                                           for i in range(19)]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    ckpt = make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-playground", seed=13, scope="model",
                                  ffn_group=32, exits=(1,))
    (ckpt / "sweep.json").write_text(json.dumps(SWEEP))
    with start_server(ckpt, toml_of(config_dict()), tmp_path_factory.mktemp("playground")) as s:
        yield s


@pytest.fixture(scope="module")
def browser(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    with chromium(tmp_path_factory.mktemp("chromium")) as b:
        yield b


def resources(browser: Browser) -> list[str]:
    """Every URL the page has loaded or tried to (scripts, styles, fetches)."""
    return list(browser.run("return performance.getEntriesByType('resource').map(e => e.name)"))


def test_the_browser_has_no_network_beyond_loopback(browser: Browser, server: Server) -> None:
    browser.get(f"{server.url}/healthz")
    with pytest.raises(Exception, match="ERR_"):  # ERR_PROXY_CONNECTION_FAILED or ERR_NAME_NOT_RESOLVED
        browser.get("https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css")


def test_docs_render_swagger_ui_from_local_assets(browser: Browser, server: Server) -> None:
    browser.get(f"{server.url}/docs")
    paths = browser.wait(lambda: browser.run(
        "return [...document.querySelectorAll('.opblock-summary-path')].map(e => e.textContent)"),
        "Swagger UI lists the operations")
    assert "/classify" in [p.replace("\u200b", "") for p in paths]
    loaded = resources(browser)
    assert any(u.endswith("/docs/static/swagger-ui-bundle.js") for u in loaded), loaded
    assert all(u.startswith(server.url) for u in loaded), loaded


def test_redoc_renders_from_local_assets(browser: Browser, server: Server) -> None:
    browser.get(f"{server.url}/redoc")
    title = browser.wait(lambda: browser.run("const h = document.querySelector('.api-info h1');"
                                             "return h && h.textContent"), "ReDoc shows the API's title")
    assert title.startswith("headbudget")
    loaded = resources(browser)
    assert any(u.endswith("/docs/static/redoc.standalone.js") for u in loaded), loaded
    # ReDoc's menu links a logo on its CDN, which it hides when the image does not load; the page forbids it.
    assert all(u.startswith(server.url) for u in loaded if not u.startswith("https://cdn.redoc.ly/")), loaded


def classify_in_page(browser: Browser, key: str, text: str, budget: float) -> None:
    browser.type("#key", key)
    browser.type("#text", text)
    browser.run("const s = document.getElementById('budget'); s.value = arguments[0];"
                "s.dispatchEvent(new Event('input'));", str(budget))
    browser.run("document.getElementById('result').hidden = true; document.getElementById('error').hidden = true;")
    browser.click("#classify")
    browser.wait(lambda: browser.run("return !document.getElementById('result').hidden || "
                                     "!document.getElementById('error').hidden"), "an answer or an error shown")


def api(server: Server, key: str, text: str, budget: float) -> httpx.Response:
    return httpx.post(f"{server.url}/classify", json={"text": text, "budget": budget}, headers={"X-API-Key": key},
                      timeout=30)


def percent(shown: str) -> float:
    m = re.match(r"([\d.]+)%", shown)
    assert m, shown
    return float(m.group(1)) / 100


def test_playground_shows_what_the_api_answers(browser: Browser, server: Server) -> None:
    browser.get(f"{server.url}/playground")
    browser.wait(lambda: browser.run("return document.querySelectorAll('#curve circle.point').length"),
                 "the accuracy curve drawn")
    assert browser.run("return document.querySelectorAll('#curve circle.point').length") == len(SWEEP["points"])
    classify_in_page(browser, KEYS["balanced"], TEXT, 0.35)
    assert browser.run("return document.getElementById('error').hidden"), browser.text("#error")
    r = api(server, KEYS["balanced"], TEXT, 0.35)
    assert r.status_code == 200, r.text
    res: dict[str, Any] = r.json()["results"][0]
    assert browser.text("#label") == res["label"]
    assert percent(browser.text("#cost")) == pytest.approx(res["cost"], abs=0.0005)  # shown to 0.1 %
    assert browser.text("#budget-applied").startswith("0.35 asked, 0.35 applied")
    assert browser.text("#heads") == f"{res['heads_active']} of {res['heads_total']}"
    assert browser.text("#neurons") == f"{res['neurons_active']} of {res['neurons_total']}"
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    point = next(p for p in card["budgets"] if p["budget"] == pytest.approx(0.35))
    layers = point["layers_run"] if point["layers_run"] is not None else card["n_layers"]
    assert browser.text("#layers") == f"{layers} of {card['n_layers']}"
    assert "round trip" in browser.text("#latency")
    scores = browser.run("return [...document.querySelectorAll('#scores .name')].map(e => e.textContent)")
    assert sorted(scores) == sorted(res["scores"])
    assert browser.run("return document.getElementById('marker').dataset.budget") == "0.35"
    loaded = resources(browser)
    assert all(u.startswith(server.url) for u in loaded), loaded


def test_playground_shows_the_servers_error(browser: Browser, server: Server) -> None:
    browser.get(f"{server.url}/playground")
    classify_in_page(browser, "hb_not_a_key", TEXT, 0.5)
    message = api(server, "hb_not_a_key", TEXT, 0.5).json()["error"]["message"]
    assert browser.text("#error") == f"401 unauthorized: {message}"
    classify_in_page(browser, KEYS["cheap"], TEXT, 0.9)  # over the cheap tier's max_budget of 0.5
    r = api(server, KEYS["cheap"], TEXT, 0.9)
    assert r.status_code == 403
    assert browser.text("#error") == f"403 {r.json()['error']['code']}: {r.json()['error']['message']}"


def test_pages_send_their_assets_and_a_strict_policy(server: Server) -> None:
    page = httpx.get(f"{server.url}/playground")
    assert page.status_code == 200 and "default-src 'none'" in page.headers["content-security-policy"]
    for asset in ("playground.js", "playground.css"):
        assert httpx.get(f"{server.url}/playground/assets/{asset}").status_code == 200
    docs = httpx.get(f"{server.url}/docs").text
    assert "cdn.jsdelivr.net" not in docs and "/docs/static/swagger-ui-bundle.js" in docs
    assert "/playground" not in httpx.get(f"{server.url}/openapi.json").json()["paths"]
    assert httpx.get(f"{server.url}/redoc").headers["content-security-policy"] == "img-src 'self' data:"
