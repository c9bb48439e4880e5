"""PyTorch's own operators that an exercise forbids, left out of a graded kernel's torch.

06.1 asks for the loss scale's update rule and 06.2 for the inf/NaN check and unscale; one private
operator each does the whole exercise (``torch._amp_update_scale_``,
``torch._amp_foreach_non_finite_check_and_unscale_``). A course helper can be stripped from the
package a graded kernel imports (:mod:`.graded_build`), but an operator is machine code in
``libtorch_cpu.so``, reached through many doors: ``torch.X``, ``torch.ops.aten.X``, the functional
variant, ``GradScaler``, a fresh interpreter the notebook starts, ``ctypes`` straight into the
exported ``at::cpu::``/``at::native::`` functions or the kernels their dispatch stubs point to. A
gate in the kernel guards none of them; a name scan sees only the names.

So the graded build also holds a copy of ``libtorch_cpu.so`` in which each forbidden operator's CPU
code returns at once, doing nothing — its entry functions and every kernel (each CPU capability's)
its dispatch stub points to — and the sandbox shows that copy where the library is. Every process
of the graded run, whatever door it takes, runs the no-op: the operator leaves its arguments as
they were, the check's values come out wrong, and the grader says why
(``grade._note_disabled``). Nothing else in the library changes.

::

    judge (torch imported) ──► patches(names): for every entry function and stub kernel, its address in
                               │               this process → its offset in the file (/proc/self/maps),
                               │               checked against the bytes in memory
                               └─► write_library(names, dest): a copy, each of those functions'
                                   first instruction(s) replaced by "return" (x86-64, aarch64)

An operator whose symbols this torch does not export (another version, another machine) cannot be
left out: :func:`patchable` says so, and the exercise keeps the kernel's gate and the name scan.
"""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

__all__ = ["OPERATORS", "library_path", "needed_by", "patchable", "patches", "write_library"]

#: forbidden name → (the names in code that use it, the exported functions that run it, the dispatch
#: stub whose kernels do the work, whether its functions return their first argument (``Tensor&``))
OPERATORS = {
    "torch._amp_update_scale_": (
        {"_amp_update_scale_", "_amp_update_scale", "GradScaler"},
        ["_ZN2at6native22_amp_update_scale_cpu_ERNS_6TensorES2_RKS1_ddl",
         "_ZN2at3cpu18_amp_update_scale_ERNS_6TensorES2_RKS1_ddl"],
        "_ZN2at6native12DispatchStubIPFRNS_6TensorES3_S3_RKS2_ddlENS0_48_amp_update_scale_cpu_stub_"
        "DECLARE_DISPATCH_typeEE{}E",
        True),
    "torch._amp_foreach_non_finite_check_and_unscale_": (
        {"_amp_foreach_non_finite_check_and_unscale_", "_amp_foreach_non_finite_check_and_unscale",
         "GradScaler", "_unscale_grads_"},
        ["_ZN2at6native46_amp_foreach_non_finite_check_and_unscale_cpu_"
         "EN3c108ArrayRefINS_6TensorEEERS3_RKS3_",
         "_ZN2at3cpu42_amp_foreach_non_finite_check_and_unscale_EN3c108ArrayRefINS_6TensorEEERS3_RKS3_"],
        "_ZN2at6native12DispatchStubIPFvN3c108ArrayRefINS_6TensorEEERS4_RKS4_ENS0_72_amp_foreach_non_finite_"
        "check_and_unscale_cpu_stub_DECLARE_DISPATCH_typeEE{}E",
        False),
}

#: the CPU capabilities a dispatch stub holds a kernel for (the members' mangled names)
_CAPABILITIES = ("7DEFAULT", "4AVX2", "6AVX512", "3VSX", "7ZVECTOR", "6SVE128", "6SVE256")

#: "return at once": (first argument returned, nothing returned) per machine
_RETURN = {"x86_64": (b"\x48\x89\xf8\xc3", b"\xc3"),          # mov rax, rdi; ret  /  ret
           "aarch64": (b"\xc0\x03\x5f\xd6", b"\xc0\x03\x5f\xd6")}   # ret (x0 is the first argument)
_BRANCH_TARGETS = {"x86_64": b"\xf3\x0f\x1e\xfa", "aarch64": b"\x5f\x24\x03\xd5"}   # endbr64 / bti c


def needed_by(identifiers: set[str]) -> set[str]:
    """The forbidden operators that code naming ``identifiers`` uses (``GradScaler`` uses both).

        >>> sorted(needed_by({"GradScaler", "x"}))
        ['torch._amp_foreach_non_finite_check_and_unscale_', 'torch._amp_update_scale_']
        >>> needed_by({"mse_loss"})
        set()
    """
    return {name for name, (uses, *_rest) in OPERATORS.items() if uses & identifiers}


def library_path() -> Path:
    """``libtorch_cpu.so`` of the torch this process imported (a judge's: it runs the course's code)."""
    import torch

    return Path(os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")))


def _mapped(lib: Path) -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, permissions) of each of this process's mappings of ``lib``."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and os.path.realpath(parts[5]) == str(lib):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, int(parts[2], 16), parts[1]))
    return out


def patches(names) -> list[tuple[int, bytes, bytes]]:
    """``(file offset, bytes there now, bytes to write)`` for every function that runs ``names``.

    Raises ``LookupError`` naming what is missing when one of them cannot be found in this torch.
    """
    import ctypes

    machine = platform.machine()
    if machine not in _RETURN or not os.path.exists("/proc/self/maps"):
        raise LookupError(f"no way to leave a torch operator out on {machine} "
                          "(x86_64 and aarch64 Linux only)")
    lib_path = library_path()
    lib = ctypes.CDLL(str(lib_path))
    maps = _mapped(lib_path)

    def offset(address: int) -> int:
        for lo, hi, off, perms in maps:
            if lo <= address < hi and "x" in perms:
                return address - lo + off
        raise LookupError(f"{address:#x} is not in {lib_path}'s code")

    out: dict[int, tuple[int, bytes, bytes]] = {}
    for name in sorted(names):
        if name not in OPERATORS:
            raise LookupError(f"{name} is not an operator a graded build can leave out")
        _, functions, stub, first = OPERATORS[name]
        returns = _RETURN[machine][0 if first else 1]
        addresses = []
        for symbol in functions:
            try:
                addresses.append(ctypes.cast(lib[symbol], ctypes.c_void_p).value)
            except AttributeError:
                raise LookupError(f"{name}: this torch exports no {symbol}") from None
        kernels = 0
        for capability in _CAPABILITIES:
            try:
                pointer = ctypes.c_void_p.in_dll(lib, stub.format(capability)).value
            except ValueError:
                continue
            if pointer:
                addresses.append(pointer)
                kernels += 1
        if not kernels:
            raise LookupError(f"{name}: this torch's dispatch stub holds no CPU kernel")
        for address in addresses:
            landing = _BRANCH_TARGETS[machine]             # an indirect call's landing pad stays
            skip = len(landing) if ctypes.string_at(address, len(landing)) == landing else 0
            here = ctypes.string_at(address + skip, len(returns))
            out[address] = (offset(address) + skip, here, returns)
    return sorted(out.values())


def patchable(name: str) -> bool:
    """Whether this torch, on this machine, lets a graded build leave ``name`` out."""
    try:
        patches([name])
    except (LookupError, OSError):
        return False
    return True


def write_library(names, dest: Path) -> Path:
    """``dest``: a copy of ``libtorch_cpu.so`` in which ``names`` do nothing (see the module's text)."""
    todo = patches(names)
    source = library_path()
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, dest)
    with open(dest, "r+b") as f:
        for offset, before, after in todo:
            f.seek(offset)
            found = f.read(len(before))
            if found != before:        # the mapping and the file disagree: never write blind
                raise RuntimeError(f"{source} at {offset:#x}: {found.hex()} on disk, "
                                   f"{before.hex()} in memory")
            f.seek(offset)
            f.write(after)
    os.chmod(dest, 0o555)
    return dest
