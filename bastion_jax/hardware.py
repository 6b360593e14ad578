"""Who this machine is, for the caches that hold its measurements (weight layout, step calibration).

A measured cost is only valid on the machine that measured it. JAX names a GPU precisely ("NVIDIA
H100 80GB HBM3") but every CPU plainly "cpu", and a VM often reports one generic model name over
different chips, so a CPU is told apart by its model name, vendor, family, model number, a hash of
its instruction-set flags and its core count.
"""

from __future__ import annotations

import hashlib
import os
import platform
from functools import cache


def cpu_name() -> str:
    """The CPU's model name (what the caches record; benchmarks name the device with it)."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_identity() -> list[str]:
    """What tells two CPUs apart for a cache key (see the module docstring)."""
    info = _cpuinfo()
    flags = hashlib.sha256(" ".join(sorted(info.get("flags", "").split())).encode()).hexdigest()[:12]
    return [cpu_name(), info.get("vendor_id", ""), info.get("cpu family", ""), info.get("model", ""), flags,
            str(os.cpu_count())]


def cpu_has_bf16_units() -> bool:
    """Whether this CPU multiplies bf16 in hardware: AVX512-BF16 or AMX-BF16 among its flags (False
    where there is no /proc/cpuinfo, e.g. off Linux)."""
    return bool({"avx512_bf16", "amx_bf16"} & set(_cpuinfo().get("flags", "").split()))


def device_kind() -> str:
    """The first JAX device's own name ("NVIDIA H100 80GB HBM3"); on CPU the CPU's identity, since JAX
    calls every CPU "cpu" and a calibration made on one CPU misprices steps on another."""
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        return "cpu: " + " | ".join(cpu_identity())
    return str(device.device_kind)


@cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none), read once."""
    out: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                out[key.strip()] = value.strip()
    except OSError:
        pass
    return out
