//! `apply_env_defaults` sets only what the environment leaves unset (its own process:
//! it changes the environment).

use uep_transport::{apply_env_defaults, ENV_DEFAULTS};

#[test]
fn defaults_fill_only_unset_variables() {
    let (name, value) = ENV_DEFAULTS[0];
    std::env::set_var(name, "0");
    assert!(apply_env_defaults().iter().all(|(k, _)| *k != name));
    assert_eq!(
        std::env::var(name).unwrap(),
        "0",
        "a caller's setting stays"
    );

    std::env::remove_var(name);
    assert!(apply_env_defaults().contains(&(name, value)));
    assert_eq!(std::env::var(name).unwrap(), value);
}
