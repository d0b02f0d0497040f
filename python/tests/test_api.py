"""The package's surface, as DeepEP code sees it after ``import uep as deep_ep``."""

import inspect

import pytest
import torch

import uep as deep_ep


def test_exports_match_deepep():
    for name in ("Buffer", "Config", "EventOverlap", "EventHandle", "topk_idx_t"):
        assert hasattr(deep_ep, name), name
    assert deep_ep.topk_idx_t is torch.int64
    assert issubclass(deep_ep.UepError, RuntimeError)


def test_errors_are_typed_by_kind():
    kinds = ["InvalidArgumentError", "CapacityError", "UepTimeoutError", "PeerLostError", "PeerAbortedError",
             "ProtocolError", "ResourceError", "ControlPlaneError", "InternalError"]
    for name in kinds:
        cls = getattr(deep_ep, name)
        assert issubclass(cls, deep_ep.UepError) and cls.__module__ == "uep", name
    assert issubclass(deep_ep.InvalidArgumentError, ValueError)
    assert issubclass(deep_ep.UepTimeoutError, TimeoutError)
    assert not issubclass(deep_ep.PeerLostError, ValueError)
    # An error the binding raises for bad input is of its kind, message unchanged.
    from uep import _uep
    with pytest.raises(deep_ep.InvalidArgumentError, match=r"^invalid argument: rank 5 of a group of 2$"):
        _uep.Runtime(5, 2, lambda record: [record], 0, 10.0, 1)
    with pytest.raises(ValueError, match=r"^invalid argument: timeout -1(\.0)? s must be positive$"):
        _uep.Runtime(0, 1, lambda record: [record], 0, -1.0, 1)
    assert isinstance(deep_ep.__version__, str)


def test_buffer_takes_every_v1_keyword_with_deepeps_defaults():
    params = inspect.signature(deep_ep.Buffer.__init__).parameters
    expect = {"group": inspect.Parameter.empty, "num_nvl_bytes": 0, "num_rdma_bytes": 0,
              "low_latency_mode": False, "num_qps_per_rank": 24,
              "allow_nvlink_for_low_latency_mode": True, "allow_mnnvl": False, "use_fabric": False,
              "explicitly_destroy": False, "enable_shrink": False, "comm": None}
    positional = [k for k, p in params.items() if p.kind != inspect.Parameter.KEYWORD_ONLY]
    assert positional[1:] == list(expect)
    for k, v in expect.items():
        assert params[k].default == v, k
    # uep's additions (Mooncake's max_group_size) are keyword-only.
    assert [k for k, p in params.items() if p.kind == inspect.Parameter.KEYWORD_ONLY] == ["max_group_size"]
    dispatch = inspect.signature(deep_ep.Buffer.dispatch).parameters
    assert list(dispatch)[1:] == ["x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank",
                                  "is_token_in_rank", "num_tokens_per_expert", "topk_idx", "topk_weights",
                                  "expert_alignment", "num_worst_tokens", "config", "previous_event",
                                  "async_finish", "allocate_on_comm_stream"]
    # DeepEP's parameters in DeepEP's order; uep's additions (Mooncake's active_ranks)
    # are keyword-only, so no positional v1 call can reach them.
    def v1_and_extras(f):
        ps = list(inspect.signature(f).parameters.values())[1:]
        v1 = [p.name for p in ps if p.kind != inspect.Parameter.KEYWORD_ONLY]
        extra = [p.name for p in ps if p.kind == inspect.Parameter.KEYWORD_ONLY]
        return v1, extra
    ll, ll_extra = v1_and_extras(deep_ep.Buffer.low_latency_dispatch)
    assert ll == ["x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts",
                  "cumulative_local_expert_recv_stats", "dispatch_wait_recv_cost_stats",
                  "use_fp8", "round_scale", "use_ue8m0", "async_finish", "return_recv_hook"]
    llc, llc_extra = v1_and_extras(deep_ep.Buffer.low_latency_combine)
    assert llc == ["x", "topk_idx", "topk_weights", "handle", "use_logfmt", "zero_copy",
                   "async_finish", "return_recv_hook", "out", "combine_wait_recv_cost_stats"]
    # Mooncake's mask, then the keywords of DeepEP's other branches that SGLang passes:
    # hybrid-ep's NVFP4 dispatch and the single-batch-overlap combine (Hopper, Blackwell).
    assert ll_extra == ["active_ranks", "topk_weights", "x_global_scale", "use_nvfp4", "use_ue8m0_for_sf"]
    assert llc_extra == ["active_ranks", "overlap", "packed_recv_count", "comp_signal", "block_m",
                         "threshold", "num_sms", "src_signals", "src_signal_expect_value"]
    with pytest.raises(ValueError):
        deep_ep.Buffer(None)


def test_config_checks_as_deepep():
    c = deep_ep.Config(24, 6, 256, 6, 128)
    assert c.num_sms == 24 and c.num_max_rdma_chunked_recv_tokens == 132  # aligned to the send chunk
    deep_ep.Config(num_sms=20, num_max_nvl_chunked_send_tokens=8, num_max_nvl_chunked_recv_tokens=256,
                   num_max_rdma_chunked_send_tokens=16, num_max_rdma_chunked_recv_tokens=128)
    for bad in [dict(num_sms=-1), dict(num_max_nvl_chunked_send_tokens=256),
                dict(num_max_nvl_chunked_send_tokens=0),
                dict(num_max_rdma_chunked_send_tokens=8, num_max_rdma_chunked_recv_tokens=8)]:
        with pytest.raises(AssertionError):
            deep_ep.Config(**bad)
    assert c.get_nvl_buffer_size_hint(7168 * 2, 8) % 128 == 0 and c.get_nvl_buffer_size_hint(7168 * 2, 8) > 0
    assert c.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    assert c.get_rdma_buffer_size_hint(7168 * 2, 16) > 0
    with pytest.raises(AssertionError):
        c.get_nvl_buffer_size_hint(1024, 12)


def test_static_helpers():
    B = deep_ep.Buffer
    assert B.is_sm90_compiled() is True
    for r in (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160):
        assert isinstance(B.get_dispatch_config(r), deep_ep.Config)
        assert isinstance(B.get_combine_config(r), deep_ep.Config)
    with pytest.raises(AssertionError):
        B.get_dispatch_config(3)
    old = B.num_sms
    B.set_num_sms(24)
    assert B.get_dispatch_config(8).num_sms == 24
    B.set_num_sms(old)
    with pytest.raises(AssertionError):
        B.set_num_sms(3)
    # DeepEP's LL size hint: about 2.147 GB at (128, 7168, 8 ranks, 288 experts).
    hint = B.get_low_latency_rdma_size_hint(128, 7168, 8, 288)
    assert 2.14e9 < hint < 2.15e9 and hint % 128 == 0
    assert 160e6 < B.get_low_latency_rdma_size_hint(16, 5120, 8, 256) < 180e6


def test_events_are_completed_and_waitable():
    e = deep_ep.Buffer.capture()
    assert isinstance(e, deep_ep.EventOverlap) and e.event is not None
    e.current_stream_wait()
    with e:
        pass
    none = deep_ep.EventOverlap()
    with none:
        pass
    with pytest.raises(AssertionError):
        none.current_stream_wait()
    kept = deep_ep.EventOverlap(deep_ep.EventHandle(), (torch.zeros(1),))
    assert kept.extra_tensors[0].numel() == 1


def test_v2_surface_in_deepeps_order_with_deepeps_defaults():
    for name in ("ElasticBuffer", "EPHandle", "get_physical_domain_size", "get_logical_domain_size"):
        assert hasattr(deep_ep, name), name
    params = inspect.signature(deep_ep.ElasticBuffer.__init__).parameters
    expect = {"group": inspect.Parameter.empty, "num_bytes": None, "num_cpu_bytes": 0,
              "num_max_tokens_per_rank": 0, "hidden": 0, "num_topk": 0, "use_fp8_dispatch": False,
              "deterministic": False, "allow_hybrid_mode": True, "allow_multiple_reduction": True,
              "prefer_overlap_with_compute": True, "sl_idx": 3, "num_allocated_qps": 0,
              "num_cpu_timeout_secs": 300, "num_gpu_timeout_secs": 100, "explicitly_destroy": False}
    assert list(params)[1:] == list(expect)
    for k, v in expect.items():
        assert params[k].default == v, k
    dispatch = inspect.signature(deep_ep.ElasticBuffer.dispatch).parameters
    assert list(dispatch)[1:] == ["x", "topk_idx", "topk_weights", "cumulative_local_expert_recv_stats",
                                  "num_experts", "num_max_tokens_per_rank", "expert_alignment", "num_sms",
                                  "num_qps", "previous_event", "previous_event_before_epilogue",
                                  "async_with_compute_stream", "allocate_on_comm_stream", "handle",
                                  "do_handle_copy", "do_cpu_sync", "do_expand", "do_zero_padding",
                                  "use_tma_aligned_col_major_sf"]
    combine = inspect.signature(deep_ep.ElasticBuffer.combine).parameters
    assert list(combine)[1:] == ["x", "handle", "topk_weights", "bias", "num_sms", "num_qps", "previous_event",
                                 "previous_event_before_epilogue", "async_with_compute_stream",
                                 "allocate_on_comm_stream"]
    handle = inspect.signature(deep_ep.EPHandle.__init__).parameters
    assert list(handle)[1:] == ["do_expand", "num_experts", "expert_alignment", "num_max_tokens_per_rank",
                                "num_sms", "topk_idx", "num_recv_tokens", "num_expanded_tokens",
                                "num_recv_tokens_per_expert_list", "psum_num_recv_tokens_per_scaleup_rank",
                                "psum_num_recv_tokens_per_expert", "num_unaligned_recv_tokens_per_expert",
                                "recv_src_metadata", "dst_buffer_slot_idx", "token_metadata_at_forward",
                                "channel_linked_list"]


def test_v2_size_hint_is_2mib_aligned_and_checked():
    class Group:
        def size(self):
            return 8
    hint = deep_ep.ElasticBuffer.get_buffer_size_hint(Group(), 4096, 7168, 8)
    assert hint % (2 << 20) == 0 and hint >= 8 * 4096 * 7168 * 2
    assert deep_ep.ElasticBuffer.get_buffer_size_hint(Group(), 128, 7168) >= \
        deep_ep.ElasticBuffer.get_buffer_size_hint(Group(), 128, 7168, 8)
    with pytest.raises(deep_ep.InvalidArgumentError, match="num_max_tokens_per_rank > 0"):
        deep_ep.ElasticBuffer.get_buffer_size_hint(Group(), 0, 7168)


def test_v2_events_run_hooks_once_after_the_wait():
    from uep.utils import EventHandle, EventOverlap
    seen = []
    ev = EventOverlap(EventHandle())
    ev.register_hook_after_wait(lambda: seen.append(1))
    with ev(release_handle=True):
        pass
    ev.current_stream_wait()
    assert seen == [1]
