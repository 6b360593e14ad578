"""Counts XLA backend compilations process-wide (jax.monitoring), to prove none happen after warm-up.

The engine's own executables are compiled ahead of time, so a compilation inside the decode loop
can only come from stray jnp work on the host path; this counter catches that too.
"""

from __future__ import annotations

from jax import monitoring

_EVENT = "/jax/core/compile/backend_compile_duration"
_count = 0
_registered = False


def _listener(name: str, duration: float, **kwargs) -> None:
    global _count
    if name == _EVENT:
        _count += 1


def compilations() -> int:
    """Backend compilations seen since the first call of this function."""
    global _registered
    if not _registered:
        monitoring.register_event_duration_secs_listener(_listener)
        _registered = True
    return _count
