"""Chapter 06 reads its measured bf16 ratio through `gc.explain_bf16_speedup`: the reading must
follow the measurement and the hardware, never one machine's result."""

import pytest

import gpucourse as gc

AMX = {"amx_bf16": True, "avx512_bf16": False, "onednn_bf16": True}
NONE = {"amx_bf16": False, "avx512_bf16": False, "onednn_bf16": False}


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_without_bf16_units_a_model_with_few_matmuls_is_read_by_its_share():
    text = _flat(gc.explain_bf16_speedup(0.98, 0.2, NONE, name="ElementwiseNet"))
    assert "about as fast as fp32 (0.98x)" in text and "Matmuls were 20% of the fp32 step, too little" in text
    assert "no AMX or AVX-512-bf16" in text and "emulated anyway" in text and "far slower" not in text


@pytest.mark.parametrize("ratio", [0.006, 0.02, 0.5, 1.0, 2.0])
def test_without_bf16_units_the_speedup_is_said_not_to_appear(ratio):
    text = _flat(gc.explain_bf16_speedup(ratio, 0.9, NONE, name="MLP"))
    assert "will not appear here" in text and "emulates" in text
    assert "ran on this CPU's bf16 units" not in text
    if ratio >= 1.1:
        assert f"{ratio:.2f}x as fast" in text
    elif ratio >= 0.9:
        assert f"about as fast as fp32 ({ratio:.2f}x)" in text
    else:
        assert "slower" in text


def test_with_amx_and_a_gain_the_units_are_credited_and_the_bound_given():
    text = _flat(gc.explain_bf16_speedup(1.8, 0.75, AMX, name="MLP"))
    assert text.startswith("MLP: bf16 made the step 1.80x as fast as fp32.")
    assert "at most 4.0x" in text and "ran on this CPU's bf16 units" in text
    assert "will not appear" not in text


@pytest.mark.parametrize("ratio, share, words", [
    (1.0, 0.9, "a gain was possible"),
    (0.5, 0.9, "slower although this CPU has bf16 units"),
    (0.95, 0.2, "too little of this step is matmul"),
])
def test_with_amx_and_no_gain_the_reason_follows_the_numbers(ratio, share, words):
    text = _flat(gc.explain_bf16_speedup(ratio, share, AMX))
    assert words in text and "ran on this CPU's bf16 units" not in text


@pytest.mark.parametrize("features", [AMX, NONE])
def test_a_ratio_beyond_amdahls_bound_is_called_noise(features):
    text = _flat(gc.explain_bf16_speedup(1.92, 0.18, features, name="ElementwiseNet"))
    assert "1.92x as fast" in text and "more than Amdahl's law allows" in text and "at most 1.2x" in text
    assert "Run the cell again" in text and "ran on this CPU's bf16 units" not in text
    # just inside the bound (with 10% slack for timing noise) it is a gain, read normally
    assert "more than Amdahl" not in gc.explain_bf16_speedup(1.3, 0.18, AMX)


def test_about_even_is_not_called_slower():
    assert "about as fast as fp32 (0.97x)" in gc.explain_bf16_speedup(0.97, 0.7, AMX)


def test_the_slowdown_is_stated_as_a_factor():
    assert "50x slower (0.02x fp32)" in gc.explain_bf16_speedup(0.02, 0.9, NONE)
    assert "2.0x slower (0.5x fp32)" in gc.explain_bf16_speedup(0.5, 0.9, NONE)


@pytest.mark.parametrize("kwargs, error", [
    (dict(ratio=0.0, matmul_share=0.5), ValueError),
    (dict(ratio=float("nan"), matmul_share=0.5), ValueError),
    (dict(ratio=1.0, matmul_share=1.5), ValueError),
    (dict(ratio="fast", matmul_share=0.5), TypeError),
    (dict(ratio=1.0, matmul_share=0.5, features=["amx_bf16"]), TypeError),
])
def test_bad_arguments(kwargs, error):
    with pytest.raises(error):
        gc.explain_bf16_speedup(**kwargs)
