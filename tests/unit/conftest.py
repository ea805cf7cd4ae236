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
    "agent",
    "clearer",
    "test_advertiser_free_set.py",
    "test_agent_plan_memo.py",
    "test_clear_batch.py",
    "test_cohost.py",
    "test_delivery_count.py",
    "test_event_loop.py",
    "test_executor_join.py",
    "test_log_context.py",
    "test_natsclient_headers.py",
    "test_service_settings.py",
    "test_spec_wording.py",
    "test_tracing.py",
]

collect_ignore = [] if _nats_importable() else NEEDS_NATS_CLIENT
