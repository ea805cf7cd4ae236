"""What of a job may leave the control plane: its spec without the values of ``params.env``, and a
round as another tenant may see it.

A job's ``params.env`` is how a tenant hands its program an API key or a token: the executor needs
the values (it sets them in the program's environment), nobody else does. Every answer that carries
a job's spec out of the control plane (the gateway's ``status``, ``list``, ``cancel``; the
dashboard's pages and JSON) passes it through ``redacted`` first: the names stay (a tenant can check
which variables its job sets), each value reads ``REDACTED``; the secrets its subjobs' completions
are proven with are taken out as well.

Pure: no I/O, used by the gateway and the dashboard alike.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sja.core.proofs import without_secrets
from sja.protocol.messages import JobSpec, JobState, RoundRecord, Verdict

REDACTED = "(redacted)"
"""What a value of ``params.env`` reads outside the control plane."""

OTHER = "(other tenant)"
"""What another tenant's job id and tenant read in a round a tenant is shown."""


def redacted_params(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with every value of its ``env`` map replaced by ``REDACTED`` (the same object
    when there is nothing to hide). A malformed ``env`` (not a map) is hidden whole."""
    env = params.get("env")
    if env is None or env == {}:
        return params
    out = dict(params)
    out["env"] = {str(k): REDACTED for k in env} if isinstance(env, dict) else REDACTED
    return out


def redacted_spec(spec: JobSpec) -> JobSpec:
    """The spec as anyone outside the control plane may see it."""
    params = redacted_params(spec.params)
    return spec if params is spec.params else msgspec.structs.replace(spec, params=params)


def redacted(state: JobState) -> JobState:
    """The job's state as anyone outside the control plane may see it: its spec redacted
    (``redacted_spec``) and its subjobs' completion secrets removed (``proofs.without_secrets``),
    everything else as it is."""
    state = without_secrets(state)
    spec = redacted_spec(state.spec)
    return state if spec is state.spec else msgspec.structs.replace(state, spec=spec)


def is_redacted(value: str) -> bool:
    """Whether ``value`` is a redacted one (a client handed a redacted spec must not use it)."""
    return value == REDACTED


def anonymize_round(record: RoundRecord, tenant: str) -> RoundRecord:
    """The round as a tenant may see it: other tenants' bids keep their outcome, score and size, but
    not their job, tenant or reason; their job ids are also taken out of the tenant's own reasons.
    An agent's verdict for replying without a bid (no job) is kept as it is."""
    others = {v.job_id for v in record.verdicts if v.tenant != tenant and v.job_id}
    if not others:
        return record

    def scrub(text: str) -> str:
        for job_id in sorted(others, key=len, reverse=True):
            text = text.replace(job_id, OTHER)
        return text

    verdicts = [
        msgspec.structs.replace(v, reason=scrub(v.reason))
        if v.tenant == tenant or not v.job_id
        else Verdict(
            job_id=OTHER,
            tenant=OTHER,
            agent_id=v.agent_id,
            won=v.won,
            reason="won" if v.won else "lost",
            score=v.score,
            size=v.size,
        )
        for v in record.verdicts
    ]
    winner = OTHER if record.winner_job in others else record.winner_job
    return msgspec.structs.replace(record, verdicts=verdicts, winner_job=winner, note=scrub(record.note))


__all__ = [
    "OTHER",
    "REDACTED",
    "anonymize_round",
    "is_redacted",
    "redacted",
    "redacted_params",
    "redacted_spec",
]
