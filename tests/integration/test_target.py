"""Targets as users write them (TVM 0.27 rejects command-line strings)."""

import pytest
import tvm
from tvm.target import Target

from tvm_ext.target import AVX2, AVX512, NEON, host_target, parse_cli_target, resolve_target, vector_isa


def test_tvm_rejects_cli_strings():
    """The hazard tvm_ext absorbs: TVM 0.27 itself refuses the command-line form."""
    with pytest.raises(Exception, match="no longer supported"):
        Target("llvm -mcpu=znver3")


def test_cli_string_is_converted():
    t = resolve_target("llvm -mcpu=znver3 -mattr=+avx2,+fma")
    assert t.kind.name == "llvm" and str(t.attrs["mcpu"]) == "znver3"
    assert [str(v) for v in t.attrs["mattr"]] == ["+avx2", "+fma"]
    assert resolve_target("cuda -arch=sm_90").attrs["arch"] == "sm_90"


def test_parse_cli_values():
    cfg = parse_cli_target("llvm -mcpu=skylake-avx512 -num-cores=4 -keys=cpu,x86")
    assert cfg == {"kind": "llvm", "mcpu": "skylake-avx512", "num_cores": 4, "keys": ["cpu", "x86"]}
    with pytest.raises(ValueError, match="target kind"):
        parse_cli_target("-mcpu=znver3")


def test_dict_tag_target_and_json():
    assert str(resolve_target({"kind": "llvm", "mcpu": "znver3"}).attrs["mcpu"]) == "znver3"
    assert resolve_target("nvidia/nvidia-h100").kind.name == "cuda"
    t = Target({"kind": "llvm", "mcpu": "znver3"})
    assert resolve_target(t) is t
    assert str(resolve_target('{"kind": "llvm", "mcpu": "znver2"}').attrs["mcpu"]) == "znver2"


def test_plain_llvm_means_this_host():
    for spelled in ("llvm", None, Target("llvm"), {"kind": "llvm"}):
        t = resolve_target(spelled)
        assert str(t.attrs["mcpu"]) == tvm.target.codegen.llvm_get_system_cpu()
    assert resolve_target("llvm") == host_target() or str(resolve_target("llvm")) == str(host_target())


def test_unknown_target_names_it():
    with pytest.raises(ValueError, match="not-a-target"):
        resolve_target("not-a-target")
    with pytest.raises(TypeError):
        resolve_target(42)


def test_vector_isa_from_target():
    assert vector_isa("llvm -mcpu=znver3") == AVX2
    assert vector_isa("llvm -mcpu=skylake-avx512") == AVX512
    assert vector_isa({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72"}) == NEON
    assert vector_isa("llvm").lanes in (4, 8, 16)
    with pytest.raises(ValueError, match="not a CPU"):
        vector_isa("cuda -arch=sm_80")


def test_usable_cores_is_the_affinity_mask(monkeypatch):
    import os

    from tvm_ext.target import usable_cores

    assert usable_cores() == len(os.sched_getaffinity(0))
    monkeypatch.delattr(os, "sched_getaffinity")  # an OS that cannot say: every core
    assert usable_cores() == (os.cpu_count() or 1)


@pytest.mark.parametrize("mcpu,fast", [("znver4", True), ("znver5", True), ("znver3", False), ("cooperlake", False),
                                       ("sapphirerapids", False), ("skylake-avx512", False)])
def test_bf16_dot_doubles_fma_on_zen4_and_later(mcpu, fast):
    """AVX512-BF16 beats fp32 where vdpbf16ps does twice the FMA's FLOPs (Zen 4+); Cooper Lake
    and Sapphire Rapids have the instruction without that rate, Zen 3 and Skylake not at all."""
    from tvm_ext.target import bf16_dot_doubles_fma, has_avx512_bf16

    target = {"kind": "llvm", "mcpu": mcpu}
    assert bf16_dot_doubles_fma(target) == fast
    assert has_avx512_bf16(target) == (mcpu not in ("znver3", "skylake-avx512"))
