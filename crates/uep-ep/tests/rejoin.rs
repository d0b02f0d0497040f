//! What `Buffer::join` and `Buffer::admit` refuse, with the message a caller needs. A
//! rank killed and replaced by a new process is checked end to end by the CLI's tests
//! (`uep bench --elastic --kill R@S --rejoin R@S2`, and `--chaos` on one node): it needs
//! processes, since a replacement takes the place of a process that is gone.

use std::time::Duration;

use uep_ep::{Buffer, BufferConfig, ErrorKind};
use uep_harness::ranks::run_ranks;

fn config(door: &str) -> BufferConfig {
    let mut cfg = BufferConfig::new(16, 256, 2, 32, 8);
    cfg.elastic = true;
    cfg.door = Some(door.into());
    cfg.ranks_per_node = Some(2);
    cfg.timeout = Duration::from_millis(300);
    cfg
}

fn door(tag: &str) -> String {
    format!("uep-test-door-{tag}-p{}", std::process::id())
}

#[test]
fn join_needs_an_elastic_config_with_a_door() {
    let mut cfg = config(&door("none"));
    cfg.door = None;
    let e = Buffer::join(cfg, 1, 2).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.to_string().contains("door"), "{e}");
    let mut cfg = config(&door("plain"));
    cfg.elastic = false;
    let e = Buffer::join(cfg, 1, 2).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let e = Buffer::join(config(&door("range")), 2, 2).unwrap_err();
    assert!(
        e.to_string()
            .contains("rank 2 cannot join a job of 2 ranks"),
        "{e}"
    );
}

#[test]
fn join_without_a_job_says_so() {
    let e = Buffer::join(config(&door("nojob")), 1, 2).unwrap_err();
    assert!(e.to_string().contains("uep-test-door-nojob"), "{e}");
}

/// While a job of two ranks runs: a joiner with another shape is refused at the door,
/// one with the same shape for a rank that is alive is not let in (a clear timeout),
/// and admitting needs another rank of the job.
#[test]
fn the_door_checks_who_comes() {
    let name = door("job");
    let cfg = config(&name);
    // Rank 1 leaves first: a joiner in this process would take its segment's name.
    let left = std::sync::Barrier::new(2);
    let outcomes = run_ranks(2, |group| {
        let mut buffer = Buffer::new(group, cfg.clone()).expect("a Buffer");
        if buffer.rank() == 1 {
            drop(buffer);
            left.wait();
            return Vec::new();
        }
        left.wait();
        let mut other = cfg.clone();
        other.ll.as_mut().unwrap().max_tokens = 16;
        let mut errors = vec![Buffer::join(other, 1, 2).unwrap_err()];
        errors.push(Buffer::join(cfg.clone(), 1, 2).unwrap_err());
        errors.push(buffer.admit(0).unwrap_err());
        errors.push(buffer.admit(2).unwrap_err());
        errors
    })
    .expect("two ranks");
    let errors = &outcomes[0];
    assert!(
        errors[0].to_string().contains("another Buffer config"),
        "{}",
        errors[0]
    );
    assert_eq!(errors[1].kind(), ErrorKind::Timeout, "{}", errors[1]);
    assert!(errors[1].to_string().contains("let in"), "{}", errors[1]);
    for e in &errors[2..] {
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    }
    // The door goes with the job.
    assert!(!std::path::Path::new("/dev/shm").join(&name).exists());
}

#[test]
fn a_door_spans_nodes_emulated_on_one_host() {
    // Two ranks as two nodes of this host: the door is made (every rank can reach it),
    // and each rank publishes there how a joiner on the other node reaches it. (The
    // rejoin itself needs separate processes: `uep bench --nodes 2 --kill --rejoin`.)
    let mut cfg = config(&door("nodes"));
    cfg.ranks_per_node = Some(1);
    let outcomes = run_ranks(2, |group| Buffer::new(group, cfg.clone()).map(drop));
    for o in outcomes.expect("two ranks") {
        o.unwrap();
    }
}

/// Room for more ranks than the job starts with (`max_ranks`): the reserved ones are a
/// node of their own, masked from the start (with the reason), and the job works
/// without them; a process that joins as one is checked end to end by the CLI
/// (`uep bench --max-ranks --grow`). Too little room, or room without a door, is refused.
#[test]
fn room_for_more_ranks_reserves_masked_nodes() {
    let mut cfg = config(&door("room"));
    (cfg.ranks_per_node, cfg.max_ranks) = (Some(2), Some(4));
    cfg.timeout = Duration::from_secs(30);
    let outcomes = run_ranks(2, |group| {
        let mut buffer = Buffer::new(group, cfg.clone())?;
        buffer.barrier()?;
        Ok::<_, uep_ep::EpError>((
            buffer.num_ranks(),
            buffer.low_latency_mask(),
            buffer.low_latency_mask_reasons(),
        ))
    });
    for o in outcomes.expect("two ranks") {
        let (ranks, mask, why) = o.unwrap();
        assert_eq!((ranks, mask), (4, vec![false, false, true, true]));
        assert!(
            why[3].as_deref().unwrap_or("").contains("reserved"),
            "{why:?}"
        );
    }
    for (max, door, needle) in [
        (Some(1), true, "less than"),
        (Some(4), false, "needs a door"),
    ] {
        let mut bad = config(&self::door("bad"));
        bad.max_ranks = max;
        if !door {
            bad.door = None;
        }
        let outcomes = run_ranks(2, |group| Buffer::new(group, bad.clone()).map(drop));
        for o in outcomes.expect("two ranks") {
            let e = o.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
            assert!(e.to_string().contains(needle), "{e}");
        }
    }
}
