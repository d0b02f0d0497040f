//! `uep gpu` on a machine without a GPU: it says why there is no CUDA device and fails,
//! instead of crashing or pretending (skipped, with the reason printed, where a GPU is).

use std::process::Command;

fn uep(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_uep"))
        .args(args)
        .output()
        .expect("run uep");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn gpu_commands_say_why_there_is_no_device() {
    let (ok, info) = uep(&["gpu", "info"]);
    if ok {
        println!("skipped: this machine has a CUDA device: {info}");
        return;
    }
    assert!(info.contains("no CUDA device"), "{info}");
    for cmd in [
        &["gpu", "check", "--quick"][..],
        &["gpu", "fifo", "--commands", "8"],
        &["bench", "--experts", "8", "--device", "cuda"],
    ] {
        let (ok, text) = uep(cmd);
        assert!(!ok, "{cmd:?} succeeded without a GPU: {text}");
        let why = text.contains("without the `cuda` feature") || text.contains("no CUDA driver");
        assert!(why, "{cmd:?}: {text}");
    }
}
