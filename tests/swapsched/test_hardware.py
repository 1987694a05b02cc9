"""swapsched/hardware.py: shipped profiles, YAML pitfalls, validation."""

from __future__ import annotations

import pytest

from swapsched.hardware import HardwareError, hardware_names, load_hardware

REQUIRED = {"v100-pcie3", "a100-pcie4", "h100-pcie5", "h200-pcie5", "gh200-c2c", "rtx4090-pcie4", "cpu-emulated"}


def test_shipped_profiles_load_and_are_numbers():
    assert set(hardware_names()) >= REQUIRED
    for name in hardware_names():
        hw = load_hardware(name)
        assert hw.name == name
        for v in (hw.d2h_bytes_per_s, hw.h2d_bytes_per_s, hw.peak_flops, hw.memory_bytes_per_s):
            assert isinstance(v, float) and v > 0


def test_every_number_has_a_source_comment():
    from swapsched._paths import config_dir

    for p in (config_dir() / "hardware").glob("*.yaml"):
        for line in p.read_text().splitlines():
            if ":" in line and not line.startswith("#") and not line.startswith("name"):
                assert "#" in line, f"{p.name}: {line!r} has no source comment"


def test_yaml_11_exponent_strings_are_accepted(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("name: x\nd2h_bytes_per_s: 1.0e10\nh2d_bytes_per_s: 2e9\ncopy_latency_s: 1e-5\n"
                 "device_memory_bytes: 1e9\npeak_flops: 1e12\nmemory_bytes_per_s: 1e11\n")
    hw = load_hardware(p)
    assert hw.d2h_bytes_per_s == 1e10 and hw.h2d_bytes_per_s == 2e9 and hw.device_memory_bytes == 10**9


@pytest.mark.parametrize(
    "body, message",
    [
        ("name: x\n", "field d2h_bytes_per_s: missing"),
        ("name: x\nd2h_bytes_per_s: fast\nh2d_bytes_per_s: 1\ncopy_latency_s: 0\ndevice_memory_bytes: 1\npeak_flops: 1\n"
         "memory_bytes_per_s: 1\n", "field d2h_bytes_per_s: expected a number, got 'fast'"),
        ("name: x\nd2h_bytes_per_s: 0\nh2d_bytes_per_s: 1\ncopy_latency_s: 0\ndevice_memory_bytes: 1\npeak_flops: 1\n"
         "memory_bytes_per_s: 1\n", "field d2h_bytes_per_s: must be > 0"),
        ("name: x\nspeed: 1\n", "unknown field"),
        ("name: x\nd2h_bytes_per_s: 1\nh2d_bytes_per_s: 1\ncopy_latency_s: 0\ndevice_memory_bytes: 1\npeak_flops: 1\n"
         "memory_bytes_per_s: 1\nbf16_peak_flops: 0\n", "field bf16_peak_flops: must be > 0"),
        ("name: x\nd2h_bytes_per_s: 1\nh2d_bytes_per_s: 1\ncopy_latency_s: 0\ndevice_memory_bytes: 1\npeak_flops: 1\n"
         "memory_bytes_per_s: 1\nkind: tpu\n", "field kind: expected one of"),
        ("[1, 2", "not valid YAML"),
    ],
)
def test_bad_profiles(tmp_path, body, message):
    p = tmp_path / "bad.yaml"
    p.write_text(body)
    with pytest.raises(HardwareError, match=message):
        load_hardware(p)


def test_half_precision_peaks_where_the_device_has_the_unit():
    h100, v100 = load_hardware("h100-pcie5"), load_hardware("v100-pcie3")
    assert h100.peak_flops_for("bfloat16") == 756e12 and h100.peak_flops_for("float32") == 378e12
    assert v100.peak_flops_for("float16") == 112e12
    with pytest.raises(HardwareError, match="v100-pcie3 has no bfloat16 peak"):
        v100.peak_flops_for("bfloat16")
    assert load_hardware("cpu-emulated").kind == "cpu" and h100.kind == "gpu"


def test_unknown_name_lists_known():
    with pytest.raises(HardwareError, match="unknown hardware 'tpu'; known: .*h100-pcie5"):
        load_hardware("tpu")


def test_host_costs_are_optional_and_never_negative(tmp_path):
    from swapsched.hardware import HardwareError, load_hardware

    base = ("name: x\nd2h_bytes_per_s: 1.0e+9\nh2d_bytes_per_s: 1.0e+9\ncopy_latency_s: 0.0\n"
            "device_memory_bytes: 1000\npeak_flops: 1.0e+12\nmemory_bytes_per_s: 1.0e+11\n")
    p = tmp_path / "x.yaml"
    p.write_text(base)
    hw = load_hardware(p)
    assert hw.copy_issue_s == hw.wait_resume_s == 0.0
    p.write_text(base + "copy_issue_s: 5.0e-5\n")
    assert load_hardware(p).copy_issue_s == 5e-5
    p.write_text(base + "wait_resume_s: -1.0e-5\n")
    with pytest.raises(HardwareError, match="wait_resume_s: must be a finite number >= 0"):
        load_hardware(p)


@pytest.mark.parametrize(("name", "profile"), [
    ("NVIDIA H200", "h200-pcie5"), ("NVIDIA GH200 480GB", "gh200-c2c"), ("NVIDIA H100 PCIe", "h100-pcie5"),
    ("NVIDIA A100-SXM4-80GB", "a100-pcie4"), ("Tesla V100-PCIE-32GB", "v100-pcie3"),
    ("NVIDIA GeForce RTX 4090", "rtx4090-pcie4"), ("NVIDIA L4", None),
])
def test_a_gpu_gets_its_shipped_profile_by_name(name, profile):
    from swapsched.hardware import hardware_for_device, load_hardware

    assert hardware_for_device(name) == profile
    if profile is not None:
        load_hardware(profile)  # every name maps to a profile that ships
