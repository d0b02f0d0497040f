"""``Config``: DeepEP's tuning parameters of normal mode, with DeepEP's checks.

uep's normal mode is not chunked into channels, so it does not need these numbers; they
are kept (and checked the way DeepEP checks them) so that code that builds, tunes or
passes configs runs unchanged.
"""

from __future__ import annotations


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class Config:
    """Chunking of DeepEP's normal-mode kernels: SMs, and tokens per chunk sent and
    buffered per NVLink and RDMA channel."""

    def __init__(self, num_sms: int = 20,
                 num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        assert num_sms >= 0, f"num_sms = {num_sms} must be >= 0"
        assert num_max_nvl_chunked_send_tokens > 0 and num_max_nvl_chunked_recv_tokens > 0, \
            "NVLink chunk sizes must be positive"
        assert num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens, \
            "num_max_nvl_chunked_send_tokens must be below num_max_nvl_chunked_recv_tokens"
        assert num_max_rdma_chunked_send_tokens > 0 and num_max_rdma_chunked_recv_tokens > 0, \
            "RDMA chunk sizes must be positive"
        # As DeepEP: the receive buffer holds whole send chunks.
        num_max_rdma_chunked_recv_tokens = _align(num_max_rdma_chunked_recv_tokens,
                                                  num_max_rdma_chunked_send_tokens)
        assert num_max_rdma_chunked_send_tokens < num_max_rdma_chunked_recv_tokens, \
            "num_max_rdma_chunked_send_tokens must be below num_max_rdma_chunked_recv_tokens"
        assert num_max_rdma_chunked_send_tokens <= num_max_rdma_chunked_recv_tokens // 2, \
            "num_max_rdma_chunked_send_tokens must be at most half of num_max_rdma_chunked_recv_tokens"
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, "
                f"num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
                f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
                f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
                f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})")

    def _channel_bytes(self, hidden_bytes: int, recv_tokens: int) -> int:
        # Per buffered token: the row, its source metadata, up to 128 top-k ids and
        # weights, and up to 128 scales.
        return recv_tokens * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """NVLink buffer bytes DeepEP would want for this config (its channel layout).

        uep sizes its buffers from the shapes calls actually use, and takes
        ``num_nvl_bytes`` as a capacity: a hint from here may be too small for a large
        dispatch, which then raises an error saying how much to pass."""
        assert num_ranks < 8 or num_ranks % 8 == 0, \
            f"num_ranks = {num_ranks} must be below 8 or a multiple of 8"
        channels = self.num_sms // 2
        nvl_ranks = min(num_ranks, 8)
        rdma_ranks = max(num_ranks // 8, 1)
        total = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4
        total += channels * nvl_ranks * self._channel_bytes(hidden_bytes, self.num_max_nvl_chunked_recv_tokens)
        return _align(total, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """RDMA buffer bytes DeepEP would want for this config: 0 within 8 ranks."""
        if num_ranks <= 8:
            return 0
        assert num_ranks % 8 == 0, f"num_ranks = {num_ranks} must be a multiple of 8 above 8"
        channels = self.num_sms // 2
        rdma_ranks = num_ranks // 8
        total = channels * rdma_ranks * (2 * 8 + 4) * 4 * 2
        total += channels * rdma_ranks * self._channel_bytes(hidden_bytes, self.num_max_rdma_chunked_recv_tokens) * 2
        return _align(total, 128)
