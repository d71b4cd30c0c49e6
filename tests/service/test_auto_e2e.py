"""budget=auto against a real server on a real (smoke-trained) BudgetFormer checkpoint."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx

from tests.service.conftest import KEYS, start_server, toml_of
from tests.service.test_e2e import e2e_config, h

TEXTS = ["red marker two blue green pink red white marker two black gray blue red brown pink",
         "marker one a b c marker one a b c", "plain words and nothing else in this one at all"]


def test_auto_answers_with_each_texts_predicted_budget(budgetformer_smoke: Path, tmp_path: Path) -> None:
    d = e2e_config()
    d["tiers"]["balanced"]["default_budget"] = "auto"  # a tier may default to auto on this checkpoint
    with start_server(budgetformer_smoke, toml_of(d), tmp_path) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        auto = c.post("/classify?budget=auto", json={"texts": TEXTS}, headers=h("quality"))
        assert auto.status_code == 200, auto.text
        results = auto.json()["results"]
        for r in results:
            assert r["budget_requested"] == "auto" and r["budget_applied"] == 1.0  # quality: max_budget 1.0
            assert r["budget_chosen"] == r["heads_active"] / r["heads_total"]
            assert 0 < r["heads_active"] <= r["heads_total"] == 8  # tiny base: 2 layers x 4 heads
        default = c.post("/classify", json={"text": TEXTS[0]}, headers=h("balanced"))
        assert default.status_code == 200 and default.json()["budget_source"] == "tier_default"
        capped = c.post("/classify?budget=0.25", json={"text": TEXTS[0]}, headers={"X-API-Key": KEYS["quality"]})
        assert capped.status_code == 200
        assert capped.json()["results"][0]["heads_active"] <= 2  # cap: round(0.25 * 4) = 1 head per layer
        assert capped.json()["results"][0]["budget_applied"] == 0.25
        assert capped.json()["results"][0]["heads_active"] <= results[0]["heads_active"]
        card = c.get("/v1/models").json()["data"][0]
        assert card["supports_auto"] is True
        bought = {p["budget"]: p["heads_active"] for p in card["budgets"]}
        assert bought[1.0] == 8 and bought[0.25] == 2  # the cap: round(b * 4) heads in each of 2 layers
        metrics = c.get("/metrics").text
        assert 'budget="auto"' in metrics


def test_a_decider_made_while_serving_is_taken_without_a_restart(smoke_model_scope_checkpoint: Path,
                                                                  tmp_path: Path) -> None:
    """`serve --decider-data` on a checkpoint without decider.json (as `make run` starts it): the server answers at
    once, budget=auto is a 503 (not yet) until the decider made in the background is written, then the same server (same
    process) runs auto through it."""
    folder = tmp_path / "ckpt"
    shutil.copytree(smoke_model_scope_checkpoint, folder, ignore=shutil.ignore_patterns("onnx", "decider.json"))
    access = tmp_path / "logs" / "access.log"
    extra = ("--decider-data", "synthetic", "--access-log", str(access))
    with start_server(folder, toml_of(e2e_config()), tmp_path / "srv", extra=extra) as s, \
            httpx.Client(base_url=s.url, timeout=30) as c:
        first = c.post("/classify?budget=auto", json={"text": TEXTS[0]}, headers=h("quality"))
        assert first.status_code == 503 and "making the checkpoint's decider" in first.json()["error"]["message"]
        assert int(first.headers["retry-after"]) > 0
        assert c.post("/classify?budget=0.5", json={"text": TEXTS[0]}, headers=h("quality")).status_code == 200
        deadline = time.monotonic() + 300
        while (auto := c.post("/classify?budget=auto", json={"text": TEXTS[0]}, headers=h("quality"))).status_code \
                == 503 and time.monotonic() < deadline and s.proc.poll() is None:
            time.sleep(0.5)
        assert auto.status_code == 200, (auto.text, (tmp_path / "logs" / "decider.log").read_text()[-2000:])
        assert auto.json()["results"][0]["budget_requested"] == "auto"
        assert (folder / "decider.json").is_file() and "wrote" in (tmp_path / "logs" / "decider.log").read_text()
        assert c.get("/v1/models").json()["data"][0]["decider"] is not None
        assert "decider.json serves it from now on" in s.logs()
