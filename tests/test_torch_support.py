"""The torch-version gates, over version strings as torch spells them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddp_hpc import torch_support


@pytest.mark.parametrize("version,release", [("2.5.1", (2, 5)), ("2.7.1+cu126", (2, 7)), ("2.8.0a0+gitc1b2d3e", (2, 8)),
                                             ("2.10.0+xpu", (2, 10)), ("3.0", (3, 0))])
def test_a_version_string_belongs_to_its_release(version, release):
    assert torch_support.parse(version) == release


@pytest.mark.parametrize("version", ["", "nightly", "v2.5.1"])
def test_a_string_that_is_no_version_is_refused(version):
    with pytest.raises(ValueError, match="not a torch version"):
        torch_support.parse(version)


@pytest.mark.parametrize("version,takes", [("2.4.1", False), ("2.5.1", False), ("2.6.0+cpu", False),
                                           ("2.7.1", False), ("2.8.0", True), ("2.10.0", True), ("2.14.1", True)])
def test_the_libuv_store_server_takes_a_bound_socket_from_torch_2_8(version, takes):
    assert torch_support.libuv_takes_listen_fd(version) is takes


@pytest.mark.parametrize("version", ["2.5.1", "2.6.0", "2.7.1+cu128"])
def test_fsdp2_is_refused_before_torch_2_8_in_one_line_naming_both_versions(version):
    refusal = torch_support.fsdp2_refusal(version)
    assert refusal is not None and "\n" not in refusal
    assert "training.strategy=fsdp2 needs torch 2.8 or newer" in refusal and f"this is torch {version}" in refusal


@pytest.mark.parametrize("version", ["2.8.0", "2.9.1+cu130", "2.14.1"])
def test_fsdp2_runs_from_torch_2_8(version):
    assert torch_support.fsdp2_refusal(version) is None


def test_the_declared_torch_range_starts_at_the_minimum():
    """pyproject.toml's lower bound is the MINIMUM the gates and CI use."""
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", text, re.M | re.S)
    assert dependencies is not None
    assert re.findall(r'"torch([<>=!~][^"]*)"', dependencies[1]) == [f">={torch_support.named(torch_support.MINIMUM)},<3"]


def test_the_ipex_extra_pins_intels_builds_for_the_last_torch_they_support_as_the_docs_say():
    """Unpinned names would resolve on PyPI to IPEX's CPU build and fail on oneccl_bind_pt."""
    repo = Path(__file__).parents[1]
    extra = re.search(r"^ipex = \[(.*)\]$", (repo / "pyproject.toml").read_text(), re.M)
    assert extra is not None
    pins = re.findall(r'"([^"]+)"', extra[1])
    last = torch_support.named(torch_support.IPEX_LAST)
    assert pins == [f"torch=={last}.*", f"intel-extension-for-pytorch=={last}.10+xpu", f"oneccl_bind_pt=={last}.0+xpu"]
    devices = (repo / "docs/devices.md").read_text()
    assert all(f"`{pin}`" in devices for pin in pins)
    assert (f"pip install 'ddp_hpc[ipex]' --extra-index-url https://pytorch-extension.intel.com/release-whl/stable/xpu/us/"
            in devices)


@pytest.mark.parametrize("version,save_load,async_save", [("2.5.1", False, False), ("2.6.0", False, False),
                                                          ("2.7.1", True, False), ("2.8.0", True, False),
                                                          ("2.9.0", True, True), ("2.14.1", True, True)])
def test_dcp_takes_no_dist_from_2_7_and_async_save_a_stager_from_2_9(version, save_load, async_save):
    assert torch_support.dcp_takes_no_dist(version) is save_load
    assert torch_support.dcp_async_takes_stager(version) is async_save


def test_the_dcp_gates_agree_with_the_installed_torchs_own_signatures():
    import inspect

    import torch.distributed.checkpoint as dcp

    version = torch_support.installed()
    assert ("no_dist" in inspect.signature(dcp.save).parameters) is torch_support.dcp_takes_no_dist(version)
    assert ("no_dist" in inspect.signature(dcp.load).parameters) is torch_support.dcp_takes_no_dist(version)
    assert ("async_stager" in inspect.signature(dcp.async_save).parameters) is \
        torch_support.dcp_async_takes_stager(version)


@pytest.mark.parametrize("version,refused", [("2.4.1", True), ("2.3.0+cpu", True), ("2.5.1", False),
                                             ("2.14.1", False)])
def test_a_torch_below_the_minimum_is_refused_in_one_line_naming_both_versions(version, refused):
    refusal = torch_support.unsupported(version)
    assert (refusal is not None) is refused
    if refused:
        assert "\n" not in refusal and version in refusal and "torch>=2.5" in refusal


def test_process_group_refuses_a_torch_below_the_minimum_before_anything_starts(monkeypatch):
    from ddp_hpc.startup import distributed
    from ddp_hpc.errors import UserError

    monkeypatch.setattr(distributed, "installed", lambda: "2.4.1+cu121")
    with pytest.raises(UserError, match=r"needs torch 2\.5 or newer, and this is torch 2\.4\.1\+cu121"):
        with distributed.process_group(environ={}):
            pass
