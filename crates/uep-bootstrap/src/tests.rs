//! Rendezvous tests: every rank is a thread of this process, talking real TCP on 127.0.0.1.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use crate::group::{join_with_version, simulate_crash};
use crate::{BootstrapError, EnvSource, Group, WorldInfo};

const T: Duration = Duration::from_secs(2);

fn info(rank: usize, world_size: usize, lws: usize, port: u16, secret: Option<&str>) -> WorldInfo {
    WorldInfo {
        rank,
        world_size,
        local_rank: rank % lws,
        local_world_size: lws,
        master_addr: "127.0.0.1".into(),
        rendezvous_port: port,
        secret: secret.map(str::to_owned),
        source: EnvSource::Uep,
    }
}

fn listen() -> (TcpListener, u16) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    (l, port)
}

/// Forms a group of `n` ranks (one thread each while joining) and returns them by rank.
fn form(n: usize, lws: usize, secret: Option<&str>, timeout: Duration) -> Vec<Group> {
    let (l, port) = listen();
    let secret = secret.map(str::to_owned);
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let i = info(r, n, lws, port, secret.as_deref());
            let l = (r == 0).then(|| l.try_clone().unwrap());
            thread::spawn(move || match l {
                Some(l) => Group::connect_with_listener(&i, l, timeout),
                None => Group::connect(&i, timeout),
            })
        })
        .collect();
    drop(l);
    handles
        .into_iter()
        .map(|h| h.join().unwrap().expect("join"))
        .collect()
}

/// Runs `f(group)` for every rank on its own thread, returning results by rank.
fn each<R: Send>(groups: &[Group], f: impl Fn(&Group) -> R + Sync) -> Vec<R> {
    let f = &f;
    thread::scope(|s| {
        let hs: Vec<_> = groups.iter().map(|g| s.spawn(move || f(g))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn payload(rank: usize) -> Vec<u8> {
    let len = match rank {
        0 => 0,
        1 | 3 => 1 << 20,
        _ => 7,
    };
    (0..len).map(|i| (i * 31 + rank * 7) as u8).collect()
}

#[test]
fn group_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Group>();
}

#[test]
fn four_ranks_all_gather_and_barrier() {
    let groups = form(4, 2, Some("s"), T);
    let id = groups[0].job_id().to_owned();
    assert_eq!(id.len(), 16);
    assert!(id.chars().all(|c| c.is_ascii_hexdigit()));
    for (r, g) in groups.iter().enumerate() {
        assert_eq!(g.job_id(), id);
        assert_eq!((g.rank(), g.world_size(), g.local_rank()), (r, 4, r % 2));
        assert_eq!(
            (g.local_world_size(), g.node(), g.num_nodes()),
            (2, r / 2, 2)
        );
    }
    let expected: Vec<Vec<u8>> = (0..4).map(payload).collect();
    for _round in 0..3 {
        let got = each(&groups, |g| g.all_gather(&payload(g.rank())).unwrap());
        for parts in &got {
            assert_eq!(parts, &expected);
        }
        each(&groups, |g| g.barrier().unwrap());
        let empty = each(&groups, |g| g.all_gather(&[]).unwrap());
        assert!(empty
            .iter()
            .all(|p| p.len() == 4 && p.iter().all(Vec::is_empty)));
    }
    // Another job gets another id.
    let other = form(2, 1, None, T);
    assert_ne!(other[0].job_id(), id);
}

#[test]
fn world_of_one() {
    let (l, port) = listen();
    let g = Group::connect_with_listener(&info(0, 1, 1, port, None), l, T).unwrap();
    assert_eq!(g.all_gather(b"x").unwrap(), vec![b"x".to_vec()]);
    g.barrier().unwrap();
    g.abort("done");
    assert!(g.barrier().is_err());
}

#[test]
fn listener_closes_once_everyone_joined() {
    let (l, port) = listen();
    let i0 = info(0, 2, 1, port, None);
    let root = thread::spawn(move || Group::connect_with_listener(&i0, l, T));
    let g1 = Group::connect(&info(1, 2, 1, port, None), T).unwrap();
    let g0 = root.join().unwrap().unwrap();
    let e = TcpStream::connect(("127.0.0.1", port)).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
    drop((g0, g1));
}

/// Starts rank 0 of a `n`-rank job on a thread.
fn root(
    n: usize,
    secret: Option<&str>,
    timeout: Duration,
) -> (u16, thread::JoinHandle<Result<Group, BootstrapError>>) {
    let (l, port) = listen();
    let i = info(0, n, 1, port, secret);
    (
        port,
        thread::spawn(move || Group::connect_with_listener(&i, l, timeout)),
    )
}

fn rejection(r: Result<Group, BootstrapError>) -> String {
    match r {
        Err(BootstrapError::Rejected { reason, rank, .. }) => {
            assert!(rank > 0);
            reason
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[test]
fn secrets_must_match() {
    let (port, h) = root(2, Some("right"), T);
    let wrong = rejection(Group::connect(&info(1, 2, 1, port, Some("wrong")), T));
    assert!(wrong.contains("wrong UEP_SECRET"), "{wrong}");
    let none = rejection(Group::connect(&info(1, 2, 1, port, None), T));
    assert!(none.contains("requires UEP_SECRET"), "{none}");
    // The real rank still gets in afterwards.
    let g1 = Group::connect(&info(1, 2, 1, port, Some("right")), T).unwrap();
    let g0 = h.join().unwrap().unwrap();
    assert_eq!(g0.job_id(), g1.job_id());

    let (port, h) = root(2, None, T);
    let extra = rejection(Group::connect(&info(1, 2, 1, port, Some("x")), T));
    assert!(extra.contains("rank 0 has none"), "{extra}");
    let _g1 = Group::connect(&info(1, 2, 1, port, None), T).unwrap();
    h.join().unwrap().unwrap();
}

#[test]
fn mismatched_world_size_and_version_are_rejected() {
    let (port, h) = root(2, Some("k"), T);
    let ws = rejection(Group::connect(&info(2, 3, 1, port, Some("k")), T));
    assert!(
        ws.contains("world size mismatch") && ws.contains("world size 2"),
        "{ws}"
    );
    let lws = rejection(Group::connect(&info(1, 2, 2, port, Some("k")), T));
    assert!(lws.contains("local world size 1"), "{lws}");
    let v = rejection(join_with_version(&info(1, 2, 1, port, Some("k")), T, 2));
    assert!(
        v.contains("version mismatch") && v.contains("version 2"),
        "{v}"
    );
    let e = Group::connect(&info(1, 2, 1, port, Some("k")), T)
        .unwrap()
        .rank();
    assert_eq!(e, 1);
    h.join().unwrap().unwrap();
}

#[test]
fn duplicate_rank_is_rejected() {
    let (port, h) = root(3, Some("k"), T);
    let (tx, rx) = mpsc::channel();
    for _ in 0..2 {
        let tx = tx.clone();
        thread::spawn(move || {
            let _ = tx.send(Group::connect(&info(1, 3, 1, port, Some("k")), T));
        });
    }
    // The admitted rank 1 waits for rank 2, so the first answer is the duplicate's rejection.
    let first = rx.recv_timeout(T).unwrap();
    let reason = rejection(first);
    assert!(reason.contains("rank 1 already joined"), "{reason}");
    let g2 = Group::connect(&info(2, 3, 1, port, Some("k")), T).unwrap();
    let g1 = rx.recv_timeout(T).unwrap().unwrap();
    let g0 = h.join().unwrap().unwrap();
    let groups = vec![g0, g1, g2];
    let got = each(&groups, |g| g.all_gather(&[g.rank() as u8]).unwrap());
    assert_eq!(got[2], vec![vec![0], vec![1], vec![2]]);
}

#[test]
fn strangers_do_not_disturb_the_join() {
    let (port, h) = root(2, Some("k"), T);
    // Garbage gets a rejection; a silent connection is simply outlived.
    let _silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(&[5, 0, 0, 0, 2, b'H', b'T', b'T', b'P'])
        .unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    assert!(
        String::from_utf8_lossy(&reply).contains("malformed hello"),
        "{reply:?}"
    );
    let g1 = Group::connect(&info(1, 2, 1, port, Some("k")), T).unwrap();
    let g0 = h.join().unwrap().unwrap();
    each(&[g0, g1], |g| g.barrier().unwrap());
}

#[test]
fn join_timeout_names_missing_ranks_and_tells_joined_ones() {
    let (port, h) = root(3, Some("k"), Duration::from_millis(600));
    let _ = Group::connect(&info(1, 3, 1, port, Some("bad")), T);
    let e1 = Group::connect(&info(1, 3, 1, port, Some("k")), Duration::from_secs(5)).unwrap_err();
    let e0 = h.join().unwrap().unwrap_err();
    match &e0 {
        BootstrapError::JoinTimeout {
            missing,
            joined: 2,
            world_size: 3,
            ..
        } => {
            assert_eq!(missing, &vec![2]);
        }
        other => panic!("{other:?}"),
    }
    assert!(
        e0.to_string().contains("wrong UEP_SECRET"),
        "rejections listed: {e0}"
    );
    match e1 {
        BootstrapError::RankFailed { rank: 0, reason } => {
            assert!(reason.contains("missing ranks [2]"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn joiner_without_rank_0_times_out() {
    let (l, port) = listen();
    drop(l);
    let t0 = Instant::now();
    let e = Group::connect(&info(1, 2, 1, port, None), Duration::from_millis(300)).unwrap_err();
    assert!(
        matches!(e, BootstrapError::ConnectTimeout { attempts, .. } if attempts > 1),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
}

#[test]
fn rank_0_may_start_late() {
    let (l, port) = listen();
    drop(l);
    let h = thread::spawn(move || Group::connect(&info(1, 2, 1, port, None), T));
    thread::sleep(Duration::from_millis(200));
    let l = TcpListener::bind(("127.0.0.1", port)).unwrap();
    let g0 = Group::connect_with_listener(&info(0, 2, 1, port, None), l, T).unwrap();
    let g1 = h.join().unwrap().unwrap();
    assert_eq!(g0.job_id(), g1.job_id());
}

type Gathered = Result<Vec<Vec<u8>>, BootstrapError>;

fn assert_names(r: &Gathered, rank: usize, needle: &str) {
    match r {
        Err(BootstrapError::RankFailed { rank: got, reason }) => {
            assert_eq!(*got, rank, "{reason}");
            assert!(reason.contains(needle), "{reason:?} lacks {needle:?}");
        }
        other => panic!("expected rank {rank} to be named, got {other:?}"),
    }
}

/// Ranks other than `victim` all_gather while `victim` does `act`; returns their results and the
/// time the slowest took.
fn others_while(
    groups: Vec<Group>,
    victim: usize,
    act: impl FnOnce(Group) + Send,
) -> (Vec<Gathered>, Duration) {
    let mut groups: Vec<Option<Group>> = groups.into_iter().map(Some).collect();
    let v = groups[victim].take().unwrap();
    let t0 = Instant::now();
    let res = thread::scope(|s| {
        s.spawn(move || {
            thread::sleep(Duration::from_millis(100));
            act(v);
        });
        let hs: Vec<_> = groups
            .iter()
            .flatten()
            .map(|g| s.spawn(move || g.all_gather(b"x")))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    (res, t0.elapsed())
}

#[test]
fn dropping_a_group_mid_collective_fails_the_others_promptly() {
    for victim in [3, 0] {
        let (res, took) = others_while(form(4, 1, Some("k"), T), victim, drop);
        assert!(took < Duration::from_millis(1500), "took {took:?}");
        for r in &res {
            assert_names(r, victim, "left the group");
        }
    }
}

#[test]
fn a_crashed_rank_fails_the_others_promptly() {
    for victim in [2, 0] {
        let (res, took) = others_while(form(3, 1, None, T), victim, simulate_crash);
        assert!(took < Duration::from_millis(1500), "took {took:?}");
        for r in &res {
            assert_names(r, victim, "probably crashed");
        }
    }
}

#[test]
fn abort_propagates_with_reason() {
    for victim in [1, 0] {
        let (res, took) = others_while(form(3, 1, Some("k"), T), victim, |g| {
            g.abort("out of device memory");
            // The aborting rank's own collectives fail too.
            assert!(matches!(
                g.barrier(),
                Err(BootstrapError::RankFailed { .. })
            ));
        });
        assert!(took < Duration::from_millis(1500), "took {took:?}");
        for r in &res {
            assert_names(r, victim, "out of device memory");
        }
    }
}

#[test]
fn abort_from_another_thread_wakes_own_collective() {
    let groups = form(3, 1, None, T);
    let t0 = Instant::now();
    let res = thread::scope(|s| {
        let g1 = &groups[1];
        let h = s.spawn(move || g1.all_gather(b"a"));
        let h0 = s.spawn(|| groups[0].all_gather(b"b"));
        thread::sleep(Duration::from_millis(100));
        g1.abort("watchdog fired");
        (h.join().unwrap(), h0.join().unwrap())
    });
    assert!(t0.elapsed() < Duration::from_millis(1500));
    assert_names(&res.0, 1, "watchdog fired");
    assert_names(&res.1, 1, "watchdog fired");
    // Rank 2 never entered; its next collective reports the abort instead of hanging.
    assert_names(&groups[2].all_gather(b"c"), 1, "watchdog fired");
}

#[test]
fn a_rank_that_never_arrives_times_out_everyone() {
    let groups = form(3, 1, None, Duration::from_millis(500));
    groups
        .iter()
        .for_each(|g| g.set_timeout(Duration::from_millis(500)));
    let t0 = Instant::now();
    let res = thread::scope(|s| {
        let hs: Vec<_> = groups[..2]
            .iter()
            .map(|g| s.spawn(move || g.barrier()))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert!(
        t0.elapsed() < Duration::from_millis(1500),
        "{:?}",
        t0.elapsed()
    );
    match &res[0] {
        Err(BootstrapError::Timeout { what, .. }) => assert!(what.contains("rank 2 "), "{what}"),
        other => panic!("{other:?}"),
    }
    // The other waiting rank hears rank 0's verdict, which names the absent rank.
    match &res[1] {
        Err(BootstrapError::RankFailed { rank: 2, reason }) => {
            assert!(reason.contains("did not enter barrier"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    // The latecomer learns of the failure instead of waiting.
    let t1 = Instant::now();
    assert!(groups[2].barrier().is_err());
    assert!(t1.elapsed() < Duration::from_millis(400));
}

#[test]
fn mismatched_collectives_are_reported() {
    let groups = form(2, 1, None, T);
    let res = thread::scope(|s| {
        let a = s.spawn(|| groups[0].barrier().map(|_| Vec::new()));
        let b = s.spawn(|| groups[1].all_gather(b"x"));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_names(&res.0, 1, "collective mismatch");
    assert_names(&res.1, 1, "collective mismatch");
}

#[test]
fn leaving_right_after_the_last_collective_spoils_nothing() {
    // Repeated because the hazard is a race (a rank leaving while rank 0 still relays).
    for _ in 0..40 {
        let groups = form(4, 2, None, T);
        let res = thread::scope(|s| {
            let hs: Vec<_> = groups
                .into_iter()
                .map(|g| {
                    s.spawn(move || {
                        let mut out = Vec::new();
                        for i in 0..10u8 {
                            out.push(g.all_gather(&[i, g.rank() as u8]));
                        }
                        out
                        // `g` drops here, possibly while rank 0 still relays to slower ranks.
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        for per_rank in res {
            for (i, r) in per_rank.into_iter().enumerate() {
                let parts = r.expect("completed collectives must not fail");
                assert_eq!(parts.len(), 4);
                assert!(parts
                    .iter()
                    .enumerate()
                    .all(|(rank, p)| p == &[i as u8, rank as u8]));
            }
        }
    }
}
