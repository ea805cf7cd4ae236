"""Grant, offer and batch identifiers."""

from __future__ import annotations

import os
import re

from sja.protocol.ids import new_id


def test_an_id_is_its_prefix_and_fixed_width_hex() -> None:
    assert re.fullmatch(r"g-[0-9a-f]{20}", new_id("g"))
    assert re.fullmatch(r"o-[0-9a-f]{8}", new_id("o", 8))


def test_ids_do_not_repeat() -> None:
    ids = [new_id("g") for _ in range(100_000)]
    assert len(set(ids)) == len(ids)


def test_a_forked_child_does_not_draw_the_parents_ids() -> None:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.close(r)
        os.write(w, " ".join(new_id("g") for _ in range(100)).encode())
        os._exit(0)
    os.close(w)
    parent = {new_id("g") for _ in range(100)}
    with os.fdopen(r, "rb") as f:
        child = set(f.read().decode().split())
    os.waitpid(pid, 0)
    assert len(child) == 100
    assert not parent & child
