"""The clearer's round records: one per offer, what became of its round (``RoundRecord``), stored
in ``SJA_ROUNDS`` for ``sja trace``, ``sja explain`` and the ledger's replay; tried again in the
background while the stream cannot take them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from services.clearer.rounds import OpenRound
from sja.bus.codec import encode
from sja.bus.jetstream import JetStream
from sja.bus.tracing import inject, trace_id_hex
from sja.core import grants
from sja.core.policies import Decision, grant_cost
from sja.core.rounds import Shared, pack_records, whole_record
from sja.protocol import subjects
from sja.protocol.messages import Grant, Offer, RoundBatch, RoundRecord
from sja.telemetry.metrics import Counter

log = logging.getLogger("services.clearer.service")

ROUND_ITEMS_PER_MESSAGE = 2048
"""Round records (weighing two) and shared verdicts (one) per ``SJA_ROUNDS`` message: a batch's
records, split so a message stays small (well under 1 MB)."""
RECORD_RETRY_S = 60.0
"""How long a batch's round records are tried again in the background when ``SJA_ROUNDS`` cannot take
them (a stream with no leader for a few seconds after a server is lost): within the stream's
two-minute duplicate window, so a try that was stored but not acknowledged is not stored twice."""
MAX_RECORD_RETRIES = 10_000
"""Record messages being tried again at once; past this a message is counted lost at once (memory
stays bounded while JetStream is down)."""


def round_record(
    rnd: OpenRound,
    offer: Offer,
    decision: Decision,
    grant: Grant | None,
    note: str,
    because: str,
    bids: int,
) -> RoundRecord:
    """The record of one offer's round: its verdicts (a winner without a grant lost, ``note`` its
    reason), its grant, why it closed, what it cost."""
    verdicts = list(decision.verdicts)
    if grant is None and decision.winner is not None:
        verdicts = grants.unwon(verdicts, note)
    record = RoundRecord(
        offer_id=offer.offer_id,
        round=offer.round,
        window=offer.window,
        policy=decision.policy,
        replies_from=sorted(rnd.replies),
        verdicts=verdicts,
        winner_job=grant.job_id if grant else "",
        grant_id=grant.grant_id if grant else "",
        fence=grant.fence if grant else 0,
        closed_because=because,  # type: ignore[arg-type]
        note=note,
        trace_id=trace_id_hex(),
        opened_at=rnd.opened_at,
        cleared_at=time.time(),
        charged_gpu_s=grant_cost(offer, grant.candidate) if grant else 0.0,
        price=decision.price if grant else 0.0,
        batch_id=rnd.key if len(rnd.offers) > 1 else "",
        bids=bids,
    )
    return record


class RecordWriter:
    """Stores a clearer's round records in ``SJA_ROUNDS``."""

    def __init__(
        self,
        jetstream: Callable[[], JetStream],
        spawn: Callable[[Coroutine[Any, Any, Any]], object],
        lost: Counter,
    ) -> None:
        self.jetstream = jetstream
        self.spawn = spawn
        self.lost = lost
        """``sja_round_records_lost``: messages the stream never took."""
        self.retries = 0
        """Record messages being tried again now."""

    async def publish(self, rnd: OpenRound, records: list[RoundRecord], shared: list[Shared]) -> None:
        """The batch's round records in ``SJA_ROUNDS`` messages of ``ROUND_ITEMS_PER_MESSAGE`` (a
        lone offer's record on its own, whole), de-duplicated by batch (or offer) id. A message
        carries each group's shared verdicts once (``RoundBatch.shared``)."""
        pool = rnd.offers[0].window.pool
        if len(rnd.offers) == 1 and rnd.key == rnd.offers[0].offer_id:
            parts: list[tuple[str, RoundRecord | RoundBatch]] = [
                (rnd.key, whole_record(records[0], shared[0]))
            ]
        else:
            batches = pack_records(rnd.key, records, shared, ROUND_ITEMS_PER_MESSAGE)
            parts = [(f"{rnd.key}:{first}", b) for first, b in batches]
        subject = subjects.round_cleared(pool)
        for msg_id, payload in parts:
            data, headers = encode(payload), inject({"Nats-Msg-Id": msg_id})
            try:
                await self.jetstream().publish(subject, data, headers=headers)
            except Exception as e:
                # The grants are out: their records follow when the stream takes them, without
                # holding the round's outcomes back.
                if self.retries >= MAX_RECORD_RETRIES:
                    self.lost.add(1)
                    log.error("round records %s not stored (%r; too many waiting already)", msg_id, e)
                    continue
                log.warning("round records %s not stored yet (%r): trying again", msg_id, e)
                self.retries += 1
                self.spawn(self._store_later(subject, data, headers, msg_id))

    async def _store_later(self, subject: str, data: bytes, headers: dict[str, str], msg_id: str) -> None:
        try:
            await self.jetstream().publish_until(
                subject, data, headers, until=time.time() + RECORD_RETRY_S, first_delay_s=0.1
            )
            log.info("round records %s stored", msg_id)
        except asyncio.CancelledError:
            log.error("round records %s lost: the clearer stopped before SJA_ROUNDS took them", msg_id)
            raise
        except Exception as e:
            self.lost.add(1)
            log.error(
                "round records %s lost: SJA_ROUNDS did not take them in %.0fs (%r)", msg_id, RECORD_RETRY_S, e
            )
        finally:
            self.retries -= 1
