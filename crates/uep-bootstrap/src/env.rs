//! Rank discovery from the launcher's environment (torchrun, Open MPI, Slurm, `uep`).

use std::fmt;

use crate::error::BootstrapError;

/// Environment variable naming the shared secret that authenticates ranks of one job.
pub const SECRET_VAR: &str = "UEP_SECRET";
/// Environment variable set by [`crate::launch_local`] so that ranks know `uep` started them.
pub const LAUNCHER_VAR: &str = "UEP_LAUNCHER";
/// Value of [`LAUNCHER_VAR`] set by [`crate::launch_local`].
pub const LAUNCHER_LOCAL: &str = "local";
/// Environment variable naming the port of uep's rendezvous, overriding the default
/// `MASTER_PORT + 1` (see [`WorldInfo::from_vars`]).
pub const PORT_VAR: &str = "UEP_MASTER_PORT";

pub use crate::launcher::EnvSource;

/// Where this process sits in the job: its rank, the node layout and how to reach rank 0.
///
/// Ranks of a node are contiguous: node `n` holds ranks `n * local_world_size ..
/// (n + 1) * local_world_size`, and [`WorldInfo::from_vars`] rejects layouts that are not.
#[derive(Clone, PartialEq, Eq)]
pub struct WorldInfo {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// This process's rank within its node, `0..local_world_size`.
    pub local_rank: usize,
    /// Ranks per node (the same on every node).
    pub local_world_size: usize,
    /// Host name or address where rank 0 listens (`MASTER_ADDR`).
    pub master_addr: String,
    /// Port where rank 0's rendezvous listens: `UEP_MASTER_PORT`, else `MASTER_PORT + 1`
    /// (the launcher's own store holds `MASTER_PORT`).
    pub rendezvous_port: u16,
    /// Shared secret from `UEP_SECRET` (an empty value counts as unset); ranks prove knowledge of
    /// it when joining. `None` is allowed only if every rank has none.
    pub secret: Option<String>,
    /// Which launcher's variables this came from.
    pub source: EnvSource,
}

impl fmt::Debug for WorldInfo {
    // Hand-written so that the secret never ends up in logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorldInfo")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_rank", &self.local_rank)
            .field("local_world_size", &self.local_world_size)
            .field("master_addr", &self.master_addr)
            .field("rendezvous_port", &self.rendezvous_port)
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("source", &self.source)
            .finish()
    }
}

impl WorldInfo {
    /// Reads the process environment; see [`WorldInfo::from_vars`] for the rules.
    pub fn from_env() -> Result<WorldInfo, BootstrapError> {
        // Non-UTF-8 values are reported as garbage rather than silently dropped.
        WorldInfo::from_vars(|k| {
            std::env::var_os(k).map(|v| match v.into_string() {
                Ok(s) => s,
                Err(raw) => raw.to_string_lossy().into_owned(),
            })
        })
    }

    /// Parses a rank layout from variables looked up with `get` (the testable core of
    /// [`WorldInfo::from_env`]).
    ///
    /// Precedence: torchrun/`uep` variables if `RANK` is set, else Open MPI's if
    /// `OMPI_COMM_WORLD_RANK` is set, else Slurm's if `SLURM_PROCID` is set. Open MPI and Slurm
    /// do not provide a rendezvous address, so `MASTER_ADDR` and `MASTER_PORT` must be exported
    /// by the user there. Slurm's ranks per node come from `SLURM_NTASKS_PER_NODE`, else
    /// `SLURM_STEP_TASKS_PER_NODE`, else `SLURM_TASKS_PER_NODE` (forms like `4`, `4(x2)`,
    /// `4(x2),4`; every node must have the same count). Empty values count as unset.
    ///
    /// The rendezvous listens on `MASTER_ADDR` at `UEP_MASTER_PORT` if set, else at
    /// `MASTER_PORT + 1`: torchrun's agent keeps its TCP store on `MASTER_PORT` for the whole
    /// job, and the program may start `torch.distributed` there too, so uep never takes the
    /// launcher's port itself.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<WorldInfo, BootstrapError> {
        let get = |k: &str| get(k).filter(|v| !v.is_empty());
        if get("RANK").is_some() {
            let source = if get(LAUNCHER_VAR).as_deref() == Some(LAUNCHER_LOCAL) {
                EnvSource::Uep
            } else {
                EnvSource::Torchrun
            };
            let v = Vars { get: &get, source };
            let world_size = v.count("WORLD_SIZE")?;
            let rank = v.index("RANK", world_size, "WORLD_SIZE")?;
            let local_world_size = v.count("LOCAL_WORLD_SIZE")?;
            let local_rank = v.index("LOCAL_RANK", local_world_size, "LOCAL_WORLD_SIZE")?;
            let hint = "torchrun sets it for every rank";
            v.finish(
                (rank, world_size, local_rank, local_world_size),
                ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
                hint,
            )
        } else if get("OMPI_COMM_WORLD_RANK").is_some() {
            let v = Vars {
                get: &get,
                source: EnvSource::OpenMpi,
            };
            let world_size = v.count("OMPI_COMM_WORLD_SIZE")?;
            let rank = v.index("OMPI_COMM_WORLD_RANK", world_size, "OMPI_COMM_WORLD_SIZE")?;
            let local_world_size = v.count("OMPI_COMM_WORLD_LOCAL_SIZE")?;
            let local_rank = v.index(
                "OMPI_COMM_WORLD_LOCAL_RANK",
                local_world_size,
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            )?;
            v.finish(
                (rank, world_size, local_rank, local_world_size),
                (
                    "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE",
                ),
                "Open MPI does not provide one, so export it to every rank, e.g. \
                 `mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500 ...`",
            )
        } else if get("SLURM_PROCID").is_some() {
            let v = Vars {
                get: &get,
                source: EnvSource::Slurm,
            };
            let world_size = v.count("SLURM_NTASKS")?;
            let rank = v.index("SLURM_PROCID", world_size, "SLURM_NTASKS")?;
            let (lws_var, local_world_size) = v.slurm_tasks_per_node()?;
            let local_rank = v.index("SLURM_LOCALID", local_world_size, lws_var)?;
            v.finish(
                (rank, world_size, local_rank, local_world_size),
                ("SLURM_PROCID", "SLURM_LOCALID", lws_var),
                "Slurm does not provide one, so export it before srun, e.g. \
                 `export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1) \
                 MASTER_PORT=29500`",
            )
        } else {
            Err(BootstrapError::NoRankEnv)
        }
    }

    /// This rank's node: `rank / local_world_size` (ranks of a node are contiguous).
    pub fn node(&self) -> usize {
        self.rank / self.local_world_size.max(1)
    }

    /// Number of nodes: `world_size / local_world_size`.
    pub fn num_nodes(&self) -> usize {
        self.world_size / self.local_world_size.max(1)
    }

    /// Checks the invariants [`WorldInfo::from_vars`] guarantees, for hand-built values.
    pub fn validate(&self) -> Result<(), BootstrapError> {
        check_layout(
            (
                self.rank,
                self.world_size,
                self.local_rank,
                self.local_world_size,
            ),
            ("rank", "local_rank", "local_world_size"),
        )?;
        if self.master_addr.is_empty() {
            return Err(BootstrapError::InconsistentWorld(
                "master_addr is empty; it must name rank 0's host".into(),
            ));
        }
        if self.rendezvous_port == 0 {
            return Err(BootstrapError::InconsistentWorld(
                "rendezvous_port is 0; it must be the port rank 0 listens on (1..=65535)".into(),
            ));
        }
        Ok(())
    }
}

/// Cross-variable checks shared by all launchers; `names` are (rank, local rank, local size).
fn check_layout(
    (rank, world_size, local_rank, local_world_size): (usize, usize, usize, usize),
    (rank_name, local_rank_name, lws_name): (&str, &str, &str),
) -> Result<(), BootstrapError> {
    let bad = |m: String| Err(BootstrapError::InconsistentWorld(m));
    if world_size == 0 || local_world_size == 0 {
        return bad(format!(
            "world size {world_size} and ranks per node {local_world_size} must both be at least 1"
        ));
    }
    if rank >= world_size || local_rank >= local_world_size {
        return bad(format!(
            "rank {rank} must be below world size {world_size} and local rank {local_rank} below \
             ranks per node {local_world_size}"
        ));
    }
    if world_size % local_world_size != 0 {
        return bad(format!(
            "world size {world_size} is not a multiple of {lws_name}={local_world_size}; every node \
             must run the same number of ranks"
        ));
    }
    if rank % local_world_size != local_rank {
        return bad(format!(
            "{rank_name}={rank} with {local_rank_name}={local_rank} and {lws_name}={local_world_size} \
             is not a block layout (expected {local_rank_name}={}); ranks of a node must be \
             contiguous (with Slurm use --distribution=block)",
            rank % local_world_size
        ));
    }
    Ok(())
}

/// Variable lookup with launcher-aware error messages.
struct Vars<'a, F: Fn(&str) -> Option<String>> {
    get: &'a F,
    source: EnvSource,
}

impl<F: Fn(&str) -> Option<String>> Vars<'_, F> {
    fn required(&self, var: &'static str, expected: &str) -> Result<String, BootstrapError> {
        (self.get)(var).ok_or_else(|| BootstrapError::MissingVar {
            var,
            launcher: self.source,
            expected: expected.to_owned(),
        })
    }

    /// A positive count such as a world size.
    fn count(&self, var: &'static str) -> Result<usize, BootstrapError> {
        let expected = "a positive integer number of ranks";
        let value = self.required(var, expected)?;
        match value.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(BootstrapError::InvalidVar {
                var,
                value,
                expected: expected.into(),
            }),
        }
    }

    /// An index below `bound` (the value of `bound_var`).
    fn index(
        &self,
        var: &'static str,
        bound: usize,
        bound_var: &str,
    ) -> Result<usize, BootstrapError> {
        let expected = format!("an integer in 0..{bound} ({bound_var}={bound})");
        let value = self.required(var, &expected)?;
        match value.trim().parse::<usize>() {
            Ok(i) if i < bound => Ok(i),
            _ => Err(BootstrapError::InvalidVar {
                var,
                value,
                expected,
            }),
        }
    }

    fn slurm_tasks_per_node(&self) -> Result<(&'static str, usize), BootstrapError> {
        const VARS: [&str; 3] = [
            "SLURM_NTASKS_PER_NODE",
            "SLURM_STEP_TASKS_PER_NODE",
            "SLURM_TASKS_PER_NODE",
        ];
        for var in VARS {
            if let Some(value) = (self.get)(var) {
                return parse_tasks_per_node(&value)
                    .map(|n| (var, n))
                    .map_err(|expected| BootstrapError::InvalidVar {
                        var,
                        value,
                        expected,
                    });
            }
        }
        Err(BootstrapError::MissingVar {
            var: VARS[0],
            launcher: self.source,
            expected: "the number of ranks per node; none of SLURM_NTASKS_PER_NODE, \
                       SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE is set (run under srun, \
                       or pass --ntasks-per-node)"
                .into(),
        })
    }

    /// Validates the layout and reads the rendezvous address and secret.
    fn finish(
        &self,
        layout: (usize, usize, usize, usize),
        names: (&str, &str, &str),
        addr_hint: &str,
    ) -> Result<WorldInfo, BootstrapError> {
        check_layout(layout, names)?;
        let master_addr = self.required(
            "MASTER_ADDR",
            &format!("the host name or IP address where rank 0 listens; {addr_hint}"),
        )?;
        let rendezvous_port = self.rendezvous_port(addr_hint)?;
        let (rank, world_size, local_rank, local_world_size) = layout;
        Ok(WorldInfo {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr: master_addr.trim().to_owned(),
            rendezvous_port,
            secret: (self.get)(SECRET_VAR),
            source: self.source,
        })
    }
}

impl<F: Fn(&str) -> Option<String>> Vars<'_, F> {
    /// `UEP_MASTER_PORT`, else `MASTER_PORT + 1` (see [`WorldInfo::from_vars`]).
    fn rendezvous_port(&self, addr_hint: &str) -> Result<u16, BootstrapError> {
        let parse = |var: &'static str, value: String, expected: String| match value
            .trim()
            .parse::<u16>()
        {
            Ok(p) if p > 0 => Ok(p),
            _ => Err(BootstrapError::InvalidVar {
                var,
                value,
                expected,
            }),
        };
        if let Some(value) = (self.get)(PORT_VAR) {
            let expected = "the TCP port (1..=65535) of uep's rendezvous on MASTER_ADDR".into();
            return parse(PORT_VAR, value, expected);
        }
        let expected = format!(
            "a TCP port in 1..=65534 (uep's rendezvous listens on MASTER_PORT + 1; set \
             {PORT_VAR} to choose another); {addr_hint}"
        );
        let value = self.required("MASTER_PORT", &expected)?;
        let port = parse("MASTER_PORT", value.clone(), expected.clone())?;
        port.checked_add(1).ok_or(BootstrapError::InvalidVar {
            var: "MASTER_PORT",
            value,
            expected,
        })
    }
}

/// Parses Slurm's tasks-per-node syntax (`4`, `4(x2)`, `4(x2),4`) into the uniform per-node count.
fn parse_tasks_per_node(value: &str) -> Result<usize, String> {
    let expected = |detail: &str| {
        format!(
            "a per-node task count like `4`, `4(x2)` or `4(x2),4` with the same count on every \
             node{detail}"
        )
    };
    let mut count: Option<usize> = None;
    for item in value.trim().split(',') {
        let item = item.trim();
        let (n, reps) = match item.split_once('(') {
            Some((n, rest)) => {
                let reps = rest
                    .strip_prefix('x')
                    .and_then(|r| r.strip_suffix(')'))
                    .and_then(|r| r.parse::<usize>().ok());
                (n, reps)
            }
            None => (item, Some(1)),
        };
        let n = match (n.parse::<usize>(), reps) {
            (Ok(n), Some(r)) if n > 0 && r > 0 => n,
            _ => return Err(expected("")),
        };
        match count {
            Some(c) if c != n => return Err(expected(
                " (uep needs the same number of ranks on every node; use srun --ntasks-per-node)",
            )),
            _ => count = Some(n),
        }
    }
    count.ok_or_else(|| expected(""))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> Result<WorldInfo, BootstrapError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        WorldInfo::from_vars(|k| map.get(k).cloned())
    }

    const TORCHRUN: &[(&str, &str)] = &[
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ];

    fn with(
        base: &[(&'static str, &'static str)],
        over: &[(&'static str, &'static str)],
    ) -> Vec<(&'static str, &'static str)> {
        let mut v: Vec<_> = base
            .iter()
            .filter(|(k, _)| !over.iter().any(|(o, _)| o == k))
            .copied()
            .collect();
        v.extend(over.iter().filter(|(_, val)| *val != "<unset>").copied());
        v
    }

    #[test]
    fn torchrun_parses() {
        let w = parse(TORCHRUN).unwrap();
        assert_eq!(
            (w.rank, w.world_size, w.local_rank, w.local_world_size),
            (5, 8, 1, 4)
        );
        // torchrun's store holds MASTER_PORT; the rendezvous takes the next port.
        assert_eq!(
            (w.master_addr.as_str(), w.rendezvous_port),
            ("node0", 29501)
        );
        assert_eq!(w.source, EnvSource::Torchrun);
        assert_eq!(w.secret, None);
        assert_eq!((w.node(), w.num_nodes()), (1, 2));
        w.validate().unwrap();
    }

    #[test]
    fn uep_launcher_and_secret() {
        let w = parse(&with(
            TORCHRUN,
            &[(LAUNCHER_VAR, LAUNCHER_LOCAL), (SECRET_VAR, "s3cret")],
        ))
        .unwrap();
        assert_eq!(w.source, EnvSource::Uep);
        assert_eq!(w.secret.as_deref(), Some("s3cret"));
        assert!(!format!("{w:?}").contains("s3cret"), "Debug must redact");
        // An empty secret counts as none.
        let w = parse(&with(TORCHRUN, &[(SECRET_VAR, "")])).unwrap();
        assert_eq!(w.secret, None);
    }

    #[test]
    fn torchrun_errors_name_variable_and_value() {
        let e = parse(&with(TORCHRUN, &[("WORLD_SIZE", "eight")])).unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("WORLD_SIZE") && m.contains("\"eight\"") && m.contains("positive integer"),
            "{m}"
        );

        let e = parse(&with(TORCHRUN, &[("RANK", "8")])).unwrap_err();
        let m = e.to_string();
        assert!(m.contains("RANK=\"8\"") && m.contains("0..8"), "{m}");

        let e = parse(&with(TORCHRUN, &[("MASTER_PORT", "<unset>")])).unwrap_err();
        assert!(
            matches!(
                e,
                BootstrapError::MissingVar {
                    var: "MASTER_PORT",
                    launcher: EnvSource::Torchrun,
                    ..
                }
            ),
            "{e}"
        );

        let e = parse(&with(TORCHRUN, &[("MASTER_PORT", "70000")])).unwrap_err();
        assert!(e.to_string().contains("1..=65534"), "{e}");
        // The last port has no successor: the message names the override.
        let e = parse(&with(TORCHRUN, &[("MASTER_PORT", "65535")])).unwrap_err();
        assert!(e.to_string().contains(PORT_VAR), "{e}");

        let e = parse(&with(TORCHRUN, &[("LOCAL_WORLD_SIZE", "3")])).unwrap_err();
        assert!(e.to_string().contains("not a multiple"), "{e}");

        let e = parse(&with(TORCHRUN, &[("LOCAL_RANK", "2")])).unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("not a block layout") && m.contains("LOCAL_RANK=1"),
            "{m}"
        );

        let e = parse(&with(TORCHRUN, &[("LOCAL_WORLD_SIZE", "<unset>")])).unwrap_err();
        assert!(e.to_string().contains("LOCAL_WORLD_SIZE is not set"), "{e}");
    }

    const OMPI: &[(&str, &str)] = &[
        ("OMPI_COMM_WORLD_RANK", "2"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "1234"),
    ];

    #[test]
    fn openmpi_parses_and_requires_master() {
        let w = parse(OMPI).unwrap();
        assert_eq!(w.source, EnvSource::OpenMpi);
        assert_eq!(
            (w.rank, w.world_size, w.node(), w.num_nodes()),
            (2, 4, 1, 2)
        );

        let e = parse(&with(OMPI, &[("MASTER_ADDR", "<unset>")])).unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("MASTER_ADDR is not set")
                && m.contains("Open MPI")
                && m.contains("mpirun -x"),
            "{m}"
        );

        let e = parse(&with(OMPI, &[("OMPI_COMM_WORLD_LOCAL_SIZE", "0")])).unwrap_err();
        assert!(
            e.to_string().contains("OMPI_COMM_WORLD_LOCAL_SIZE=\"0\""),
            "{e}"
        );
    }

    const SLURM: &[(&str, &str)] = &[
        ("SLURM_PROCID", "7"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "3"),
        ("SLURM_NTASKS_PER_NODE", "4"),
        ("MASTER_ADDR", "n0"),
        ("MASTER_PORT", "4000"),
    ];

    #[test]
    fn slurm_parses_all_tasks_per_node_sources() {
        let w = parse(SLURM).unwrap();
        assert_eq!(w.source, EnvSource::Slurm);
        assert_eq!(
            (w.rank, w.local_world_size, w.node(), w.num_nodes()),
            (7, 4, 1, 2)
        );

        for (var, val) in [
            ("SLURM_NTASKS_PER_NODE", "4(x2)"),
            ("SLURM_STEP_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_TASKS_PER_NODE", "4(x1),4"),
        ] {
            let mut v = with(SLURM, &[("SLURM_NTASKS_PER_NODE", "<unset>")]);
            v.push((var, val));
            let w = parse(&v).unwrap_or_else(|e| panic!("{var}={val}: {e}"));
            assert_eq!(w.local_world_size, 4, "{var}={val}");
        }
        // The explicit per-node count wins over the derived ones.
        let mut v = SLURM.to_vec();
        v.push(("SLURM_TASKS_PER_NODE", "2(x4)"));
        assert_eq!(parse(&v).unwrap().local_world_size, 4);
    }

    #[test]
    fn slurm_errors() {
        let e = parse(&with(SLURM, &[("SLURM_NTASKS_PER_NODE", "4(x1),3")])).unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("SLURM_NTASKS_PER_NODE") && m.contains("same number of ranks"),
            "{m}"
        );

        for bad in ["4(2)", "x", "4(x0)", "0", "4(x2", ""] {
            let r = parse(&with(SLURM, &[("SLURM_NTASKS_PER_NODE", bad)]));
            if bad.is_empty() {
                // Empty counts as unset, and no fallback is set.
                assert!(r.unwrap_err().to_string().contains("ranks per node"));
            } else {
                assert!(
                    matches!(r, Err(BootstrapError::InvalidVar { .. })),
                    "{bad}: {r:?}"
                );
            }
        }

        let e = parse(&with(SLURM, &[("MASTER_PORT", "<unset>")])).unwrap_err();
        assert!(e.to_string().contains("scontrol show hostnames"), "{e}");
    }

    #[test]
    fn precedence_and_absence() {
        // torchrun inside srun: RANK wins.
        let mut v = SLURM.to_vec();
        v.extend_from_slice(&TORCHRUN[..4]);
        assert_eq!(parse(&v).unwrap().source, EnvSource::Torchrun);
        // Open MPI wins over Slurm.
        let mut v = SLURM.to_vec();
        v.extend_from_slice(&OMPI[..4]);
        assert_eq!(parse(&v).unwrap().source, EnvSource::OpenMpi);
        // Nothing at all, or an empty RANK.
        assert!(matches!(parse(&[]), Err(BootstrapError::NoRankEnv)));
        assert!(matches!(
            parse(&[("RANK", "")]),
            Err(BootstrapError::NoRankEnv)
        ));
    }

    #[test]
    fn rendezvous_port_override() {
        let w = parse(&with(TORCHRUN, &[(PORT_VAR, "40000")])).unwrap();
        assert_eq!(w.rendezvous_port, 40000);
        // With the override, MASTER_PORT is not needed at all.
        let w = parse(&with(
            TORCHRUN,
            &[(PORT_VAR, "40000"), ("MASTER_PORT", "<unset>")],
        ))
        .unwrap();
        assert_eq!(w.rendezvous_port, 40000);
        let e = parse(&with(TORCHRUN, &[(PORT_VAR, "0")])).unwrap_err();
        assert!(
            matches!(e, BootstrapError::InvalidVar { var: PORT_VAR, .. }),
            "{e}"
        );
    }

    #[test]
    fn validate_catches_hand_built_mistakes() {
        let good = parse(TORCHRUN).unwrap();
        let mut w = good.clone();
        w.world_size = 6;
        assert!(w.validate().is_err());
        let mut w = good.clone();
        w.rendezvous_port = 0;
        assert!(w.validate().is_err());
        let mut w = good;
        w.master_addr.clear();
        assert!(w.validate().is_err());
    }

    proptest::proptest! {
        #[test]
        fn tasks_per_node_never_panics(s in "[0-9x(),]{0,12}") {
            let _ = parse_tasks_per_node(&s);
        }

        #[test]
        fn tasks_per_node_uniform_roundtrip(n in 1usize..64, reps in proptest::collection::vec(1usize..5, 1..4)) {
            let s = reps.iter().map(|r| if *r == 1 { n.to_string() } else { format!("{n}(x{r})") }).collect::<Vec<_>>().join(",");
            proptest::prop_assert_eq!(parse_tasks_per_node(&s), Ok(n));
        }
    }
}
