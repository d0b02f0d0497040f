"""What users hit: empty ranks and empty outputs, memory that grows with the shapes,
capacity errors, bad input on one rank, a dead or absent peer, the GIL, event flags."""

import pytest

from conftest import launch


def test_zero_token_and_zero_receive_ranks_keep_shapes():
    assert all(r["ok"] for r in launch("empty_ranks", 3))
    assert all(r["ok"] for r in launch("empty_ranks", 4, env={"UEP_RANKS_PER_NODE": "2"}))


def test_memory_grows_with_the_shapes_used():
    results = launch("growth", 2)
    for r in results:
        assert r["small"] < 64 << 20 and r["grown"] > r["small"]


def test_a_call_past_the_capacity_names_bytes_and_argument():
    for r in launch("capacity_error", 2):
        assert "raise num_nvl_bytes" in r["msg"], r["msg"]
        assert r["type"] == "CapacityError", r


@pytest.mark.parametrize("what", ["dtype", "ids", "noncontiguous", "ll_hidden", "ll_out_in_buffer",
                                  "ll_nvfp4_no_scale", "ll_comp_signal"])
@pytest.mark.parametrize("first_call", [True, False])
def test_bad_input_on_one_rank_raises_everywhere(what, first_call):
    results = launch("bad_input", 4, what=what, first_call=first_call)
    for rank, r in enumerate(results):
        assert r["seconds"] < 10, r
        if rank == 1:
            assert "invalid argument" in r["error"], r
            assert r["type"] == "InvalidArgumentError" and r["value_error"], r
        else:
            assert "rank 1" in r["error"], r
            assert r["type"] == "PeerAbortedError", r


@pytest.mark.parametrize("mode", ["normal", "ll"])
def test_a_killed_peer_is_noticed_at_once(mode):
    results = launch("dead_peer", 4, env={"UEP_TIMEOUT_S": "60"}, killed=(3,), mode=mode)
    for r in results[:3]:
        assert "rank 3" in r["error"] and "died" in r["error"], r
        # Whoever notices first raises PeerLostError and tells the others, who may hear
        # it from that rank first (PeerAbortedError, naming the death too).
        assert r["type"] in ("PeerLostError", "PeerAbortedError"), r
        assert r["seconds"] < 5, r
    assert any(r["type"] == "PeerLostError" for r in results[:3]), results


def test_an_absent_peer_times_out_with_a_message():
    results = launch("timeout", 4, env={"UEP_TIMEOUT_S": "2"})
    for r in results[:3]:
        assert "timeout" in r["error"] and "rank 3" in r["error"], r
        # The first rank to give up raises the timeout and tells the others, whose
        # error is that peer's.
        assert (r["type"], r["timeout_error"]) in (("UepTimeoutError", True), ("PeerAbortedError", False)), r
        assert 1.5 < r["seconds"] < 10, r
    assert results[3] == {"skipped": True}


def test_the_gil_is_released_while_a_call_waits():
    results = launch("gil_released", 2)
    # Rank 0 waited about a second for rank 1, and its other thread kept running.
    assert results[0]["waited"] > 0.5 and results[0]["ticks"] > 100, results


def test_every_event_flag_combination():
    assert all(r["combos"] == 8 for r in launch("events_and_flags", 2))


@pytest.mark.parametrize("mode", ["normal", "ll", "other_op"])
@pytest.mark.parametrize("bad_rank", [0, 2])
def test_a_rank_that_rejects_its_input_early_strands_no_one(bad_rank, mode):
    # uep's exchanges run on a group of its own under UEP_TIMEOUT_S: the others raise
    # within that deadline, naming the absent rank, and the caller's group is untouched.
    timeout = 4.0
    results = launch("stranded", 4, env={"UEP_TIMEOUT_S": str(timeout)}, bad_rank=bad_rank, mode=mode)
    for rank, r in enumerate(results):
        kind, msg = r["error"]
        if mode == "other_op":
            # Every rank sees the two calls in the same round, at once.
            assert kind == "InvalidArgumentError" and r["seconds"] < 2.0, r
            assert f"rank {bad_rank}" in msg and "different calls" in msg, r
        elif rank == bad_rank:
            assert kind == "InvalidArgumentError" and r["seconds"] < 1.0, r
        else:
            assert r["seconds"] < timeout + 2.0, r
            assert f"rank {bad_rank}" in msg, r


@pytest.mark.parametrize("env", [{}, {"UEP_RANKS_PER_NODE": "2"}], ids=["1x4", "2x2"])
def test_seeded_fuzz_of_corrupted_arguments(env):
    # Each case: one random rank corrupts one argument of one call. Every rank raises
    # within the deadline + 2 s (or none, where the corruption changes nothing), with no
    # cross-talk on the caller's group, and a fresh Buffer then works (checked inside).
    timeout, seed = 3.0, 20261204
    results = launch("corrupted_calls", 4, env={"UEP_TIMEOUT_S": str(timeout), **env},
                     seed=seed, cases=16, deadline=timeout)
    for i in range(len(results[0]["log"])):
        case = [r["log"][i] for r in results]
        raised = [c["error"] is not None for c in case]
        assert all(raised) or not any(raised), case
        # The special cases (out-of-range ids, a foreign, earlier or stale handle, too
        # many tokens) are wrong on any Buffer: each must be refused.
        if case[0]["case"][2] in ("range", "foreign", "earlier", "stale", "too_many"):
            assert all(raised), case
        for c in case:
            assert c["seconds"] < timeout + 2.0, case
