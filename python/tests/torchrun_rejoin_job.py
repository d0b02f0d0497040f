"""A serving loop under torchrun that loses a worker and takes a replacement back.

Every worker serves low-latency steps (dispatch, identity experts, combine) on an
elastic Buffer, checking each step exactly against a torch reference without the ranks
masked in it. Rank 3 SIGKILLs itself at step 5 (after writing ``dying`` in ``JOB_OUT``);
the survivors see it masked, call ``recover_ranks([3])`` and go on serving. The test
then starts this script again with ``UEP_REJOIN=1`` and rank 3's variables: it calls
``uep.Buffer.join_group()``, is let in at a step boundary, and serves from there. Every
rank stops once rank 3 has been back for 5 steps (and after step 30): the same step
everywhere, since they read the same masks. Each writes ``result<rank>.json``.

With ``JOB_GROW=1`` nobody dies: the Buffer has room for 6 ranks
(``max_group_size``), of which ranks 4 and 5 are reserved; the test starts two
processes as them (``WORLD_SIZE=6``), which call ``join_group()`` and are let in
(the workers call ``recover_ranks([4, 5])`` at once), growing the job by a node.

With ``JOB_UPDATE=1`` the survivors follow Mooncake's flow instead: on seeing rank 3
masked they call ``recover_ranks([3])`` and then ``update_ep_member()``, which returns
once the replacement is in (it makes the same call first); then all serve on.
"""

import faulthandler
import json
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

import uep

VICTIM, KILL_STEP, MIN_STEPS, AFTER_BACK = 3, 5, 30, 5
GROW = os.environ.get("JOB_GROW") == "1"
TOKENS, HIDDEN, EXPERTS, TOPK = 16, 256, 24 if GROW else 16, 4
#: The ranks that come (back): the victim's replacement, or the reserved ranks.
COMING = {4, 5} if GROW else {VICTIM}


def inputs(r: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + r)
    x = torch.randn((TOKENS, HIDDEN), generator=g).to(torch.bfloat16)
    idx = torch.topk(torch.rand((TOKENS, EXPERTS), generator=g), TOPK, dim=-1, sorted=False)[1]
    w = torch.rand((TOKENS, TOPK), generator=g)
    return x, idx, w


def check_step(buffer: uep.Buffer, rank: int, world: int, step: int) -> set:
    """One served step, checked; returns the ranks masked in its combine."""
    epr = EXPERTS // world
    x, idx, w = inputs(rank, step)
    active = torch.ones(world, dtype=torch.int32)
    recv, count, handle, _, _ = buffer.low_latency_dispatch(x, idx, TOKENS, EXPERTS, use_fp8=False,
                                                            active_ranks=active)
    masked = {r for r in range(world) if not active[r]}
    want = torch.zeros(epr, dtype=torch.int32)
    for s in set(range(world)) - masked:
        sidx = inputs(s, step)[1]
        for le in range(epr):
            want[le] += int((sidx == rank * epr + le).sum())
    assert torch.equal(count, want), (step, count, want, masked)
    out, _, _ = buffer.low_latency_combine(recv, idx, w, handle, active_ranks=active)
    masked = {r for r in range(world) if not active[r]}
    acc = torch.zeros((TOKENS, HIDDEN))
    for k in range(TOPK):
        kept = torch.tensor([int(e) // epr not in masked for e in idx[:, k]]).unsqueeze(1)
        acc += torch.where(kept, w[:, k:k + 1] * x.float(), torch.zeros(()))
    assert torch.equal(out, acc.to(torch.bfloat16)), (step, masked)
    return masked


def serve(buffer: uep.Buffer, rank: int, world: int, first: int, out: str) -> dict:
    step, back_since, recovering, longest = first, None, False, 0.0
    replacement = buffer.joined_at is not None
    update = os.environ.get("JOB_UPDATE") == "1"
    if replacement and buffer.joined_at[1] == "barrier":
        assert buffer.update_ep_member() == [], "a replacement recovers nobody"
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        if rank == VICTIM and step == KILL_STEP and not replacement and not GROW:
            open(os.path.join(out, "dying"), "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        buffer.set_step(step)
        start = time.monotonic()
        masked = check_step(buffer, rank, world, step)
        if recovering:
            longest = max(longest, time.monotonic() - start)
        if COMING <= masked and not recovering:
            buffer.recover_ranks(sorted(COMING))
            recovering = True
            if update:
                buffer.set_step(step + 1)
                assert buffer.update_ep_member() == [VICTIM], "rank 3 did not come back"
                back_since = step + 1
        elif not COMING & masked and (recovering or replacement) and back_since is None:
            back_since = step
        step += 1
        if step >= MIN_STEPS and back_since is not None and step - back_since >= AFTER_BACK:
            break
        if back_since is None:
            time.sleep(0.005)  # a serving cadence while the replacement starts
    return {"rank": rank, "last_step": step, "back_since": back_since, "joined_at": buffer.joined_at,
            "longest_step_ms_while_joining": 1e3 * longest, "masked_at_end": sorted(masked)}


def door_in_agent_store() -> bool:
    """Whether the job's door is in the store torchrun's agent keeps (looked up there
    through a store client of this test's own)."""
    import datetime
    assert os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True", "the agent keeps no store"
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=10))
    return store.check([uep._uep.door_name(f"{addr}:{port}") + "/header"])


def main() -> None:
    out = os.environ["JOB_OUT"]
    rank = int(os.environ["RANK"])
    # A job that should take seconds and hangs says where (in the test's failure).
    faulthandler.dump_traceback_later(90, exit=False)
    torch.set_num_threads(1)
    try:
        if os.environ.get("UEP_REJOIN") == "1":
            started = float(os.environ["UEP_REJOIN_STARTED"])
            buffer = uep.Buffer.join_group()
            let_in = time.time() - started
            result = serve(buffer, rank, buffer.group_size, buffer.joined_at[0], out)
            result["started_to_let_in_s"] = let_in
        else:
            dist.init_process_group("gloo")
            if rank == 0:
                with open(os.path.join(out, "env.json"), "w") as f:
                    json.dump({k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT")}, f)
            buffer = uep.Buffer(dist.group.WORLD, int(1e9), int(1e9), enable_shrink=True,
                                max_group_size=6 if GROW else None)
            buffer.clean_low_latency_buffer(TOKENS, HIDDEN, EXPERTS)
            door = door_in_agent_store() if rank == 0 else None
            result = serve(buffer, rank, buffer.group_size, 0, out)
            result["door_in_agent_store"] = door
    except BaseException:  # noqa: B902 - reported to the test
        result = {"rank": rank, "error": traceback.format_exc()}
    with open(os.path.join(out, f"result{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)  # the gloo group has a dead member: nothing to tear down with it


if __name__ == "__main__":
    main()
