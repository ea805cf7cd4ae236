"""SJA: Scheduler-Driven Job Atomization for MIG GPU clusters."""

__version__ = "0.1.0"
