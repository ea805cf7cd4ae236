"""Publishes and subscriptions the NATS server refused (``Permissions Violation``).

The server reports them without closing the connection; ``connect`` logs each one at ERROR with the
subject and hands it to the caller's ``on_permission_violation`` so services can count them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class PermissionViolation:
    """A publish or subscribe the server refused for this connection's user."""

    operation: str
    """``publish`` or ``subscription``."""
    subject: str
    """As the server reported it (the client library lower-cases server errors)."""
    message: str


_VIOLATION = re.compile(
    r"permissions violation for (publish|subscription) to \"?([^\"\s]+)\"?", re.IGNORECASE
)


def parse_permission_violation(error: object) -> PermissionViolation | None:
    """The violation a NATS error reports, or ``None`` for any other error."""
    text = str(error)
    found = _VIOLATION.search(text)
    if found is None:
        return None
    return PermissionViolation(operation=found.group(1).lower(), subject=found.group(2), message=text)
