"""Unit tests run without a NATS server. Most of them test the decision core and need no NATS client
either; the modules below test services' and the bus layer's own logic (and import them, hence
nats-py), so where nats-py is not installed they are left out and the rest still runs."""

from __future__ import annotations

import importlib


def _nats_importable() -> bool:
    try:
        importlib.import_module("nats.aio.client")
    except ImportError:
        return False
    return True


NEEDS_NATS_CLIENT = [
    "advertiser",
    "agent",
    "clearer",
    "executor",
    "stack",
    "bus/test_delivery_count.py",
    "bus/test_event_loop.py",
    "bus/test_natsclient_headers.py",
    "bus/test_service_settings.py",
    "bus/test_tracing.py",
    "core/policies/test_clear_batch.py",
    "protocol/test_spec_wording.py",
]

collect_ignore = [] if _nats_importable() else NEEDS_NATS_CLIENT
