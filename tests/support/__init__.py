"""Helpers shared by the test modules (see tests/conftest.py)."""

import os


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a subprocess: the suite's own flags (tests/conftest.py sets them in this
    process's environment) plus, when `devices` is given, that many fake CPU devices."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count=")]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)
