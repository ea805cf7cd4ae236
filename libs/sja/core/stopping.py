"""When a subjob is asked to stop: a pure rule with no imports, so that the process that runs a
subjob (``sja.execution``) can apply it without loading the planner."""

from __future__ import annotations


def stop_grace(time_cap_s: float, first_unit: float, wanted_s: float) -> float:
    """How long before a subjob's deadline its stop signal comes (``SIGTERM``, ``should_stop``):
    what the job asks (``stop_grace_s``), but never before half its window, so that a short window
    still leaves time to work, nor before its planned start-up and first unit (``first_unit``,
    ``Subjob.first_unit_s``), so that a program is not stopped before it could finish one unit."""
    wanted = min(max(0.0, wanted_s), time_cap_s / 2)
    if first_unit > 0:
        return min(wanted, max(0.0, time_cap_s - first_unit))
    return wanted


__all__ = ["stop_grace"]
