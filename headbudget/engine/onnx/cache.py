"""On-disk cache of the engine's weight store and ONNX graphs, keyed by a content hash.

Layout: ``<root>/hb-<precision>-<layout>-<key>/`` holds ``store.safetensors`` (the permuted, transposed, maybe quantized arrays
plus the head order), one ``.onnx`` file per graph (structure only, a few kB: weights are placeholders),
an empty ``weights.placeholder`` the graphs point at, and ``manifest.json`` written last as the marker of a
complete cache. The key hashes the checkpoint's weights digest, the graph-builder version, the precision
and the layout, so a changed checkpoint or builder gets a fresh folder, and older folders of the same precision and
layout under the root are removed when a new one is written. Writes go to a temporary name and are renamed into place,
so concurrent workers starting together at worst build the same file twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from headbudget.engine.onnx.graph import BUILDER_VERSION, PLACEHOLDER_FILE
from headbudget.engine.types import Precision
from headbudget.engine.weights.store import WeightStore
from headbudget.models.config import ModelConfig

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
STORE = "store.safetensors"
ORDER = "order"  # the store file's entry for the unit ranking the store was laid out by


def cache_key(digest: str, precision: str, layout: str, levels: str = "") -> str:
    """The cache's key: the weights, the graph builder's version, the precision, the layout and its packed levels."""
    blob = json.dumps({"weights": digest, "builder": BUILDER_VERSION, "precision": precision, "layout": layout,
                       "levels": levels}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _writable_root(root: Path) -> Path:
    """``root`` if we can write there, else a private temporary folder (read-only checkpoint mounts)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=root, prefix=".probe-", delete=True)
        probe.close()
        return root
    except OSError as e:
        fallback = Path(tempfile.gettempdir()) / "headbudget-onnx"
        log.warning("graph cache %s not writable (%s); using %s", root, e, fallback)
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


class GraphCache:
    """One checkpoint x precision x layout's cached store and graphs."""

    def __init__(self, root: Path, key: str, flavour: str) -> None:
        self.root = _writable_root(Path(root))
        self.key = key
        self.flavour = flavour  # e.g. "fp32-dynamic": stale folders are those of the same flavour only
        self.dir = self.root / f"hb-{flavour}-{key}"
        self.built: list[str] = []  # what this process had to (re)build, for logs and tests

    def load_store(self, cfg: ModelConfig, precision: Precision) -> tuple[WeightStore, np.ndarray] | None:
        """The cached weight store and its unit ranking, or None when absent, stale or damaged."""
        try:
            manifest = json.loads((self.dir / MANIFEST).read_text())
            if manifest.get("key") != self.key:
                return None
            from safetensors import SafetensorError
            from safetensors.numpy import load_file

            try:
                arrays = load_file(str(self.dir / STORE))
            except SafetensorError:  # damaged: rebuild
                return None
            order = arrays.pop(ORDER)
            return WeightStore.from_arrays(arrays, cfg, precision), order
        except (OSError, ValueError):  # missing, half-written or not JSON: rebuild
            return None

    def save_store(self, store: WeightStore, order: np.ndarray, meta: dict[str, Any]) -> None:
        from safetensors.numpy import save_file

        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / MANIFEST).unlink(missing_ok=True)  # invalid until the new store is complete
        self._atomic(STORE, lambda p: save_file({**store.arrays(), ORDER: np.ascontiguousarray(order)}, str(p)))
        (self.dir / PLACEHOLDER_FILE).touch()
        self._atomic(MANIFEST, lambda p: p.write_text(json.dumps({"key": self.key, **meta}, indent=2)))
        self.built.append(STORE)
        self._remove_stale()

    def graph(self, name: str, build: Callable[[], onnx.ModelProto]) -> Path:
        """Path of graph ``name``; built and written on first use."""
        path = self.dir / f"{name}.onnx"
        if not path.is_file():
            model = build()
            (self.dir / PLACEHOLDER_FILE).touch()
            self._atomic(path.name, lambda p: p.write_bytes(model.SerializeToString()))
            self.built.append(name)
        return path

    def _atomic(self, name: str, write: Callable[[Path], object]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{name}.")
        os.close(fd)
        try:
            write(Path(tmp))
            os.replace(tmp, self.dir / name)
        finally:
            Path(tmp).unlink(missing_ok=True)

    def _remove_stale(self) -> None:
        for other in self.root.glob(f"hb-{self.flavour}-*"):
            if other != self.dir and other.is_dir() and (other / MANIFEST).exists():
                shutil.rmtree(other, ignore_errors=True)
