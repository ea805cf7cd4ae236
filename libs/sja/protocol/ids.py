"""Identifiers of grants, offers and offer batches: random hex, as the 20 hex digits of a
``uuid4`` were, from a generator seeded once per process by the operating system.

``uuid.uuid4`` asks the kernel for 16 bytes (a system call) and builds a ``UUID`` for every
identifier; the clearer names every grant and the advertiser every offer, thousands a second. These
identifiers must be unique, not secret: a grant is held by its lease's fence, never by knowing its
id, and every grant id is written to ``SJA_ROUNDS`` for anyone who may read it. With 80 random
bits, as before, two of a billion identifiers are the same with a chance of about one in two
million; and an identifier only has to differ from those of the grants and offers alive at the
same time. A forked child draws from a generator of its own (reseeded at the fork), never the
parent's sequence again."""

from __future__ import annotations

import os
import random

_rng = random.Random(os.urandom(32))


def _reseed() -> None:
    _rng.seed(os.urandom(32))


os.register_at_fork(after_in_child=_reseed)


def new_id(prefix: str, hex_digits: int = 20) -> str:
    """``<prefix>-<hex_digits random hex digits>``."""
    return f"{prefix}-{_rng.getrandbits(4 * hex_digits):0{hex_digits}x}"
