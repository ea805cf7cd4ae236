"""Job spec errors: every problem at once, each naming its field, in SJA's words."""

from __future__ import annotations

from pathlib import Path

import pytest

from sja.client import SpecErrors, load_spec, read_spec_file
from sja.protocol.wording import plain


def test_every_problem_of_a_spec_at_once() -> None:
    text = (
        "name: a b\nworkload: matmul\nmax_parallel: two\neps_mem: 0.9\nparams: {rows: many}\n"
        "mode: greedy\ncolour: red\nmemory: {base_mib: -1, per_unit_mib: 1}\n"
    )
    with pytest.raises(SpecErrors) as got:
        load_spec(text, "bad.yaml")
    assert got.value.problems == [
        "bad.yaml: name: must be one word of letters, digits, '_' and '-'",
        "bad.yaml: tenant: missing (required)",
        "bad.yaml: mode: 'greedy' is not one of sja, jasda",
        "bad.yaml: eps_mem: must be more than 0 and less than 0.5, not 0.9",
        "bad.yaml: max_parallel: must be a whole number, not text",
        "bad.yaml: memory.base_mib: must be at least 0 and at most 1e+09, not -1",
        "bad.yaml: colour: unknown field (known: bid_per_gpu_s, deadline_s, eps_mem, eps_time, "
        "facts, gpus, max_parallel, memory, min_units, mode, name, params, priority, tenant, time, workload)",
        "bad.yaml: params.rows: expected an integer, got 'many'",
    ]
    for line in got.value.problems:
        assert "Expected `" not in line and "$." not in line


def test_msgspec_words_are_not_shown() -> None:
    assert plain("Expected `int`, got `str` - at `$.max_parallel`") == "must be a whole number, not text"
    assert plain("Expected `float` <= 0.5 - at `$.spec.eps_mem`") == "must be a number at most 0.5"


def test_unreadable_files_are_named(tmp_path: Path) -> None:
    png = tmp_path / "picture.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(SpecErrors, match=r"picture\.png: not a text file \(byte 0x89 at offset 0"):
        read_spec_file(png)
    with pytest.raises(SpecErrors, match=r"missing\.yaml: no such file"):
        read_spec_file(tmp_path / "missing.yaml")
    with pytest.raises(SpecErrors, match="is a directory"):
        read_spec_file(tmp_path)
    with pytest.raises(SpecErrors, match=r"y\.yaml: not valid YAML/JSON at line \d+, column \d+: "):
        load_spec("name: [unclosed\n", "y.yaml")


def test_a_range_of_units_is_written_one_way() -> None:
    """``[start, start + count)`` as its first and last unit, both included, and the count: the
    count tells the reader the last unit is included (``0-7 (8)`` is eight units, not nine)."""
    from sja.protocol.wording import unit_range

    assert unit_range(0, 8) == "0-7 (8)"
    assert unit_range(1, 8) == "1-8 (8)"
    assert unit_range(5, 1) == "5 (1)"
    assert unit_range(5, 0) == "none from 5 (0)"
    for start, count in [(0, 1), (3, 2), (100, 57)]:
        first, _, rest = unit_range(start, count).partition("-")
        if rest:
            last, n = rest.split(" ")
            assert int(last) - int(first) + 1 == int(n.strip("()")) == count


def test_a_gpu_budget_is_checked_in_words() -> None:
    with pytest.raises(SpecErrors) as got:
        load_spec("name: a\ntenant: t\nworkload: matmul\ngpus: 0\n", "bad.yaml")
    assert got.value.problems == ["bad.yaml: gpus: must be more than 0 and at most 64, not 0"]
