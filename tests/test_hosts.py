from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddp_hpc.environment.hosts import expand_nodelist, read_nodefile, with_suffix
from ddp_hpc.environment.ports import PortRange, derive_port
from ddp_hpc.errors import UserError


@pytest.mark.parametrize("nodelist,expected", [
    ("n1", ["n1"]),
    ("n[1-2]", ["n1", "n2"]),
    ("n[001-004,7]", ["n001", "n002", "n003", "n004", "n7"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
    ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("nid[001000-001001]-hsn", ["nid001000-hsn", "nid001001-hsn"]),
])
def test_expand_nodelist(nodelist, expected):
    assert expand_nodelist(nodelist) == expected


@pytest.mark.parametrize("bad", ["n[1-2", "n1-2]", "n[a-b]", "n[3-1]", "", ","])
def test_bad_nodelists_are_refused(bad):
    with pytest.raises(UserError):
        expand_nodelist(bad)


@given(st.lists(st.integers(0, 999), min_size=1, max_size=30, unique=True))
def test_nodelist_round_trip(numbers):
    numbers = sorted(numbers)
    body = ",".join(f"{n:03d}" for n in numbers)
    assert expand_nodelist(f"node[{body}]") == [f"node{n:03d}" for n in numbers]


def test_nodefile_keeps_order_and_drops_repeats(tmp_path):
    path = tmp_path / "nodefile"
    path.write_text("b\nb\na\n\na\nc\n")
    assert read_nodefile(path) == ["b", "a", "c"]


def test_empty_nodefile_is_refused(tmp_path):
    path = tmp_path / "nodefile"
    path.write_text("\n")
    with pytest.raises(UserError, match="lists no hosts"):
        read_nodefile(path)


def test_with_suffix():
    assert with_suffix("x1.cm.example", "-hsn0") == "x1-hsn0"
    assert with_suffix("x1-hsn0", "-hsn0") == "x1-hsn0"
    assert with_suffix("x1.cm.example", "") == "x1.cm.example"


@given(st.text(min_size=1, max_size=60))
def test_derived_ports_stay_in_range(key):
    port_range = PortRange(21000, 21999)
    assert 21000 <= derive_port(key, port_range) <= 21999
    assert derive_port(key, port_range) == derive_port(key, port_range)
