from __future__ import annotations

import os

from bench.common import host_cpu, machine_description


def test_host_cpu_names_the_model_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654 96-Core\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 9654 96-Core\n"
    )
    assert host_cpu(str(cpuinfo)) == f"AMD EPYC 9654 96-Core x{os.cpu_count()}"


def test_host_cpu_without_cpuinfo_falls_back_to_platform(tmp_path):
    described = host_cpu(str(tmp_path / "missing"))
    assert described.endswith(f" x{os.cpu_count()}") and described != f" x{os.cpu_count()}"


def test_machine_description_names_the_host():
    assert host_cpu() in machine_description()
