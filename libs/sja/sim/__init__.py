"""Discrete-event simulator: replays cluster traces through the same decision core as the services,
and compares SJA with the rigid baselines (FIFO, EASY backfill, best-fit static MIG)."""
