"""The gated model: hard masks mean what they say, pretrained weights load exactly, checkpoints round-trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from headbudget.models.budget import BUDGET_GRID
from headbudget.models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.config import GateConfig
from headbudget.models.pretrained import minilm_path, random_init
from headbudget.models.tokenizer import TextEncoder

TEXTS = ["the market rallied after the earnings report", "a dull, lifeless film", "goal in the last minute"]


def batch(folder: Path, texts: list[str] = TEXTS) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = TextEncoder(folder, 128).encode(texts).padded()
    return torch.from_numpy(ids), torch.from_numpy(mask)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint: Path) -> BudgetedClassifier:
    return load_checkpoint(tiny_checkpoint)[0]


def test_all_heads_mask_equals_ungated(tiny: BudgetedClassifier, tiny_checkpoint: Path) -> None:
    ids, mask = batch(tiny_checkpoint)
    with torch.no_grad():
        assert torch.equal(tiny(ids, mask, tiny.hard_gates(1.0)), tiny(ids, mask))


def test_masked_heads_weights_do_not_matter(tiny_checkpoint: Path) -> None:
    model = load_checkpoint(tiny_checkpoint)[0]
    ids, mask = batch(tiny_checkpoint)
    gates = model.hard_gates(0.5)
    with torch.no_grad():
        before = model(ids, mask, gates)
        dh = model.cfg.head_dim
        for layer, heads in enumerate(model.gates.hard_mask(0.5)):
            att = model.encoder.layers[layer].attention
            for h, kept in enumerate(heads):
                if not kept:
                    rows = slice(h * dh, (h + 1) * dh)
                    for lin in (att.query, att.key, att.value):
                        lin.weight[rows] = torch.randn_like(lin.weight[rows]) * 5
                        lin.bias[rows] = torch.randn_like(lin.bias[rows]) * 5
                    att.output.weight[:, rows] = torch.randn_like(att.output.weight[:, rows]) * 5
        after = model(ids, mask, gates)
    assert torch.equal(before, after)


def test_lower_budget_changes_output(tiny: BudgetedClassifier, tiny_checkpoint: Path) -> None:
    ids, mask = batch(tiny_checkpoint)
    with torch.no_grad():
        assert not torch.allclose(tiny(ids, mask, tiny.hard_gates(0.25)), tiny(ids, mask, tiny.hard_gates(1.0)))


def test_hard_cost_is_k_over_total(tiny: BudgetedClassifier) -> None:
    for b in BUDGET_GRID:
        assert tiny.hard_cost(b) == tiny.gates.hard_mask(b).sum() / tiny.cfg.total_heads


def test_ste_gates_forward_hard_backward_soft(tiny: BudgetedClassifier) -> None:
    b = torch.tensor([0.5])
    g = tiny.ste_gates(b)
    assert torch.equal(g[0].detach(), tiny.hard_gates(0.5))
    g.sum().backward()
    assert tiny.gates.logit.grad is not None and tiny.gates.logit.grad.abs().sum() > 0
    tiny.zero_grad()


def test_pretrained_minilm_matches_hugging_face() -> None:
    from transformers import BertModel

    from headbudget.models.pretrained import from_pretrained

    folder = minilm_path()
    ours = from_pretrained(folder, ("a", "b"), GateConfig()).model.eval()
    ref = BertModel.from_pretrained(str(folder)).eval()
    ids, mask = batch(folder)
    with torch.no_grad():
        diff = (ours.encoder(ids, mask) - ref(input_ids=ids, attention_mask=mask).last_hidden_state)
    assert diff[mask.bool()].abs().max().item() < 1e-4


def test_checkpoint_round_trip_bit_identical(tmp_path: Path, tiny: BudgetedClassifier, tiny_checkpoint: Path) -> None:
    save_checkpoint(tiny, tmp_path / "copy", {"name": "copy"})
    again, config = load_checkpoint(tmp_path / "copy")
    ids, mask = batch(tiny_checkpoint)
    with torch.no_grad():
        for b in (0.25, 1.0):
            assert torch.equal(tiny(ids, mask, tiny.hard_gates(b)), again(ids, mask, again.hard_gates(b)))
    assert config["name"] == "copy" and config["model"]["n_heads"] == tiny.cfg.n_heads


def test_checkpoint_has_no_pickle(tiny_checkpoint: Path) -> None:
    assert not list(tiny_checkpoint.glob("*.bin")) and not list(tiny_checkpoint.glob("*.pt"))
    assert (tiny_checkpoint / "model.safetensors").read_bytes()[8:9] == b"{"  # safetensors JSON header


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_foreign_config(tmp_path: Path, tiny_checkpoint: Path) -> None:
    d = _copy(tiny_checkpoint, tmp_path / "c")
    (d / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(CheckpointError, match=r"config\.json.*not a headbudget checkpoint"):
        load_checkpoint(d)


def test_truncated_weights(tmp_path: Path, tiny_checkpoint: Path) -> None:
    d = _copy(tiny_checkpoint, tmp_path / "c")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        load_checkpoint(d)


def test_mismatched_architecture(tmp_path: Path, tiny_checkpoint: Path) -> None:
    d = _copy(tiny_checkpoint, tmp_path / "c")
    config = json.loads((d / "config.json").read_text())
    config["model"]["intermediate_size"] = 128
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*intermediate"):
        load_checkpoint(d)


def test_missing_weights(tmp_path: Path, tiny_checkpoint: Path) -> None:
    d = _copy(tiny_checkpoint, tmp_path / "c")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing"):
        load_checkpoint(d)


def test_random_init_is_seeded() -> None:
    a = random_init(("x", "y"), GateConfig(), seed=5)
    b = random_init(("x", "y"), GateConfig(), seed=5)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
