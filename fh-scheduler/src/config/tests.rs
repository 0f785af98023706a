use super::*;
use std::collections::HashMap;

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| m.get(k).cloned()
}

#[test]
fn defaults_match_the_design_table() {
    let c = Config::from_lookup(env(&[])).unwrap();
    assert_eq!(c.preset, Preset::FastHorovod);
    assert_eq!(c.channels, 4);
    assert_eq!(c.fusion_threshold, 64 * MIB);
    assert_eq!(c.partition_bytes, 16 * MIB);
    assert_eq!(c.cycle_time, Duration::ZERO);
    assert_eq!(c.cache_capacity, 1024);
    assert_eq!(c.stall_check, Some(Duration::from_secs(60)));
    assert_eq!(c.stall_shutdown, None);
    let h = Config::from_lookup(env(&[("FH_SCHEDULE", "horovod")])).unwrap();
    assert_eq!(h.cycle_time, Duration::from_millis(1));
    assert_eq!(h.fusion_threshold, 128 * MIB);
    assert_eq!(h.effective_channels(), 1);
}

#[test]
fn variables_are_read() {
    let c = Config::from_lookup(env(&[
        ("FH_CHANNELS", "2"),
        ("FH_FUSION_THRESHOLD", "1MiB"),
        ("FH_PARTITION_BYTES", "4096"),
        ("FH_CYCLE_TIME_MS", "2.5"),
        ("FH_CACHE_CAPACITY", "0"),
        ("FH_PRIORITY", "forward"),
        ("FH_TIMELINE", "/tmp/t.json"),
        ("FH_STALL_CHECK_SECONDS", "0"),
        ("FH_STALL_SHUTDOWN_SECONDS", "5"),
        ("FH_FLIGHT_RECORDS", "100"),
        ("FH_FLIGHT_DIR", "/tmp/flight"),
        ("FH_METRICS_ADDR", ":9100"),
    ]))
    .unwrap();
    assert_eq!(c.flight_records, 100);
    assert_eq!(c.flight_dir, Some(PathBuf::from("/tmp/flight")));
    assert_eq!(c.metrics_addr, Some("127.0.0.1:9100".parse().unwrap()));
    let any = Config::from_lookup(env(&[("FH_METRICS_ADDR", "0.0.0.0:9200")])).unwrap();
    assert_eq!(any.metrics_addr, Some("0.0.0.0:9200".parse().unwrap()));
    assert_eq!(
        Config::default().flight_records,
        crate::flight::DEFAULT_RECORDS
    );
    assert_eq!(c.channels, 2);
    assert_eq!(c.fusion_threshold, MIB);
    assert_eq!(c.partition_bytes, 4096);
    assert_eq!(c.cycle_time, Duration::from_micros(2500));
    assert_eq!(c.cache_capacity, 0);
    assert_eq!(c.priority, Priority::Forward);
    assert_eq!(c.timeline, Some(PathBuf::from("/tmp/t.json")));
    assert_eq!(c.stall_check, None);
    assert_eq!(c.stall_shutdown, Some(Duration::from_secs(5)));
    // Auto: on between hosts and from BACKPRESSURE_AUTO_RANKS ranks; never under horovod; a
    // forced value holds whatever the wire and the world.
    let auto = Config::default();
    assert_eq!(auto.backpressure, None);
    assert!(!auto.backpressure_on(BACKPRESSURE_AUTO_RANKS - 1, Wire::Memory));
    assert!(!auto.backpressure_on(BACKPRESSURE_AUTO_RANKS - 1, Wire::Loopback));
    assert!(auto.pacing(BACKPRESSURE_AUTO_RANKS, Wire::Memory).enabled);
    assert!(auto.pacing(BACKPRESSURE_AUTO_RANKS, Wire::Loopback).enabled);
    assert!(auto.backpressure_on(2, Wire::Network));
    // TCP on one host goes through loopback; between hosts every transport is a network.
    use fh_transport::WireKind;
    assert_eq!(Wire::of(WireKind::Network, 1), Wire::Loopback);
    assert_eq!(Wire::of(WireKind::Network, 2), Wire::Network);
    assert_eq!(Wire::of(WireKind::Memory, 2), Wire::Network);
    assert_eq!(Wire::of(WireKind::Memory, 1), Wire::Memory);
    for wire in [Wire::Memory, Wire::Loopback, Wire::Network] {
        assert!(!Config::preset(Preset::Horovod).backpressure_on(4096, wire));
        let off = Config::from_lookup(env(&[("FH_BACKPRESSURE", "off")])).unwrap();
        assert!(!off.pacing(4096, wire).enabled);
        let on = Config::from_lookup(env(&[("FH_BACKPRESSURE", "1")])).unwrap();
        assert!(on.pacing(2, wire).enabled);
    }
    let auto = Config::from_lookup(env(&[("FH_BACKPRESSURE", "Auto")])).unwrap();
    assert_eq!(auto.backpressure, None);
    let e = Config::from_lookup(env(&[("FH_BACKPRESSURE", "sometimes")]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("FH_BACKPRESSURE"), "{e}");
    let bp = Config::from_lookup(env(&[
        ("FH_BACKPRESSURE_BYTES", "1MiB"),
        ("FH_BACKPRESSURE_MAX_MS", "3"),
    ]))
    .unwrap();
    assert_eq!(bp.backpressure_bytes, MIB);
    assert_eq!(bp.backpressure_max, Duration::from_millis(3));
    assert!(Config::default()
        .cache_capacity(MAX_CACHE_CAPACITY + 1)
        .validate()
        .is_err());
    let hot = Config::from_lookup(env(&[
        ("FH_INLINE_BYTES", "4KiB"),
        ("FH_CONTROL_SPIN_US", "20"),
    ]))
    .unwrap();
    assert_eq!(hot.inline_bytes, 4096);
    assert_eq!(hot.control_spin, Duration::from_micros(20));
    assert!(
        Config::default().caller_rounds,
        "callers run rounds by default"
    );
    for (v, on) in [("0", false), ("off", false), ("1", true), ("true", true)] {
        let c = Config::from_lookup(env(&[("FH_CALLER_ROUNDS", v)])).unwrap();
        assert_eq!(c.caller_rounds, on, "FH_CALLER_ROUNDS={v}");
    }
    assert_eq!(
        Config::default()
            .control_spin(Duration::from_secs(1))
            .control_spin,
        MAX_CONTROL_SPIN
    );
    let short = Config::from_lookup(env(&[("FH_TIMEOUT_SECONDS", "2")])).unwrap();
    assert_eq!(short.idle_heartbeat, Duration::from_millis(500));
}

#[test]
fn the_gpu_switch_is_read_and_off_by_default() {
    assert!(!Config::from_lookup(env(&[])).unwrap().cuda);
    for (v, on) in [
        ("1", true),
        ("true", true),
        ("0", false),
        ("off", false),
        ("", false),
    ] {
        assert_eq!(
            Config::from_lookup(env(&[("FH_CUDA", v)])).unwrap().cuda,
            on,
            "{v}"
        );
    }
    // It is a planning field: ranks that disagree refuse to start.
    assert!(
        agree::planning_fields(&Config::default().cuda(true), 2, Wire::Memory)
            .contains(&("FH_CUDA", 1))
    );
}

#[test]
fn bad_values_name_the_variable_and_accepted_values() {
    for (var, val, expect) in [
        ("FH_SCHEDULE", "fast-ish", "fasthorovod, horovod"),
        ("FH_CHANNELS", "0", "1 to 64"),
        ("FH_CHANNELS", "four", "integer"),
        ("FH_FUSION_THRESHOLD", "64XB", "suffix"),
        ("FH_CYCLE_TIME_MS", "-1", "non-negative"),
        ("FH_PRIORITY", "backward", "ready, forward"),
        ("FH_STALL_CHECK_SECONDS", "soon", "non-negative"),
        ("FH_LOG_LEVEL", "loud", "info"),
        ("FH_CACHE_CAPACITY", "1000000000", "0 to 65536"),
        ("FH_BACKPRESSURE_BYTES", "lots", "byte size"),
        ("FH_BACKPRESSURE_MAX_MS", "5000", "0 to 1000"),
        ("FH_CUDA", "maybe", "0, 1, true, false"),
        ("FH_INLINE_BYTES", "lots", "byte size"),
        ("FH_EAGER_BYTES", "1MiB", "0 (off) to 65536"),
        ("FH_CONTROL_SPIN_US", "5000", "0 to 1000"),
        ("FH_CALLER_ROUNDS", "often", "0, 1, true, false"),
        ("FH_FLIGHT_RECORDS", "100000000", "0 (off) to 1048576"),
        ("FH_METRICS_ADDR", "localhost:x", "PORT, :PORT or IP:PORT"),
        ("FH_SUMMARY", "sometimes", "0, 1, true, false"),
    ] {
        let err = Config::from_lookup(env(&[(var, val)]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(var) && err.contains(expect),
            "{var}={val}: {err}"
        );
    }
}

#[test]
fn bounded_durations_name_their_range() {
    for (var, ok, over) in [
        ("FH_BACKPRESSURE_MAX_MS", "1000", "1001"),
        ("FH_CONTROL_SPIN_US", "1000", "1000.5"),
    ] {
        assert!(Config::from_lookup(env(&[(var, ok)])).is_ok(), "{var}={ok}");
        let e = Config::from_lookup(env(&[(var, over)]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(var) && e.contains("accepted values: 0 to 1000"),
            "{e}"
        );
    }
}

#[test]
fn every_variable_the_engine_reads_is_listed() {
    // The list that flags unknown names must cover what `from_lookup` reads, or a working
    // setting would be reported as having no effect.
    let asked = std::cell::RefCell::new(Vec::new());
    Config::from_lookup(|k| {
        asked.borrow_mut().push(k.to_string());
        None
    })
    .unwrap();
    let asked = asked.into_inner();
    assert!(asked.len() >= 15, "{asked:?}");
    for name in &asked {
        assert!(
            crate::config::ENV_VARIABLES.contains(&name.as_str()),
            "{name} is read but not in ENV_VARIABLES"
        );
    }
}

#[test]
fn unknown_fh_variables_are_named_with_the_closest_known_one() {
    use crate::config::{unknown_variables, UnknownVariable};
    let found = unknown_variables([
        "FH_PRESET",
        "FH_CHANNEL",
        "FH_TRANSPROT",
        "FH_SOMETHING_ELSE_ENTIRELY",
        // Read by the engine, the transports or the tools: not flagged.
        "FH_CHANNELS",
        "FH_SCHEDULE",
        "FH_RANK",
        "FH_SHM_SLOT_BYTES",
        "FH_BENCH_WORKLOADS",
        "FH_TEST_SCENARIO",
        "FH_VENV",
        "FH_NOTICE_FD",
        "FH_CHAOS_RUNS",
        "FH_EKILL_RUNS",
        // Not ours.
        "HOROVOD_FUSION_THRESHOLD",
        "PATH",
    ]);
    let want = |name: &str, suggestion: Option<&'static str>| UnknownVariable {
        name: name.into(),
        suggestion,
    };
    assert_eq!(
        found,
        [
            want("FH_PRESET", Some("FH_SCHEDULE")),
            want("FH_CHANNEL", Some("FH_CHANNELS")),
            want("FH_TRANSPROT", Some("FH_TRANSPORT")),
            want("FH_SOMETHING_ELSE_ENTIRELY", None),
        ]
    );
    let text = found[0].to_string();
    assert!(
        text.contains("FH_PRESET") && text.contains("did you mean FH_SCHEDULE?"),
        "{text}"
    );
    assert!(found[3].to_string().contains("README"), "{}", found[3]);
}

#[test]
fn clock_offsets_are_zero_on_rank_0s_host_and_measured_across_hosts() {
    use fh_transport::backend::local::LocalWorld;
    use fh_transport::{Topology, Transport};
    // Three ranks: 0 and 1 on host 0, rank 2 "on host 1" (the same machine, so its measured
    // offset is the fastest delivery of a broadcast: small and not negative).
    let threads: Vec<_> = LocalWorld::new(3)
        .into_iter()
        .map(|mut t| {
            std::thread::spawn(move || {
                let rank = t.rank();
                let topo = Topology {
                    rank,
                    size: 3,
                    local_rank: rank % 2,
                    local_size: if rank < 2 { 2 } else { 1 },
                    cross_rank: usize::from(rank == 2),
                    cross_size: 2,
                };
                let mut comm = t.open("clock").unwrap();
                let across = agree::measure_clock(comm.as_mut(), topo).unwrap();
                let one_host = Topology {
                    cross_rank: 0,
                    cross_size: 1,
                    ..topo
                };
                let alone = agree::measure_clock(comm.as_mut(), one_host).unwrap();
                (across, alone)
            })
        })
        .collect();
    let out: Vec<(i64, i64)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!((out[0].0, out[1].0), (0, 0));
    assert!((0..1_000_000).contains(&out[2].0), "{out:?}");
    assert!(out.iter().all(|o| o.1 == 0));
}

#[test]
fn control_values_are_read_exactly_or_are_an_internal_error() {
    let internal = |e: SchedulerError, want: &[&str]| match &e {
        SchedulerError::Internal(m) if want.iter().all(|w| m.contains(w)) => {}
        _ => panic!("{want:?}: {e}"),
    };
    // Rank 0's clock: its time, then its host.
    let b = [(-5i64).to_le_bytes(), 7u64.to_le_bytes()].concat();
    assert_eq!(agree::read_clock(&b), Ok((-5, 7)));
    // A short or long buffer is an internal error naming the value, never a default.
    internal(
        agree::read_clock(&b[..15]).unwrap_err(),
        &["rank 0's clock (15 bytes)", "truncated"],
    );
    internal(
        agree::read_clock(&[&b[..], &[0]].concat()).unwrap_err(),
        &["rank 0's clock (17 bytes)", "1 trailing bytes"],
    );
    // The planning fields.
    let b = [3i64.to_le_bytes(), (-1i64).to_le_bytes()].concat();
    assert_eq!(agree::read_fields(&b, 2, "fields"), Ok(vec![3, -1]));
    internal(
        agree::read_fields(&b, 3, "the largest fields").unwrap_err(),
        &["the largest fields (16 bytes)", "truncated"],
    );
    internal(
        agree::read_fields(&b, 1, "fields").unwrap_err(),
        &["8 trailing bytes"],
    );
    // The incarnation.
    assert_eq!(agree::read_incarnation(&9u64.to_le_bytes()), Ok(9));
    internal(
        agree::read_incarnation(&[1, 2, 3]).unwrap_err(),
        &["the engine's incarnation (3 bytes)"],
    );
}

#[test]
fn the_channel_count_fits_the_cores_unless_it_is_set() {
    let auto = Config::from_lookup(env(&[])).unwrap();
    assert!(auto.channels_auto);
    // Two cores or more for each of the host's ranks: every channel; fewer: two.
    assert_eq!(auto.channels_for(16, 8), 4);
    assert_eq!(auto.channels_for(8, 4), 4);
    assert_eq!(auto.channels_for(1, 1), 2);
    assert_eq!(auto.channels_for(2, 4), 2);
    assert_eq!(auto.channels_for(7, 4), 2);
    assert_eq!(auto.channels_for(2, 0), 4);
    for v in ["auto", "AUTO", " auto "] {
        assert_eq!(
            Config::from_lookup(env(&[("FH_CHANNELS", v)])).unwrap(),
            auto,
            "{v}"
        );
    }
    // A count set, in code or by the variable, is the count, whatever the cores.
    let set = Config::from_lookup(env(&[("FH_CHANNELS", "4")])).unwrap();
    assert!(!set.channels_auto);
    assert_eq!(set.channels_for(2, 4), 4);
    assert_eq!(Config::default().channels(3).channels_for(1, 8), 3);
    assert_eq!(
        Config::default()
            .channels(3)
            .channels_auto(true)
            .channels_for(1, 8),
        2
    );
    // `auto` with at most one channel opens one; `horovod` always one.
    assert_eq!(
        Config::default()
            .channels(1)
            .channels_auto(true)
            .channels_for(1, 8),
        1
    );
    let h = Config::preset(Preset::Horovod);
    assert!(!h.channels_auto);
    assert_eq!(h.channels_for(64, 1), 1);
    assert_eq!(h.channels_auto(true).channels_for(64, 1), 1);
    // In the agreed fields: `auto` as minus its most, a set count as itself, so that a rank
    // with `auto` and one with a count refuse to start together.
    let field = |c: &Config| {
        agree::planning_fields(c, 2, Wire::Memory)
            .into_iter()
            .find(|f| f.0 == "FH_CHANNELS")
            .unwrap()
            .1
    };
    assert_eq!(field(&auto), -4);
    assert_eq!(field(&set), 4);
    assert_eq!(field(&Config::preset(Preset::Horovod)), 1);
}

#[test]
fn the_ranks_open_the_smallest_channel_count_any_asks_for() {
    use fh_transport::backend::local::LocalWorld;
    use fh_transport::Transport;
    // Ranks on hosts with other cores ask for other counts under `auto`: they agree on the
    // smallest. A rank with a set count and one with `auto` refuse to start, naming both.
    let run = |configs: Vec<(Config, usize)>| {
        let n = configs.len();
        let threads: Vec<_> = LocalWorld::new(n)
            .into_iter()
            .zip(configs)
            .map(|(mut t, (c, asked))| {
                std::thread::spawn(move || {
                    let mut comm = t.open("agree").unwrap();
                    agree::agree(comm.as_mut(), &c, Wire::Memory, None, asked)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect::<Vec<_>>()
    };
    let auto = Config::default();
    let out = run(vec![
        (auto.clone(), 4),
        (auto.clone(), 2),
        (auto.clone(), 4),
    ]);
    for o in out {
        assert_eq!(o.unwrap().channels, 2);
    }
    let set = Config::default().channels(4);
    for o in run(vec![(set.clone(), 4), (auto, 2)]) {
        let e = o.unwrap_err().to_string();
        assert!(
            e.contains("FH_CHANNELS") && e.contains("auto (at most 4)") && e.contains("disagree"),
            "{e}"
        );
    }
    for o in run(vec![(set.clone(), 4), (set, 4)]) {
        assert_eq!(o.unwrap().channels, 4);
    }
}
