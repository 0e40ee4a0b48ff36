"""A report, instead of a bare SIGSEGV, when something writes into a read-only hostmem weight.

hostmem maps weights ``PROT_READ`` on purpose: a write that would otherwise copy the
page into anonymous memory faults instead. The library entry points known to write
(see :mod:`hostmem.safetensors.writers`) raise a Python error first; any other writer still
faults, and a bare "Segmentation fault" says nothing about why. This handler runs
first on SIGSEGV and SIGBUS. When the faulting address lies in a read-only shared
mapping of a safetensors file (how hostmem and the LoRA merge cache map weights), it
writes one report to stderr: which file, which tensor (from the file's header and the
offset of the address), and how to make weights writable on purpose. Then it puts back
the handler that was there before (faulthandler's, or the default) and returns: the
faulting instruction runs again, faults again, and the process dies of the same
signal as it always did (its exit status still says SIGSEGV), with faulthandler's
traceback after the report where faulthandler is on.

Mechanism: ``sigaction`` with ``SA_SIGINFO`` through ctypes, so the handler learns the
faulting address (Python's :mod:`signal` cannot: its handlers run later, between
bytecodes, and a fault cannot wait). The handler is Python entered through a ctypes
callback, which takes the GIL: the kernels that write weights (torch's ``copy_``,
``add_``, numpy's loops) release it while they run, so the faulting thread can take it.
It reads /proc/self/maps and the file's header: the kernel's own record of the
mapping, so nothing has to be registered when a mapping is made. Linux x86-64 and
aarch64 only (the layout of ``struct sigaction`` and ``siginfo_t`` is theirs);
elsewhere installing does nothing.
"""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import sys
import threading

from .header import read_header

__all__ = ["install_fault_report", "describe_address", "MAKE_WRITABLE_HINT"]

MAKE_WRITABLE_HINT = (
    "To write into weights on purpose, copy them into anonymous memory first with "
    "hostmem.make_writable(model) (the copy then shows in hostmem.account as anonymous)."
)
_LORA_HINT = "To merge a LoRA without writing the base, use lora_cache.merge or lora_cache.load_lora."

_SA_SIGINFO = 4
_SEGV_ACCERR = 2


class _SigInfo(ctypes.Structure):
    # si_signo, si_errno, si_code, padding, then the union whose first member is si_addr.
    _fields_ = [("si_signo", ctypes.c_int), ("si_errno", ctypes.c_int), ("si_code", ctypes.c_int),
                ("_pad", ctypes.c_int), ("si_addr", ctypes.c_void_p)]


class _SigAction(ctypes.Structure):
    # glibc's struct sigaction on x86-64 and aarch64: handler, 1024-bit mask, flags, restorer.
    _fields_ = [("sa_sigaction", ctypes.c_void_p), ("sa_mask", ctypes.c_ulong * 16),
                ("sa_flags", ctypes.c_int), ("sa_restorer", ctypes.c_void_p)]


_HANDLER_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(_SigInfo), ctypes.c_void_p)
_LOCK = threading.Lock()
_REPORT = threading.Lock()  # held by the one fault that writes the report
_REPORTED = threading.Event()  # set once it is written (or there was nothing to report)
_REPORT_WAIT_S = 5.0
_STATE: dict = {"installed": False, "previous": {}, "handler": None, "libc": None}


def _supported() -> bool:
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")


def _area_at(address: int) -> tuple[int, int, str, int, str] | None:
    """``(start, end, perms, offset, path)`` of the mapping holding ``address``, from /proc/self/maps."""
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                path = fields[5].strip() if len(fields) > 5 else ""
                return start, end, fields[1], int(fields[2], 16), path
    return None


def _tensor_at(path: str, file_offset: int) -> str | None:
    """The name of the tensor of safetensors file ``path`` that holds byte ``file_offset``."""
    try:
        header = read_header(path)
    except Exception:
        return None
    relative = file_offset - header.data_offset
    for name, info in header.tensors.items():
        if info.begin <= relative < info.begin + info.nbytes:
            return name
    return None


def describe_address(address: int, signum: int = signal.SIGSEGV) -> str | None:
    """The report for a fault at ``address``, or None when it is not in a read-only hostmem mapping."""
    area = _area_at(address)
    if area is None:
        return None
    start, _, perms, offset, path = area
    if "w" in perms or perms[3:4] != "s" or not path.startswith("/"):
        return None
    name = _tensor_at(path.removesuffix(" (deleted)"), offset + address - start)
    if name is None and not path.endswith(".safetensors"):
        return None
    which = f"tensor {name!r} of {path}" if name else f"a weight mapped from {path}"
    if signum == signal.SIGBUS:
        return (f"hostmem: fatal SIGBUS reading {which} (address {address:#x}): the file behind this read-only "
                "hostmem mapping was truncated, replaced in place or could not be read. Do not rewrite "
                "checkpoint or cache files while a process maps them.\n")
    return (f"hostmem: fatal SIGSEGV: something wrote into a read-only hostmem weight: {which} "
            f"(address {address:#x}). Weights are mapped PROT_READ so that a stray write faults instead of "
            f"silently turning their pages into anonymous memory. {MAKE_WRITABLE_HINT} {_LORA_HINT}\n")


def _restore_previous(signum: int) -> None:
    previous = _STATE["previous"].get(signum)
    if previous is not None:
        _STATE["libc"].sigaction(signum, ctypes.byref(previous), None)


def _on_fault(signum: int, info, _context) -> None:
    """Report a fault in a read-only hostmem mapping, then hand the signal back to its old handler."""
    try:
        # Sent by the kernel (si_code > 0), so si_addr is the faulting address. Threads that
        # fault together (a copy split over a pool) all get here, and describing a fault
        # reads /proc, letting the GIL go: the first to claim the report (an atomic,
        # non-blocking acquire) writes it; the others write nothing but wait for it, since
        # the first of them to return re-faults under the old handler and ends the process.
        if info and info.contents.si_code > 0:
            if _REPORT.acquire(blocking=False):
                try:
                    report = describe_address(info.contents.si_addr or 0, signum)
                    if report:
                        os.write(2, report.encode("utf-8", "replace"))
                finally:
                    _REPORTED.set()
            else:
                _REPORTED.wait(_REPORT_WAIT_S)
    except BaseException:  # a report is a courtesy; the signal must go on either way
        pass
    finally:
        _restore_previous(signum)


def install_fault_report() -> bool:
    """Install the handler for SIGSEGV and SIGBUS once; True when it is in place."""
    if not _supported():
        return False
    with _LOCK:
        if _STATE["installed"]:
            return True
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sigaction.argtypes = [ctypes.c_int, ctypes.POINTER(_SigAction), ctypes.POINTER(_SigAction)]
        handler = _HANDLER_TYPE(_on_fault)
        action = _SigAction()
        action.sa_sigaction = ctypes.cast(handler, ctypes.c_void_p).value
        action.sa_flags = _SA_SIGINFO
        _STATE.update(libc=libc, handler=handler)
        for signum in (signal.SIGSEGV, signal.SIGBUS):
            previous = _SigAction()
            if libc.sigaction(signum, ctypes.byref(action), ctypes.byref(previous)) != 0:
                return False
            _STATE["previous"][signum] = previous
        _STATE["installed"] = True
        return True
