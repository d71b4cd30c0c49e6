"""Run a command as on an AVX-512 VNNI CPU without AMX: `python -m lab.without_amx -- make test`.

Linux hands a process AMX's tile registers only once it asks (``arch_prctl(ARCH_REQ_XCOMP_PERM)``), and ONNX
Runtime's MLAS, oneDNN and torch use AMX only if that request succeeds; otherwise they take their AVX-512 VNNI
kernels, the ones an Ice Lake, Cascade Lake or AMD Zen 4 runs. A seccomp filter that refuses that one request
(EPERM), installed here and inherited by every process the command starts, makes a CPU with AMX run the suite as
such a CPU would. ``--check`` prints whether this process may use AMX (with and without the filter) and exits.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys

from headbudget.commands.parser import OneLineParser
from lab.script_output import exec_command

PROG = "python -m lab.without_amx"
_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_AUDIT_ARCH_X86_64 = 0xC000003E
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_LD_ABS, _JEQ, _RET = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000

# struct seccomp_data: nr at 0, arch at 4, args[0] (low half) at 16
_FILTER = (
    (_LD_ABS, 0, 0, 4),
    (_JEQ, 0, 5, _AUDIT_ARCH_X86_64),  # another ABI: allow
    (_LD_ABS, 0, 0, 0),
    (_JEQ, 0, 3, _SYS_ARCH_PRCTL),  # another call: allow
    (_LD_ABS, 0, 0, 16),
    (_JEQ, 0, 1, _ARCH_REQ_XCOMP_PERM),
    (_RET, 0, 0, _ERRNO | errno.EPERM),
    (_RET, 0, 0, _ALLOW),
)

_libc = ctypes.CDLL(None, use_errno=True)


class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def request_amx() -> int:
    """Ask for AMX's tiles as every AMX library does first: 0 if granted, else the errno (EPERM: the filter;
    EINVAL or EOPNOTSUPP: a CPU or kernel without AMX)."""
    if _libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0:
        return 0
    return ctypes.get_errno()


def amx_usable() -> bool:
    """Whether this process may use AMX's tiles."""
    return request_amx() == 0


def refuse_amx() -> None:
    """Install the filter in this process; it outlives exec and passes to every child."""
    code = b"".join(struct.pack("=HBBI", *op) for op in _FILTER)
    prog = _Fprog(len(_FILTER), code)
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="say whether AMX is usable here, before and after the filter")
    ap.add_argument("command", nargs="*", help="the command to run (after --)")
    args = ap.parse_args(argv)
    if not args.check and not args.command:
        print(f"{PROG}: error: give a command to run (after --), or --check", file=sys.stderr)
        return 2
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        print(f"{PROG}: error: needs Linux on x86-64", file=sys.stderr)
        return 2
    try:
        if args.check:
            before = amx_usable()
            refuse_amx()
            print(f"AMX usable: {before}; with the filter: {amx_usable()}")
            return 0
        refuse_amx()
    except OSError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return exec_command(PROG, args.command)


if __name__ == "__main__":
    sys.exit(main())
