"""Completion proofs: a completion is accepted only from the executor that holds its grant.

When an agent materializes a subjob it makes a secret for it (``PROOF_KEY_BYTES`` random bytes),
keeps it in the job's state (``InFlight.proof_key``, KV ``sja-jobs``, which no tenant reads) and
sends it in the ``Subjob`` (``proof_key``) to the executor. The executor returns, in the
``Completion`` (``proof``), an HMAC-SHA256 with that secret over the completion's identity and
outcome (``proof_message``). The agent checks it (``verify_completion``, in constant time) before
it folds the completion in: a completion published by anyone else (a leaked service password, a
tenant's program) carries no proof or a wrong one, and is dropped.

The secret never reaches tenant code: the executor strips it from the subjob it hands to the slice
(``without_proof_key``) and signs in its own process.
"""

from __future__ import annotations

import hashlib
import hmac
from enum import StrEnum

import msgspec

from sja.protocol.messages import Completion, InFlight, JobState, Subjob

PROOF_KEY_BYTES = 32
"""Length of a subjob's secret."""


class Unproven(StrEnum):
    """Why a completion was not accepted as the grant holder's."""

    NOT_IN_FLIGHT = "no subjob of that id and grant is in flight"
    NO_KEY = "its subjob has no proof key (materialized before completions were proven)"
    NO_PROOF = "it carries no proof"
    BAD_PROOF = "its proof does not verify"


def proof_message(c: Completion) -> bytes:
    """The bytes a proof covers: the completion's identity (job, subjob, grant, fence) and its
    outcome (status, the range and units done, the SHA-256 of its output checkpoint, whether it
    is final), one field a line. Fields that are free text (the error, the program's output) and
    measurements are not covered: they change nothing a forged completion could gain."""
    out = hashlib.sha256(c.output_checkpoint).hexdigest()
    fields = (
        c.job_id,
        c.subjob_id,
        c.grant_id,
        str(c.fence),
        c.status,
        str(c.units_done),
        str(c.unit_start),
        str(c.units),
        out,
    )
    # A final failure (the job fails at once) is outcome too; a completion without it signs as
    # completions always have.
    return "\n".join((*fields, "final") if c.final else fields).encode()


def sign(key: bytes, c: Completion) -> str:
    """The proof of ``c`` under ``key`` (hex)."""
    return hmac.new(key, proof_message(c), hashlib.sha256).hexdigest()


def signed(c: Completion, key: bytes) -> Completion:
    """``c`` with its proof under ``key`` (no key: ``c`` unproven, as it is)."""
    if not key:
        return c
    return msgspec.structs.replace(c, proof=sign(key, c))


def flight_of(state: JobState, c: Completion) -> InFlight | None:
    for f in state.in_flight:
        if f.subjob_id == c.subjob_id and f.grant_id == c.grant_id:
            return f
    return None


def verify_completion(state: JobState, c: Completion) -> Unproven | None:
    """``None`` when ``c`` carries the proof of a subjob of ``state`` in flight; else why not.

    A completion of no subjob in flight (a duplicate, one already given up) is reported as such:
    the caller decides whether that is news (``jobs.apply_completion`` ignores it anyway)."""
    flight = flight_of(state, c)
    if flight is None:
        return Unproven.NOT_IN_FLIGHT
    if not flight.proof_key:
        return Unproven.NO_KEY
    if not c.proof:
        return Unproven.NO_PROOF
    if not hmac.compare_digest(sign(flight.proof_key, c), c.proof):
        return Unproven.BAD_PROOF
    return None


def without_proof_key(sj: Subjob) -> Subjob:
    """The subjob as the slice and the program may see it: without its secret."""
    return msgspec.structs.replace(sj, proof_key=b"") if sj.proof_key else sj


def without_secrets(state: JobState) -> JobState:
    """The job's state as it may be shown (status, listings, the dashboard): its subjobs' secrets
    removed."""
    if not any(f.proof_key for f in state.in_flight):
        return state
    flights = [msgspec.structs.replace(f, proof_key=b"") for f in state.in_flight]
    return msgspec.structs.replace(state, in_flight=flights)
