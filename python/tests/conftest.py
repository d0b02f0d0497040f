"""Launching ranks for the tests: real processes, a real gloo group, real uep Buffers.

Each test runs a function of ``workers.py`` on every rank of a fresh job started with
``torch.multiprocessing`` (forkserver), bounded in time: a rank that raises fails the test
with its traceback, and a job that does not finish in time is killed and fails it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import workers  # noqa: E402

# Ranks start as forks of a server that imported torch and uep once (a spawned rank
# imports them itself: seconds each on a small machine). Nothing in that server ever
# makes a thread, a Buffer or a group, so what a rank inherits is the imports alone.
mp.set_forkserver_preload(["workers"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(case: str, world: int, timeout: float = 240.0, env: Optional[Dict[str, str]] = None,
           expect_failure: bool = False, killed: Tuple[int, ...] = (), **kwargs: Any) -> List[Any]:
    """Run ``workers.<case>(ctx, **kwargs)`` on `world` ranks; return each rank's result
    (``expect_failure``: the UepError a rank raised, as ``{"error", "msg"}``, stands for
    its result). Ranks in ``killed`` are expected to die; the others run to the end
    whatever happens to them."""
    out = tempfile.mkdtemp(prefix="uep-pytest-")
    port = free_port()
    # MASTER_ADDR: uep binds its rendezvous and the fabric to loopback, never another
    # interface of the test machine.
    base_env = {"UEP_TIMEOUT_S": "30", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    base_env.update(env or {})
    # A forked rank has the environment of the fork server, not this process's: it sets
    # `base_env` itself, first thing.
    ctx = mp.start_processes(workers.entry, args=(world, port, case, kwargs, out, expect_failure, base_env),
                             nprocs=world, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    try:
        # Not ctx.join(): it stops every rank as soon as one dies.
        while any(p.is_alive() for p in ctx.processes):
            if time.monotonic() > deadline:
                pytest.fail(f"{case} on {world} ranks did not finish within {timeout} s")
            time.sleep(0.1)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    failures = []
    for r, p in enumerate(ctx.processes):
        if p.exitcode != 0 and r not in killed:
            trace = ""
            if os.access(ctx.error_files[r], os.R_OK):
                with open(ctx.error_files[r], "rb") as f:
                    trace = pickle.load(f)
            failures.append(f"rank {r} exited with {p.exitcode}:\n{trace}")
    if failures:
        pytest.fail("\n".join(failures))
    results = []
    for r in range(world):
        path = os.path.join(out, f"result{r}")
        if r in killed:
            results.append(None)
            continue
        with open(path, "rb") as f:
            results.append(pickle.load(f))
    return results


def pytest_sessionfinish(session, exitstatus):
    """Remove the shared-memory names of uep processes that are gone (as ``uep clean``
    does): the torchrun jobs end with ``os._exit`` (their gloo group has a dead member),
    so their Buffers never close, and a leftover name whose process id is later reused
    would look like a live rank's to another test."""
    import re
    for name in os.listdir("/dev/shm"):
        m = re.fullmatch(r"uep-[0-9a-f]+-r\d+-p(\d+)", name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", name))
        except PermissionError:
            pass  # alive, someone else's
