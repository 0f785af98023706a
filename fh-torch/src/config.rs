//! The engine's configuration from the environment, honouring Horovod's variables.
//!
//! A Horovod user already has `HOROVOD_*` variables in their job scripts. Those that map onto
//! one of FastHorovod's knobs are read as aliases of the `FH_*` variable; when both are set the
//! `FH_*` variable wins. The others are accepted and ignored (listed in [`IGNORED`]); a log
//! line says so once.

use fh_scheduler::{Config, SchedulerError};

/// A Horovod variable read as an alias of a FastHorovod one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Alias {
    /// Horovod's variable.
    pub horovod: &'static str,
    /// The FastHorovod variable it sets.
    pub fh: &'static str,
    /// What it means, for the docs.
    pub meaning: &'static str,
}

/// The Horovod variables that map onto FastHorovod's knobs.
pub const ALIASES: &[Alias] = &[
    Alias {
        horovod: "HOROVOD_FUSION_THRESHOLD",
        fh: "FH_FUSION_THRESHOLD",
        meaning: "bytes per fused group",
    },
    Alias {
        horovod: "HOROVOD_CYCLE_TIME",
        fh: "FH_CYCLE_TIME_MS",
        meaning: "milliseconds between negotiation cycles (a fixed cycle; FastHorovod's default, 0, wakes on submission)",
    },
    Alias {
        horovod: "HOROVOD_CACHE_CAPACITY",
        fh: "FH_CACHE_CAPACITY",
        meaning: "response-cache slots",
    },
    Alias {
        horovod: "HOROVOD_TIMELINE",
        fh: "FH_TIMELINE",
        meaning: "path of the Chrome-trace timeline",
    },
    Alias {
        horovod: "HOROVOD_STALL_CHECK_TIME_SECONDS",
        fh: "FH_STALL_CHECK_SECONDS",
        meaning: "seconds before a stall warning",
    },
    Alias {
        horovod: "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
        fh: "FH_STALL_SHUTDOWN_SECONDS",
        meaning: "seconds of stall before shutting down (0 = never)",
    },
    Alias {
        horovod: "HOROVOD_LOG_LEVEL",
        fh: "FH_LOG_LEVEL",
        meaning: "log level (trace, debug, info, warning, error, fatal)",
    },
];

/// `HOROVOD_STALL_CHECK_DISABLE=1` turns the stall inspector off (`FH_STALL_CHECK_SECONDS=0`).
pub const STALL_CHECK_DISABLE: &str = "HOROVOD_STALL_CHECK_DISABLE";

/// Horovod variables FastHorovod accepts and ignores: they tune machinery FastHorovod does not
/// have or replaces (its own schedule, transports and launcher variables).
pub const IGNORED: &[&str] = &[
    "HOROVOD_AUTOTUNE",
    "HOROVOD_AUTOTUNE_LOG",
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES",
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
    "HOROVOD_HIERARCHICAL_ALLREDUCE",
    "HOROVOD_HIERARCHICAL_ALLGATHER",
    "HOROVOD_TIMELINE_MARK_CYCLES",
    "HOROVOD_BATCH_D2D_MEMCOPIES",
    "HOROVOD_NUM_NCCL_STREAMS",
    "HOROVOD_CPU_OPERATIONS",
    "HOROVOD_GPU_OPERATIONS",
    "HOROVOD_CONTROLLER",
    "HOROVOD_MPI_THREADS_DISABLE",
    "HOROVOD_THREAD_AFFINITY",
    "HOROVOD_DISABLE_GROUP_FUSION",
    "HOROVOD_DISABLE_NVTX_RANGES",
    "HOROVOD_ENABLE_XLA_OPS",
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE",
    "HOROVOD_GLOO_TIMEOUT_SECONDS",
    "HOROVOD_ELASTIC",
];

/// What `lookup` gives for `var`, with the Horovod aliases applied: an `FH_*` variable that is
/// set wins; otherwise its Horovod alias (translated where the units or words differ).
pub fn aliased(lookup: &impl Fn(&str) -> Option<String>, var: &str) -> Option<String> {
    if let Some(v) = lookup(var) {
        return Some(v);
    }
    if var == "FH_STALL_CHECK_SECONDS" && truthy(lookup(STALL_CHECK_DISABLE).as_deref()) {
        return Some("0".into());
    }
    let alias = ALIASES.iter().find(|a| a.fh == var)?;
    let v = lookup(alias.horovod)?;
    Some(match var {
        // Horovod's words for two levels.
        "FH_LOG_LEVEL" => match v.trim().to_ascii_lowercase().as_str() {
            "warning" => "warn".into(),
            "fatal" => "error".into(),
            _ => v,
        },
        // Horovod's `DYNAMIC`: no timeline at start-up, `start_timeline()` later. An empty
        // `FH_TIMELINE` means no timeline; never a file called `DYNAMIC`.
        "FH_TIMELINE" if v.trim() == TIMELINE_DYNAMIC => String::new(),
        _ => v,
    })
}

/// `HOROVOD_TIMELINE`'s special value: no timeline at `init`, one may be started later.
pub const TIMELINE_DYNAMIC: &str = "DYNAMIC";

fn truthy(v: Option<&str>) -> bool {
    matches!(
        v.map(|s| s.trim().to_ascii_lowercase()).as_deref(),
        Some("1" | "true" | "yes" | "on")
    )
}

/// The engine configuration from `lookup` (the environment in production): `FH_*` variables,
/// with `HOROVOD_*` aliases where no `FH_*` variable is set. A bad value is an error naming
/// the variable the user actually set.
pub fn config_from(lookup: impl Fn(&str) -> Option<String>) -> Result<Config, SchedulerError> {
    Config::from_lookup(|k| aliased(&lookup, k)).map_err(|e| match e {
        SchedulerError::Config { var, reason } => {
            let from_alias = lookup(&var).is_none();
            let shown = match ALIASES.iter().find(|a| a.fh == var) {
                Some(a) if from_alias && lookup(a.horovod).is_some() => {
                    format!("{} (read as {var})", a.horovod)
                }
                _ => var,
            };
            SchedulerError::Config { var: shown, reason }
        }
        other => other,
    })
}

/// The Horovod variables set in `lookup` that FastHorovod ignores.
pub fn ignored_set(lookup: impl Fn(&str) -> Option<String>) -> Vec<&'static str> {
    IGNORED
        .iter()
        .copied()
        .filter(|v| lookup(v).is_some())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::time::Duration;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn horovod_variables_are_aliases() {
        let c = config_from(env(&[
            ("HOROVOD_FUSION_THRESHOLD", "1048576"),
            ("HOROVOD_CYCLE_TIME", "5"),
            ("HOROVOD_CACHE_CAPACITY", "7"),
            ("HOROVOD_TIMELINE", "/tmp/t.json"),
            ("HOROVOD_STALL_CHECK_TIME_SECONDS", "9"),
            ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "30"),
            ("HOROVOD_LOG_LEVEL", "warning"),
        ]))
        .unwrap();
        assert_eq!(c.fusion_threshold, 1 << 20);
        assert_eq!(c.cycle_time, Duration::from_millis(5));
        assert_eq!(c.cache_capacity, 7);
        assert_eq!(
            c.timeline.as_deref(),
            Some(std::path::Path::new("/tmp/t.json"))
        );
        assert_eq!(c.stall_check, Some(Duration::from_secs(9)));
        assert_eq!(c.stall_shutdown, Some(Duration::from_secs(30)));
    }

    #[test]
    fn horovod_special_values_are_mapped_not_taken_literally() {
        // DYNAMIC: no timeline file at start-up (Horovod's `start_timeline()` comes later).
        let c = config_from(env(&[("HOROVOD_TIMELINE", "DYNAMIC")])).unwrap();
        assert_eq!(c.timeline, None);
        let c = config_from(env(&[("HOROVOD_TIMELINE", " DYNAMIC ")])).unwrap();
        assert_eq!(c.timeline, None);
        // Any other value is a path, even one that merely contains the word.
        let c = config_from(env(&[("HOROVOD_TIMELINE", "/tmp/DYNAMIC.json")])).unwrap();
        assert_eq!(
            c.timeline.as_deref(),
            Some(std::path::Path::new("/tmp/DYNAMIC.json"))
        );
        // An explicit FH_TIMELINE still wins over Horovod's DYNAMIC.
        let c = config_from(env(&[
            ("HOROVOD_TIMELINE", "DYNAMIC"),
            ("FH_TIMELINE", "/tmp/t.json"),
        ]))
        .unwrap();
        assert_eq!(
            c.timeline.as_deref(),
            Some(std::path::Path::new("/tmp/t.json"))
        );
        // Empty: no timeline, as in Horovod.
        assert_eq!(
            config_from(env(&[("HOROVOD_TIMELINE", "")]))
                .unwrap()
                .timeline,
            None
        );
        // Horovod's log level words, in any case: FATAL is error, WARNING is warn.
        for (h, fh) in [("FATAL", "error"), ("Warning", "warn"), ("fatal", "error")] {
            assert_eq!(
                aliased(&env(&[("HOROVOD_LOG_LEVEL", h)]), "FH_LOG_LEVEL").as_deref(),
                Some(fh),
                "{h}"
            );
            config_from(env(&[("HOROVOD_LOG_LEVEL", h)])).unwrap();
        }
        // Horovod's cycle time is fractional milliseconds; a fusion threshold and a cache
        // capacity of 0 turn fusion and the cache off; a stall shutdown time of 0 means never.
        let c = config_from(env(&[
            ("HOROVOD_CYCLE_TIME", "0.5"),
            ("HOROVOD_FUSION_THRESHOLD", "0"),
            ("HOROVOD_CACHE_CAPACITY", "0"),
            ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "0"),
        ]))
        .unwrap();
        assert_eq!(c.cycle_time, Duration::from_micros(500));
        assert_eq!(c.fusion_threshold, 0);
        assert_eq!(c.cache_capacity, 0);
        assert_eq!(c.stall_shutdown, None);
        // HOROVOD_STALL_CHECK_DISABLE takes Horovod's true words.
        for on in ["1", "true", "TRUE", "yes", "on"] {
            let c = config_from(env(&[("HOROVOD_STALL_CHECK_DISABLE", on)])).unwrap();
            assert_eq!(c.stall_check, None, "{on}");
        }
        let c = config_from(env(&[("HOROVOD_STALL_CHECK_DISABLE", "0")])).unwrap();
        assert_eq!(c.stall_check, Config::default().stall_check);
    }

    #[test]
    fn fh_variables_win() {
        let c = config_from(env(&[
            ("HOROVOD_CACHE_CAPACITY", "7"),
            ("FH_CACHE_CAPACITY", "11"),
            ("HOROVOD_STALL_CHECK_DISABLE", "1"),
            ("FH_STALL_CHECK_SECONDS", "5"),
        ]))
        .unwrap();
        assert_eq!(c.cache_capacity, 11);
        assert_eq!(c.stall_check, Some(Duration::from_secs(5)));
        let off = config_from(env(&[("HOROVOD_STALL_CHECK_DISABLE", "1")])).unwrap();
        assert_eq!(off.stall_check, None);
        let default = config_from(env(&[])).unwrap();
        assert_eq!(default, Config::default());
    }

    #[test]
    fn a_bad_alias_names_the_horovod_variable() {
        let e = config_from(env(&[("HOROVOD_CACHE_CAPACITY", "lots")])).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("HOROVOD_CACHE_CAPACITY"), "{msg}");
        assert!(msg.contains("FH_CACHE_CAPACITY"), "{msg}");
        let e = config_from(env(&[("FH_CACHE_CAPACITY", "lots")])).unwrap_err();
        assert!(!e.to_string().contains("HOROVOD"), "{e}");
    }

    #[test]
    fn ignored_variables_are_listed() {
        let set = ignored_set(env(&[
            ("HOROVOD_AUTOTUNE", "1"),
            ("HOROVOD_CACHE_CAPACITY", "7"),
        ]));
        assert_eq!(set, ["HOROVOD_AUTOTUNE"]);
        // No variable is both an alias and ignored.
        for a in ALIASES {
            assert!(!IGNORED.contains(&a.horovod), "{}", a.horovod);
        }
    }
}
