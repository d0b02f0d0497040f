"""A real ``torchrun`` starts the job (its own rendezvous, its own store): uep takes the
group it is given and needs no port or setting of its own."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_torchrun_launches_a_job():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", UEP_TIMEOUT_S="60")
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "4", os.path.join(HERE, "torchrun_job.py")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    for r in range(4):
        assert f"rank {r}/4 (local {r}): OK" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("update,nodes", [(False, 1), (True, 1), (False, 2)])
def test_torchrun_worker_killed_and_replaced_rejoins(tmp_path, update, nodes):
    """Under a real torchrun, worker 3 SIGKILLs itself mid-serving; the test starts a
    replacement process (rank 3's variables, ``uep.Buffer.join_group()``), which is let
    in while the survivors keep serving (``nodes=2``: two nodes of two ranks emulated on
    this host, so the replacement reaches node 0 over the network). It finds the job
    at its door in the store torchrun's agent keeps at ``MASTER_ADDR:MASTER_PORT``. No survivor raises; every step of every rank
    (the replacement's from where it joined) is exact against the torch reference for
    that step's mask; all stop at the same step with nobody masked. With ``update``,
    the survivors wait for it in ``update_ep_member()`` (Mooncake's flow), and it is
    let in at a barrier there.

    torchrun's agent stops every worker once it sees one fail; ``--monitor-interval``
    is set past the test's end so that it does not look before the job is done (an
    elastic job needs a launcher that lets the survivors run), and the test stops it."""
    import json
    import signal
    import time

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    job = os.path.join(HERE, "torchrun_rejoin_job.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", UEP_TIMEOUT_S="60", JOB_OUT=str(tmp_path),
               JOB_UPDATE=str(int(update)))
    if nodes > 1:
        env["UEP_RANKS_PER_NODE"] = str(4 // nodes)
    agent = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "4", "--monitor-interval", "3600",
                              job], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    replacement = None
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "dying").exists():
            if time.monotonic() > deadline or agent.poll() is not None:
                agent.kill()
                pytest.fail(f"rank 3 never died:\n{agent.communicate(timeout=60)[0][-20000:]}")
            time.sleep(0.05)
        rendezvous = json.loads((tmp_path / "env.json").read_text())
        joiner_env = dict(env, **rendezvous, RANK="3", LOCAL_RANK="3", WORLD_SIZE="4", LOCAL_WORLD_SIZE="4",
                          UEP_REJOIN="1", UEP_REJOIN_STARTED=repr(time.time()))
        replacement = subprocess.Popen([sys.executable, job], env=joiner_env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
        files = [tmp_path / f"result{r}.json" for r in range(4)]
        while not all(f.exists() for f in files):
            assert time.monotonic() < deadline, f"results: {[f.name for f in files if f.exists()]}"
            time.sleep(0.1)
        assert replacement.wait(timeout=60) == 0, replacement.stdout.read()
    finally:
        agent.send_signal(signal.SIGTERM)
        log = agent.communicate(timeout=60)[0]
        if replacement is not None and replacement.poll() is None:
            replacement.kill()
    results = [json.loads(f.read_text()) for f in files]
    for r in results:
        assert "error" not in r, f"{r.get('error')}\n{log}"
    assert results[0]["door_in_agent_store"], "the door is not in torchrun's store"
    ends = {(r["last_step"], r["back_since"]) for r in results}
    assert len(ends) == 1, results
    assert all(r["masked_at_end"] == [] for r in results), results
    joined = results[3]
    assert joined["joined_at"][0] == joined["back_since"], joined
    assert joined["joined_at"][1] == ("barrier" if update else "low_latency_dispatch"), joined
    print(f"replacement let in {joined['started_to_let_in_s']:.2f} s after it started (python and torch "
          f"imports included), at step {joined['back_since']}; survivors' longest step while it joined: "
          f"{max(r['longest_step_ms_while_joining'] for r in results[:3]):.1f} ms")


def test_torchrun_job_grows_into_reserved_ranks(tmp_path):
    """Under a real torchrun, 4 workers (two emulated nodes of two) make an elastic
    Buffer with room for 6 ranks (``max_group_size=6``); the test starts two more
    processes as ranks 4 and 5 of 6, which find the job at its door in torchrun's store
    (``join_group``), and the workers let them in (``recover_ranks([4, 5])``) while they
    serve. Every step of every rank is exact against the torch reference for that step's
    mask, and all six end with nobody masked."""
    import json
    import signal
    import time

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    job = os.path.join(HERE, "torchrun_rejoin_job.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", UEP_TIMEOUT_S="60", JOB_OUT=str(tmp_path),
               JOB_GROW="1", UEP_RANKS_PER_NODE="2")
    agent = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "4", job], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    newcomers = []
    files = [tmp_path / f"result{r}.json" for r in range(6)]
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "env.json").exists():
            assert time.monotonic() < deadline and agent.poll() is None, "the job never started"
            time.sleep(0.05)
        rendezvous = json.loads((tmp_path / "env.json").read_text())
        for r in (4, 5):
            joiner_env = dict(env, **rendezvous, RANK=str(r), LOCAL_RANK=str(r % 2), WORLD_SIZE="6",
                              LOCAL_WORLD_SIZE="2", UEP_REJOIN="1", UEP_REJOIN_STARTED=repr(time.time()))
            newcomers.append(subprocess.Popen([sys.executable, job], env=joiner_env, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))
        while not all(f.exists() for f in files):
            assert time.monotonic() < deadline, f"results: {[f.name for f in files if f.exists()]}"
            time.sleep(0.1)
        for p in newcomers:
            assert p.wait(timeout=60) == 0, p.stdout.read()
        assert agent.wait(timeout=60) == 0
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
        log = agent.communicate(timeout=60)[0]
        for p in newcomers:
            if p.poll() is None:
                p.kill()
    results = [json.loads(f.read_text()) for f in files]
    for r in results:
        assert "error" not in r, f"{r.get('error')}\n{log}"
    assert len({(r["last_step"], r["back_since"]) for r in results}) == 1, results
    assert all(r["masked_at_end"] == [] for r in results), results
    assert [r["joined_at"] is not None for r in results] == [False] * 4 + [True] * 2, results
    grown = results[4]
    print(f"ranks 4 and 5 let in {grown['started_to_let_in_s']:.2f} s after they started, at step "
          f"{grown['back_since']}; workers' longest step meanwhile: "
          f"{max(r['longest_step_ms_while_joining'] for r in results[:4]):.1f} ms")
