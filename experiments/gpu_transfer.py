"""Move a trained checkpoint back from a lent GPU machine within its transfer limits (docs/gpu.md).

Files come back at most 16 MiB each, 8 at a time. MiniLM's weights without the frozen word embeddings are 43 MB
in fp32, so ``pack`` checks that the word embeddings still equal the base's (they were frozen) and writes every
other tensor, bit for bit, into parts under a size cap, with the small files in one tarball; ``unpack`` rebuilds
``model.safetensors`` here from the parts plus the local base's word embeddings, rounded as the GPU run's were.

    python -m headbudget.experiments.gpu_transfer pack --run runs/x --base /tmp/minilm --out $OUT/x
    python -m headbudget.experiments.gpu_transfer unpack --parts /work/.device/.../x --base16 .carry/base16 --out checkpoints/x
"""

from __future__ import annotations

import argparse
import sys
import tarfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from headbudget.models.tokenizer import copy_tokenizer

WORD = "encoder.embeddings.word.weight"
BASE_WORD = "embeddings.word_embeddings.weight"
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
    a = p.parse_args(argv)
    try:
        if a.cmd == "pack":
            for f in pack(a.run, a.base, a.out, int(a.cap_mb * 1e6)):
                print(f"{f} {f.stat().st_size / 1e6:.1f} MB")
        else:
            print(unpack(a.parts, a.base16, a.tokenizer, a.out))
    except (ValueError, FileNotFoundError, StopIteration) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
