"""Elastic mode (``enable_shrink=True``): ranks SIGKILLed mid-run are masked on every
survivor, the survivors go on, and every step of either mode stays exact against the
reference without them."""

import pytest

from conftest import launch


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_killed_rank_is_masked_and_the_others_go_on(nodes):
    env = {"UEP_RANKS_PER_NODE": str(4 // nodes), "UEP_TIMEOUT_S": "60"}
    results = launch("elastic", 4, env=env, killed=(3,), victims=(3,), kill_step=4)
    for r in range(3):
        assert results[r]["masked"] == [3], results[r]
        assert results[r]["first_masked"] == 4, results[r]
        assert "rank 3" in results[r]["reasons"][3], results[r]


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_rank_killed_within_a_combine_counts_until_the_mask_says_otherwise(nodes):
    # Its expert outputs reach the survivors, its agreement message does not: the
    # combine may count them, and then the mask read right after it must not name it
    # (each step's check reads the mask after the call).
    env = {"UEP_RANKS_PER_NODE": str(4 // nodes), "UEP_TIMEOUT_S": "60"}
    results = launch("elastic", 4, env=env, killed=(3,), victims=(3,), kill_step=4,
                     die_in_combine=True)
    for r in range(3):
        assert results[r]["masked"] == [3], results[r]
        assert results[r]["first_masked"] in (4, 5), results[r]


def test_a_killed_node_is_masked_and_the_other_goes_on():
    env = {"UEP_RANKS_PER_NODE": "2", "UEP_TIMEOUT_S": "60"}
    results = launch("elastic", 4, env=env, killed=(2, 3), victims=(2, 3), kill_step=5)
    for r in range(2):
        assert results[r]["masked"] == [2, 3], results[r]


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("after_dispatch", [False, True])
def test_normal_mode_goes_on_without_a_killed_rank(nodes, after_dispatch):
    # Across nodes rank 3 relays rank 1's tokens into node 1; killed after its dispatch,
    # the combine needs a substitute that never saw rank 1's dispatch packet.
    env = {"UEP_RANKS_PER_NODE": str(4 // nodes), "UEP_TIMEOUT_S": "60"}
    results = launch("elastic_normal", 4, env=env, killed=(3,), victims=(3,), kill_step=4,
                     die_after_dispatch=after_dispatch)
    for r in range(3):
        assert results[r]["masked"] == [3], results[r]
        assert results[r]["first_masked"] == 4 + after_dispatch, results[r]
        assert results[r]["refused"] is True, results[r]


def test_the_mask_api_needs_enable_shrink():
    results = launch("mask_without_shrink", 2)
    assert all(r["raised"] for r in results), results


def test_the_door_is_kept_in_the_launchers_store_or_says_why_not(monkeypatch):
    """The door lives in the ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` (a real one
    here, as a launcher keeps it); where none answers, it falls back to shared memory
    with a warning, within seconds, rather than after retries for uep's deadline."""
    import datetime
    import socket
    import time
    import warnings

    import torch.distributed as dist

    import uep.buffer as ub

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    name, store = ub._door(30.0)
    assert name == ub._uep.door_name(f"127.0.0.1:{server.port}") and store is not None
    store.set(name + "/probe", b"x")
    assert server.get(name + "/probe") == b"x"
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        name, store = ub._door(30.0)
    assert name is not None and store is None
    assert any("shared memory" in str(w.message) for w in caught), caught
    assert time.monotonic() - start < 15
    monkeypatch.delenv("MASTER_ADDR")
    assert ub._door(30.0) == (None, None)
