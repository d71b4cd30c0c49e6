"""`headbudget train --base <fine-tuned Hugging Face classifier>`: the dense stage is skipped and said so,
and the budgeted checkpoint serves."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from headbudget.training.synthetic import LABELS, synthetic_dataset
from tests.conftest import run_cli
from tests.models.test_pretrained import hf_classifier
from tests.service.conftest import KEYS, config_dict, start_server, toml_of

SHORT = ("--set", "budget_epochs=1", "--set", "synthetic_size=400", "--no-sweep", "--device", "cpu")


def fine_tuned(family: str, folder: Path, steps: int = 15) -> None:
    """A Hugging Face classifier of ``family`` fine-tuned a few steps on the synthetic task, saved to ``folder``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hf_classifier(family, folder, labels=LABELS)  # random init, the task's labels, MiniLM's tokenizer files
    model = AutoModelForSequenceClassification.from_pretrained(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    train = synthetic_dataset(n_train=steps * 16, seed=3).train
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for i in range(steps):
        texts, labels = train.texts[i * 16:(i + 1) * 16], train.labels[i * 16:(i + 1) * 16]
        batch = tokenizer(list(texts), padding=True, return_tensors="pt")
        loss = model(**batch, labels=torch.tensor(labels)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    model.save_pretrained(str(folder))


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_a_fine_tuned_classifier_becomes_a_budgeted_checkpoint_that_serves(family: str, tmp_path: Path) -> None:
    fine_tuned(family, tmp_path / "hf")
    out = tmp_path / "budgeted"
    proc = run_cli("train", "--base", str(tmp_path / "hf"), "--data", "synthetic", "--recipe", "smoke",
                   "--out", str(out), *SHORT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"stage dense: skipped, {family} sequence classifier" in proc.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["stages"]["dense"]["steps"] == 0 and "classifier" in config["stages"]["dense"]["skipped"]
    assert config["stages"]["budget"]["steps"] > 0 and config["model"]["pooler"] == "tanh"
    # --no-sweep: the last stage's one evaluation, which would select nothing, did not run either.
    assert config["stages"]["hard"]["steps"] > 0 and config["stages"]["hard"]["best_val"] is None
    with start_server(out, toml_of(config_dict()), tmp_path / "srv") as server:
        answers = {}
        for budget in (0.25, 1.0):
            r = httpx.post(f"{server.url}/classify?budget={budget}", json={"texts": ["red marker one blue"]},
                           headers={"X-API-Key": KEYS["quality"]}, timeout=30)
            assert r.status_code == 200, r.text
            answers[budget] = r.json()["results"][0]
    assert {a["label"] for a in answers.values()} <= set(LABELS)
    assert answers[0.25]["heads_active"] < answers[1.0]["heads_active"] == answers[1.0]["heads_total"] == 8


def test_an_unsupported_base_is_one_line(tmp_path: Path) -> None:
    hf_classifier("bert", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "model_type": "electra"}))
    proc = run_cli("train", "--base", str(tmp_path / "hf"), "--data", "synthetic", "--recipe", "smoke",
                   "--out", str(tmp_path / "out"), *SHORT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "model_type 'electra' is not supported" in proc.stderr
