"""lab.avx2_only: every Python process the command starts, its threads and its forked children read CPUID with
AVX-512, VNNI and AMX cleared and nothing else changed; a real crash still reaches Python's faulthandler."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lab.avx2_only import cpuid_faulting, native_environment

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64" or not cpuid_faulting() or shutil.which("cc") is None,
    reason="CPUID faulting on Linux x86-64 and a C compiler")
ROOT = Path(__file__).resolve().parents[2]

# CPUID leaf 7's EBX, ECX and EDX, read by machine code run through ctypes in this process, a thread and a fork:
# push rbx; mov eax, 7; xor ecx, ecx; cpuid; mov [rdi], ebx; mov [rdi+4], ecx; mov [rdi+8], edx; pop rbx; ret
_PROBE = """
import ctypes, mmap, os, threading
code = bytes.fromhex("53b80700000031c90fa2891f894f04895708" + "5bc3")
m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
m.write(code)
leaf7 = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ctypes.addressof(ctypes.c_char.from_buffer(m)))
def read():
    r = (ctypes.c_uint32 * 3)()
    leaf7(ctypes.addressof(r))
    return " ".join(str(x) for x in r)
out = [read()]
t = threading.Thread(target=lambda: out.append(read())); t.start(); t.join()
rfd, wfd = os.pipe()
if os.fork() == 0:
    os.write(wfd, read().encode()); os._exit(0)
os.wait()
out.append(os.read(rfd, 100).decode())
print("|".join(out))
"""
AVX2, BMI2 = 1 << 5, 1 << 8  # leaf 7 EBX
AVX512F, AVX512BW = 1 << 16, 1 << 30  # EBX
AVX512_VNNI = 1 << 11  # ECX
AMX_TILE, AMX_INT8 = 1 << 24, 1 << 25  # EDX


def bits(*n: int) -> int:
    return sum(1 << i for i in n)


# everything AVX-512, VNNI or AMX in leaf 7: EBX f dq ifma pf er cd bw vl; ECX vbmi vbmi2 vnni bitalg vpopcntdq;
# EDX 4vnniw 4fmaps vp2intersect amx_bf16 fp16 amx_tile amx_int8
CLEARED = (bits(16, 17, 21, 26, 27, 28, 30, 31), bits(1, 6, 11, 12, 14), bits(2, 3, 8, 22, 23, 24, 25))


def run(argv: list[str], wrapped: bool = True) -> subprocess.CompletedProcess[str]:
    """``python -m lab.avx2_only ARGV`` (or ARGV alone). The suite itself may run under lab.avx2_only: started
    from the CPU's own environment, an unwrapped process reads the CPU's own CPUID either way."""
    if wrapped:
        argv = [sys.executable, "-m", "lab.avx2_only", *argv]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env=native_environment())


def has_avx512() -> bool:
    return "avx512f" in Path("/proc/cpuinfo").read_text().split()


def leaf7(wrapped: bool) -> list[tuple[int, int, int]]:
    argv = [sys.executable, "-c", _PROBE]
    out = run(["--", *argv] if wrapped else argv, wrapped)
    assert out.returncode == 0, out.stderr
    return [tuple(int(x) for x in part.split()) for part in out.stdout.strip().split("|")]  # type: ignore[misc]


def test_the_process_its_thread_and_its_fork_see_avx512_vnni_and_amx_cleared_and_the_rest_kept() -> None:
    native, = set(leaf7(wrapped=False))
    readings = leaf7(wrapped=True)
    assert len(readings) == 3 and len(set(readings)) == 1  # process, thread, fork
    ebx, ecx, edx = readings[0]
    assert ebx & AVX2 and ebx & BMI2
    assert not ebx & (AVX512F | AVX512BW) and not ecx & AVX512_VNNI and not edx & (AMX_TILE | AMX_INT8)
    # every other bit is the CPU's own
    assert all(seen == real & ~mask for seen, real, mask in zip(readings[0], native, CLEARED, strict=True))
    if has_avx512():
        assert native[0] & AVX512F  # on this CPU the wrapper had something to clear


def test_torch_and_numpy_choose_avx2_kernels() -> None:
    out = run(["--check"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("as AVX2 only: AVX2 AVX2")  # torch's level, then numpy's features


def test_a_real_crash_still_reaches_faulthandler() -> None:
    out = run(["--", sys.executable, "-X", "faulthandler", "-c", "import ctypes; ctypes.string_at(0)"])
    assert out.returncode == -11 and "Fatal Python error: Segmentation fault" in out.stderr


def test_bad_use_is_one_line() -> None:
    for argv in ([], ["--", "no-such-command-here"]):
        out = run(argv)
        assert out.returncode != 0 and out.stdout == "" and len(out.stderr.strip().splitlines()) == 1


# CPUID leaf 0's vendor string (EBX, EDX, ECX): push rbx; xor eax, eax; xor ecx, ecx; cpuid;
# mov [rdi], ebx; mov [rdi+4], edx; mov [rdi+8], ecx; pop rbx; ret
_VENDOR = """
import ctypes, mmap
m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
m.write(bytes.fromhex("5331c031c90fa2891f8957048" + "94f085bc3"))
r = ctypes.create_string_buffer(12)
ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ctypes.addressof(ctypes.c_char.from_buffer(m)))(ctypes.addressof(r))
print(r.raw.decode())
"""


def test_vendor_amd_names_amd_and_the_default_keeps_the_cpus_own() -> None:
    def vendor(*wrapper: str) -> str:  # no wrapper: the CPU's own
        out = run([*wrapper, sys.executable, "-c", _VENDOR], wrapped=bool(wrapper))
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    own = vendor()
    assert own in ("GenuineIntel", "AuthenticAMD")
    assert vendor("--") == own and vendor("--vendor", "amd", "--") == "AuthenticAMD"


def test_first_hour_records_the_cpu_a_run_under_it_was_shown() -> None:
    probe = "from lab.first_hour import cpu; c = cpu(); print(c.avx2_only, c.vendor, ' '.join(c.isa), '|', c.wrapper)"
    out = run(["--vendor", "amd", "--", sys.executable, "-c", probe])
    assert out.returncode == 0, out.stderr
    if has_avx512():
        assert out.stdout.strip() == "True amd avx2 | python -m lab.avx2_only --vendor amd --"
