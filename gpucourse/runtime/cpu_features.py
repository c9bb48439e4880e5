"""Does this CPU have bf16 matrix instructions? Chapter 06's bf16 speed-up depends on it.

bf16 autocast runs on every CPU, but it is only *fast* where the CPU multiplies bf16 numbers in
hardware: Intel AMX (Xeon since Sapphire Rapids) or AVX-512-bf16 (Cooper Lake, AMD Zen 4+). Elsewhere
PyTorch emulates every bf16 matmul — it converts the operands to fp32 and back around a slow generic
kernel — and a bf16 training step is *much slower* than fp32 (measured on such a CPU: a bf16 MLP
step at 0.02× the fp32 speed). ``doctor`` and chapter 06 use this module to say which case a
machine is in, instead of quoting one machine's result.
"""

from __future__ import annotations

import os

import torch

__all__ = ["cpu_supports_bf16", "has_bf16_units", "bf16_hardware_note"]

# measured on a CPU without AMX / AVX-512-bf16 (issue 14): bf16 MLP 1024-4096-1024 training step
EMULATED_BF16_RATIO = 0.02


def _cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The flags of /proc/cpuinfo (empty where there is none, e.g. macOS, Windows)."""
    if not os.path.exists(cpuinfo):
        return set()
    with open(cpuinfo) as f:
        return {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def cpu_supports_bf16() -> dict[str, bool]:
    """Which bf16 hardware paths this CPU has (AMX tiles are the fast ones, on recent Xeons).

    ``onednn_bf16`` is PyTorch's own check (oneDNN runs bf16 matmuls, possibly by converting them on
    AVX-512); only ``amx_bf16`` and ``avx512_bf16`` are bf16 arithmetic in hardware.

    Example::

        >>> sorted(cpu_supports_bf16())
        ['amx_bf16', 'avx512_bf16', 'onednn_bf16']
    """
    flags = _cpu_flags()
    try:
        onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        onednn = False
    return {"amx_bf16": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "onednn_bf16": onednn}


def has_bf16_units(features: dict[str, bool] | None = None) -> bool:
    """True when the CPU multiplies bf16 in hardware (AMX or AVX-512-bf16).

    Args:
        features: what :func:`cpu_supports_bf16` returns (detected when ``None``).

    Example::

        >>> has_bf16_units({"amx_bf16": False, "avx512_bf16": True, "onednn_bf16": True})
        True
        >>> has_bf16_units({"amx_bf16": False, "avx512_bf16": False, "onednn_bf16": True})
        False
    """
    features = cpu_supports_bf16() if features is None else features
    return bool(features.get("amx_bf16") or features.get("avx512_bf16"))


def bf16_hardware_note(features: dict[str, bool] | None = None) -> str:
    """One sentence on what bf16 autocast will do to speed on this CPU, and why.

    Args:
        features: what :func:`cpu_supports_bf16` returns (detected when ``None``).

    Example::

        >>> bf16_hardware_note({"amx_bf16": True, "avx512_bf16": True, "onednn_bf16": True})[:31]
        'bf16 matmuls run in hardware (A'
    """
    features = cpu_supports_bf16() if features is None else features
    if has_bf16_units(features):
        units = " and ".join(name for key, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512-bf16"))
                             if features.get(key))
        return (f"bf16 matmuls run in hardware ({units}): chapter 06's bf16 autocast can speed up "
                f"matmul-heavy training here")
    if features.get("onednn_bf16"):   # AVX-512 without bf16 instructions: oneDNN converts to fp32
        how, expect = ("oneDNN converts them to fp32 on AVX-512",
                       "expect bf16 steps no faster than fp32, usually slower")
    else:
        how, expect = ("PyTorch emulates them in software",
                       f"expect bf16 steps far slower than fp32 (measured on such a CPU: a bf16 MLP "
                       f"training step at {EMULATED_BF16_RATIO}x the fp32 speed)")
    return (f"no AMX or AVX-512-bf16 on this CPU: bf16 matmuls are not done in hardware ({how}), so "
            f"chapter 06's bf16 speed-up will not appear here — {expect}; the chapter's numerics and "
            f"memory lessons hold all the same")
