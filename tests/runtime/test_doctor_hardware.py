"""`doctor` tells what the hardware allows, with the CUDA state and the CPU's bf16 flags faked."""

import io
from types import SimpleNamespace

import pytest
import torch

import gpucourse as gc
from gpucourse.runtime import cpu_features, doctor as doctor_module
from gpucourse.runtime.doctor import doctor

AMX = {"amx_bf16": True, "avx512_bf16": True, "onednn_bf16": True}
AVX512_BF16 = {"amx_bf16": False, "avx512_bf16": True, "onednn_bf16": True}
AVX512_ONLY = {"amx_bf16": False, "avx512_bf16": False, "onednn_bf16": True}   # e.g. Skylake-SP
AVX2_ONLY = {"amx_bf16": False, "avx512_bf16": False, "onednn_bf16": False}    # most laptops


def _report(monkeypatch, *, gpus: int, nccl: bool, bf16: dict) -> str:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(name=f"Fake GPU {i}", total_memory=16 * 2**30))
    monkeypatch.setattr(doctor_module.dist, "is_nccl_available", lambda: nccl)
    monkeypatch.setattr(doctor_module, "cpu_supports_bf16", lambda: dict(bf16))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    out = io.StringIO()
    assert doctor(smoke_test=False, file=out) is True       # a note, never a reason to fail
    return out.getvalue()


def _line(report: str, label: str) -> str:
    return next(line for line in report.splitlines() if line.startswith(label))


def test_nccl_without_a_cuda_device_is_called_unusable(monkeypatch):
    report = _report(monkeypatch, gpus=0, nccl=True, bf16=AMX)
    backends = _line(report, "backends")
    assert "nccl compiled in, unusable: no CUDA device" in backends
    assert "nccl=yes" not in backends and "gloo=yes" in backends


def test_nccl_with_gpus_is_yes(monkeypatch):
    report = _report(monkeypatch, gpus=2, nccl=True, bf16=AMX)
    assert "nccl=yes" in _line(report, "backends") and "unusable" not in report
    assert "Fake GPU 1" in report


def test_nccl_not_built_is_no(monkeypatch):
    report = _report(monkeypatch, gpus=0, nccl=False, bf16=AMX)
    assert "nccl=no" in _line(report, "backends") and "unusable" not in report


@pytest.mark.parametrize("bf16", [AVX2_ONLY, AVX512_ONLY], ids=["avx2", "avx512-no-bf16"])
def test_cpu_without_bf16_units_says_chapter_06_speedup_will_not_appear(monkeypatch, bf16):
    report = " ".join(_report(monkeypatch, gpus=0, nccl=True, bf16=bf16).split())   # unwrap lines
    assert "NOTE: no AMX or AVX-512-bf16 on this CPU" in report
    assert "chapter 06's bf16 speed-up will not appear here" in report
    if bf16["onednn_bf16"]:
        assert "oneDNN converts them to fp32" in report
    else:
        assert "emulates them in software" in report and "0.02x the fp32 speed" in report


@pytest.mark.parametrize("bf16, units", [(AMX, "AMX and AVX-512-bf16"), (AVX512_BF16, "AVX-512-bf16")])
def test_cpu_with_bf16_units_says_so(monkeypatch, bf16, units):
    report = " ".join(_report(monkeypatch, gpus=0, nccl=True, bf16=bf16).split())
    assert f"bf16 matmuls run in hardware ({units})" in report
    assert "will not appear" not in report and "NOTE:" not in report


def test_cpu_flags_are_read_as_whole_words(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f amx_tile\n"
                    "bugs\t\t: amx_bf16_is_not_a_flag_here\n\nprocessor\t: 1\nflags\t\t: fpu avx512_bf16\n")
    assert cpu_features._cpu_flags(str(info)) == {"fpu", "sse", "avx2", "avx512f", "amx_tile", "avx512_bf16"}
    assert cpu_features._cpu_flags(str(tmp_path / "missing")) == set()


def test_detected_features_agree_with_proc_cpuinfo():
    features = gc.cpu_supports_bf16()
    flags = cpu_features._cpu_flags()
    assert features["amx_bf16"] == ("amx_bf16" in flags)
    assert features["avx512_bf16"] == ("avx512_bf16" in flags)
    assert gc.has_bf16_units(features) == (features["amx_bf16"] or features["avx512_bf16"])
