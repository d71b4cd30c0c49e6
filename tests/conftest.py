"""Session fixtures: small checkpoints built once and shared by every test package."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)


def make_random_checkpoint(folder: Path, seed: int = 0, scope: str = "attention", ffn_group: int = 64,
                           exits: tuple[int, ...] = (), **overrides: int) -> Path:
    """A random encoder with random (non-uniform) gate parameters, saved as a real checkpoint folder.

    ``scope="model"``: the budget spans the heads and feed-forward groups of ``ffn_group`` neurons.
    """
    from headbudget.models.checkpoint import save_checkpoint
    from headbudget.models.config import GateConfig
    from headbudget.models.pretrained import minilm_path, random_init
    from headbudget.models.tokenizer import copy_tokenizer

    gate = GateConfig(scope=scope, ffn_group=ffn_group, exits=exits)
    model = random_init(("negative", "positive"), gate, seed=seed, **overrides)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        # Spread the gates so that head rankings, and hence masks, differ from the (layer, head) order.
        model.gates.logit.copy_(torch.randn(model.gates.logit.shape, generator=g) * 2.0)
        model.gates.raw_beta.copy_(torch.randn(model.gates.raw_beta.shape, generator=g))
        for p in model.encoder.parameters():  # larger weights than 0.02 so heads differ measurably
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        for p in model.exits.parameters():  # each exit its own head, unlike the classifier
            p.copy_(torch.randn(p.shape, generator=g))
    model.eval()
    save_checkpoint(model, folder, {"name": folder.name, "model_type": "budgeted"})
    copy_tokenizer(minilm_path(), folder)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny base (2 layers x 4 heads, width 64), random weights and gates."""
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def tiny_model_scope_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny base with a whole-model budget: 4 heads and 8 feed-forward groups of 32 neurons per layer."""
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-model", seed=5, scope="model",
                                  ffn_group=32)


@pytest.fixture(scope="session")
def minilm_shaped_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights in MiniLM's shape (6 layers x 12 heads, width 384), short positions to stay small."""
    return make_random_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "minilm-shaped", seed=3, hidden_size=384, n_layers=6, n_heads=12,
        intermediate_size=1536, max_position=512,
    )


def run_cli(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``headbudget ARGS`` as a real process (the installed CLI, same interpreter), ``env`` added to ours."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "headbudget.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


# Imported by a child interpreter at start-up (PYTHONPATH=the folder holding it as sitecustomize.py): any import of
# torch raises, so a path that needs torch fails and the test sees it.
TORCH_BLOCKER = '''
import sys


class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this process")
        return None


sys.meta_path.insert(0, _NoTorch())
'''


def without_torch(folder: Path) -> dict[str, str]:
    """The environment a child process needs to run with torch unimportable (``TORCH_BLOCKER``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(TORCH_BLOCKER)
    return {"PYTHONPATH": str(folder)}


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """``build(folder)`` once per run, however many pytest-xdist workers ask: the first builds under a lock in
    the folder the workers share, the others wait and reuse it (a trained fixture costs up to a minute)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = root / "shared" / name, root / "shared" / f"{name}.done"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / "shared" / f"{name}.lock")):
        if not done.exists():
            build(folder)
            done.touch()
    return folder


def _train(out: Path, *args: str) -> None:
    proc = run_cli("train", "--base", "tiny", "--data", "synthetic", "--recipe", "smoke", *args,
                   "--out", str(out), "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.fixture(scope="session")
def smoke_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `smoke` recipe with the attention-only budget, trained end to end by the real CLI (tiny base,
    synthetic task), once per run."""
    return built_once(tmp_path_factory, "smoke", lambda out: _train(out, "--scope", "attention"))


@pytest.fixture(scope="session")
def smoke_model_scope_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `smoke` recipe with the whole-model budget (``--scope model``), trained once per run."""
    return built_once(tmp_path_factory, "smoke-model", lambda out: _train(out, "--scope", "model"))


# Smoke-sized adaptive runs: a shorter dense warm start than `smoke` (the tests check the pipeline and
# the adaptive behaviour, not accuracy), then one adapt epoch.
ADAPTIVE_SMOKE = ("--set", "dense_epochs=3", "--set", "adapt_epochs=1", "--set", "synthetic_size=1500")


def train_adaptive_smoke(out: Path, kind: str) -> Path:
    """Train a smoke-sized checkpoint of an adaptive type with the real CLI (ends with its report)."""
    proc = run_cli("train", "--base", "tiny", "--data", "synthetic", "--recipe", "smoke", "--model", kind,
                   "--out", str(out), "--device", "cpu", *ADAPTIVE_SMOKE)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.fixture(scope="session")
def budgetformer_smoke(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smoke-sized BudgetFormer checkpoint (for `budget=auto` end to end), once per session."""
    return built_once(tmp_path_factory, "budgetformer", lambda out: train_adaptive_smoke(out, "budgetformer"))
