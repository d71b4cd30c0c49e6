"""lab.without_amx: the command it runs, and every process that command starts, is refused AMX and nothing else."""

from __future__ import annotations

import errno
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64",
                                reason="seccomp's x86-64 filter")
ROOT = Path(__file__).resolve().parents[2]

_PROBE = ("import ctypes, os, sys; from lab.without_amx import request_amx; "
          "m = ctypes.c_ulong(0); "
          "get = ctypes.CDLL(None, use_errno=True).syscall(158, 0x1022, ctypes.byref(m)); "
          "child = os.fork(); "
          "(os._exit(request_amx()) if child == 0 else None); "
          "print(request_amx(), get, os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))")


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lab.without_amx", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_the_command_and_its_children_are_refused_amx_with_eperm_and_other_calls_pass() -> None:
    out = run(["--", sys.executable, "-c", _PROBE])
    assert out.returncode == 0, out.stderr
    refused, get_rc, child_refused = (int(x) for x in out.stdout.split())
    # EPERM is the filter's answer; a CPU or kernel without AMX answers EINVAL or EOPNOTSUPP
    assert refused == errno.EPERM and child_refused == errno.EPERM
    assert get_rc == 0  # the same system call with another request still reaches the kernel


def test_check_reports_and_bad_use_is_one_line() -> None:
    out = run(["--check"])
    assert out.returncode == 0 and out.stdout.strip().endswith("with the filter: False")
    for argv in ([], ["--", "no-such-command-here"]):
        out = run(argv)
        assert out.returncode != 0 and out.stdout == "" and len(out.stderr.strip().splitlines()) == 1
