"""Run a command as on an AVX2 CPU without AVX-512, VNNI or AMX (an AMD EPYC of Zen 2 or 3):
`python -m lab.avx2_only -- make test`.

ONNX Runtime's MLAS, oneDNN, torch and numpy pick their kernels from CPUID. `avx2_only.c`, compiled here with the
system's C compiler and preloaded into every Python process the command starts, turns on CPUID faulting and
answers each CPUID with the AVX-512, VNNI (AVX-512 and AVX) and AMX bits cleared, so those libraries take the
kernels such a CPU runs: int8 products through AVX2's saturating u8 x s8 pairs, fp32 through AVX2 FMA. With
``--vendor amd`` CPUID names AMD as well, so MKL, which chooses its kernels by vendor too, takes an EPYC's. Needs
Linux on x86-64 with CPUID faulting (`cpuid_fault` in /proc/cpuinfo: recent Intel CPUs, most VMs on them).
``--check`` prints what a Python process sees with and without it and exits.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from headbudget.commands.parser import OneLineParser
from lab.script_output import exec_command

PROG = "python -m lab.avx2_only"
SOURCE = Path(__file__).with_suffix(".c")
VENDOR_VARIABLE = "AVX2_ONLY_VENDOR"
LIB_PREFIX = "avx2_only-"  # the built library's name, a digest of its source after it
# what a Python process says it may use: torch's kernel level and numpy's view of CPUID
PROBE = ("import torch; from numpy._core._multiarray_umath import __cpu_features__ as f; "
         "print(torch.backends.cpu.get_cpu_capability(), "
         "' '.join(k for k in ('AVX2', 'AVX512F', 'AVX512VNNI', 'AVXVNNI') if f.get(k)))")


class Unavailable(Exception):
    """This machine cannot run a command as an AVX2 CPU; the message says why."""


def cpuid_faulting() -> bool:
    try:
        return "cpuid_fault" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def library() -> Path:
    """The compiled preload library, built once per version of its source."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        raise Unavailable("needs Linux on x86-64")
    if not cpuid_faulting():
        raise Unavailable("this CPU or kernel cannot fault on CPUID (no cpuid_fault in /proc/cpuinfo)")
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise Unavailable("no C compiler (cc) to build avx2_only.c")
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "headbudget-lab"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home, as some CI runners have
        cache = Path(tempfile.gettempdir()) / f"headbudget-lab-{os.getuid()}"
        cache.mkdir(exist_ok=True)
    lib = cache / f"{LIB_PREFIX}{digest}.so"
    if lib.exists():
        return lib
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / lib.name
        r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-Wl,-z,now", "-o", str(built), str(SOURCE), "-ldl"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise Unavailable(f"cc failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
        built.replace(lib)
    return lib


def native_environment() -> dict[str, str]:
    """This process's environment without the library, for a process that reads the CPU's own CPUID (where a
    command run under this module runs this module again)."""
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(p for p in env.get("LD_PRELOAD", "").split() if not _ours(p))
    return env


def _ours(preloaded: str) -> bool:
    return Path(preloaded).name.startswith(LIB_PREFIX)


def environment(lib: Path, vendor: str = "own") -> dict[str, str]:
    env = native_environment()
    env["LD_PRELOAD"] = " ".join(p for p in (str(lib), env["LD_PRELOAD"]) if p)
    env[VENDOR_VARIABLE] = vendor  # read by avx2_only.c
    return env


def vendor_in_effect() -> str | None:
    """The vendor a process run under this module answers with ("own" or "amd"); None outside it."""
    if not any(_ours(p) for p in os.environ.get("LD_PRELOAD", "").split()):
        return None
    return os.environ.get(VENDOR_VARIABLE, "own")


def probe(env: dict[str, str]) -> str:
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return r.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="print what a Python process sees, without and with it")
    ap.add_argument("--vendor", choices=("own", "amd"), default="own",
                    help="the vendor CPUID names: this CPU's own, or AMD (MKL then runs an EPYC's kernels)")
    ap.add_argument("command", nargs="*", help="the command to run (after --)")
    args = ap.parse_args(argv)
    if not args.check and not args.command:
        print(f"{PROG}: error: give a command to run (after --), or --check", file=sys.stderr)
        return 2
    try:
        lib = library()
    except Unavailable as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.check:
        print(f"this CPU: {probe(native_environment())}; as AVX2 only: {probe(environment(lib, args.vendor))}")
        return 0
    return exec_command(PROG, args.command, environment(lib, args.vendor))


if __name__ == "__main__":
    sys.exit(main())
