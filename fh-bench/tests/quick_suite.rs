//! The quick suite end to end on the smallest settings: 2 ranks, tiny sizes, one step. No
//! timing assertions: it checks that every part ran (or said why not) and that the outputs
//! (run.json, report.md, plots) are there and consistent.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn quick_suite_end_to_end_on_two_ranks() {
    let out: PathBuf = std::env::temp_dir().join(format!("fh-bench-e2e-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let child = Command::new(env!("CARGO_BIN_EXE_fh-bench"))
        .args([
            "suite",
            "--quick",
            "--np",
            "2",
            "--sizes",
            "8,4K",
            "--repeats",
            "1",
            "--steps",
            "1",
            "--replay-repeats",
            "2",
            "--models",
            "resnet50",
            "--backward-ms",
            "20",
            "--tensor-counts",
            "16",
            "--job-timeout",
            "60",
            "--out",
        ])
        .arg(&out)
        // Two streams between the TCP ranks although they share a host: the rows over TCP
        // report the streams their transport used.
        .env("FH_TCP_STREAMS", "2")
        .env("FH_TCP_STRIPE_LOCAL", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start fh-bench");
    let mut child = KillOnDrop(child);
    let deadline = Instant::now() + Duration::from_secs(240);
    let status = loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "fh-bench did not finish within 240 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stdout = String::new();
    let mut stderr = String::new();
    use std::io::Read;
    child
        .0
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    child
        .0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(status.success(), "fh-bench failed: {stderr}\n{stdout}");

    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    let run: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap();
    assert_eq!(run["config"]["np"], 2);
    assert_ne!(run["git_revision"], "");

    // Collectives: every collective at both sizes over TCP and shared-memory processes and
    // in-process threads.
    let rows = run["collectives"].as_array().unwrap();
    for transport in ["tcp", "shm", "local"] {
        for c in [
            "allreduce",
            "allgather",
            "broadcast",
            "alltoall",
            "reduce-scatter",
        ] {
            let n = rows
                .iter()
                .filter(|r| r["transport"] == transport && r["collective"] == c)
                .count();
            assert_eq!(n, 2, "{transport} {c}: {rows:#?}");
        }
    }
    for r in rows {
        assert_eq!(r["busbw"]["unit"], "GB/s");
        assert_eq!(r["time"]["unit"], "us");
        assert!(r["time"]["median"].as_f64().unwrap() > 0.0);
    }
    // OpenMPI: measured when installed, else said so.
    let skipped = run["skipped"].as_array().unwrap();
    let mpi_rows = rows.iter().filter(|r| r["transport"] == "openmpi").count();
    let mpi_skipped = skipped.iter().any(|s| s["what"] == "OpenMPI MPI_Allreduce");
    assert!(
        mpi_rows == 2 || mpi_skipped,
        "OpenMPI neither measured nor skipped: {run:#}"
    );

    // The replay ran every preset on the workload over both process transports, with ratios
    // to `horovod`.
    let replay = run["replay"].as_array().unwrap();
    assert_eq!(run["config"]["replay_repeats"], 2);
    // The Python peers (DDP on Gloo and on the fasthorovod backend, Horovod, fasthorovod.torch
    // over shm and tcp, DDP's floor) add rows when importable, else they are listed as
    // skipped: one or the other, never both or neither.
    let peers = [
        "ddp-gloo",
        "ddp-fasthorovod",
        "horovod-torch",
        "fasthorovod-torch",
        "ddp-floor",
    ];
    for (label, transport, what) in [
        ("ddp-gloo", "gloo", "PyTorch DDP (Gloo)"),
        (
            "ddp-fasthorovod",
            "shm",
            "PyTorch DDP on the fasthorovod backend over shared memory",
        ),
        (
            "ddp-fasthorovod",
            "tcp",
            "PyTorch DDP on the fasthorovod backend over TCP",
        ),
        ("horovod-torch", "gloo", "Horovod over Gloo"),
        ("horovod-torch", "mpi", "Horovod over MPI (yielding)"),
        (
            "horovod-torch",
            "mpi-busy",
            "Horovod over MPI (busy-polling)",
        ),
        (
            "fasthorovod-torch",
            "shm",
            "fasthorovod.torch over shared memory",
        ),
        ("fasthorovod-torch", "tcp", "fasthorovod.torch over TCP"),
        (
            "ddp-floor",
            "none",
            "PyTorch DDP communicating nothing (the floor of the DDP rows)",
        ),
    ] {
        let measured = replay
            .iter()
            .any(|r| r["schedule"] == label && r["transport"] == transport);
        let skipped_peer = skipped.iter().any(|s| s["what"] == what);
        assert!(
            measured != skipped_peer,
            "{what}: measured {measured}, skipped {skipped_peer}: {run:#}"
        );
    }
    let engine: Vec<String> = replay
        .iter()
        .filter(|r| !peers.contains(&r["schedule"].as_str().unwrap()))
        .map(|r| {
            format!(
                "{} ({})",
                r["schedule"].as_str().unwrap(),
                r["transport"].as_str().unwrap()
            )
        })
        .collect();
    // Back-pressure as shipped, then the other way: `auto` leaves it off on one host, over
    // loopback TCP and shared memory alike, at 2 ranks.
    let mut expected = Vec::new();
    for (t, other) in [("tcp", "+bp"), ("shm", "+bp")] {
        expected.push(format!("horovod ({t})"));
        for bp in ["", other] {
            for k in [1, 2, 4] {
                let s = format!("fasthorovod K={k} {bp}");
                expected.push(format!("{} ({t})", s.trim_end()));
            }
        }
    }
    assert_eq!(engine, expected, "{run:#}");
    for r in replay {
        assert_eq!(r["workload"], "resnet50");
        // Two interleaved runs, each with its median.
        assert_eq!(r["repeats"], 2, "{r:#}");
        assert_eq!(
            r["exposed_per_repeat"].as_array().unwrap().len(),
            2,
            "{r:#}"
        );
        assert_eq!(r["step"]["n"], 2, "{r:#}");
        assert_eq!(r["step"]["unit"], "ms");
        assert!(
            r["step"]["median"].as_f64().unwrap() >= 20.0,
            "a step lasts at least the backward"
        );
        assert!(r["step_ratio_to_horovod"].as_f64().unwrap() > 0.0);
        // The TCP streams each run's transport used (rank 0's), on the engine's rows over TCP.
        let streams = r["tcp_streams"].as_array().map_or(0, Vec::len);
        if r["transport"] == "tcp" && !peers.contains(&r["schedule"].as_str().unwrap()) {
            assert_eq!(streams, 2, "one per run: {r:#}");
            for s in r["tcp_streams"].as_array().unwrap() {
                assert_eq!(
                    (&s["streams"], &s["setting"]),
                    (&2.into(), &"2".into()),
                    "{r:#}"
                );
            }
        } else if r["transport"] == "shm" {
            assert_eq!(streams, 0, "{r:#}");
        }
        // The CPU time of all ranks per step: every row here runs one process per rank (the
        // engine's rows over TCP and shared memory, and the peers, whose adapter sums it).
        assert!(
            r["cpu_ms_per_step"].as_f64().is_some_and(|c| c > 0.0),
            "no CPU time: {r:#}"
        );
        // Of it, the ranks' main threads (the training loops): part of it, never more.
        let main = r["main_thread_cpu_ms_per_step"].as_f64();
        let total = r["cpu_ms_per_step"].as_f64().unwrap();
        assert!(
            main.is_some_and(|m| m > 0.0 && m <= total * 1.01 + 1.0),
            "main-thread CPU {main:?} of {total} ms: {r:#}"
        );
        // Each channel's share of the bytes, from the engine's per-channel counters.
        if let Some(k) = r["schedule"]
            .as_str()
            .and_then(|s| s.strip_prefix("fasthorovod K="))
            .and_then(|s| s[..1].parse::<usize>().ok())
        {
            let share = r["channel_share"].as_array().unwrap();
            assert_eq!(share.len(), k, "{r:#}");
            let total: f64 = share.iter().map(|v| v.as_f64().unwrap()).sum();
            assert!((total - 1.0).abs() < 1e-6, "{r:#}");
        }
    }
    // Negotiation: the three modes at the one tensor count, then the 8-byte allreduce back to
    // back with riding on (callers running the rounds, as shipped, and not) and off, with
    // rounds and bytes from the engine's counters.
    let neg = run["negotiation"].as_array().unwrap();
    let modes: Vec<&str> = neg.iter().map(|r| r["mode"].as_str().unwrap()).collect();
    assert_eq!(
        modes,
        [
            "coordinator",
            "bit-vector",
            "bit-vector, riding off",
            "bit-vector, 8 B back to back",
            "bit-vector, caller rounds off, 8 B back to back",
            "bit-vector, riding off, 8 B back to back",
        ],
        "{neg:#?}"
    );
    for r in neg {
        assert!(
            r["rounds_per_step"]["median"].as_f64().unwrap() >= 1.0,
            "{r:#}"
        );
        assert!(
            r["bytes_per_round"]["median"].as_f64().unwrap() > 0.0,
            "{r:#}"
        );
    }
    // Between the replay's rounds: allreduces at the sweep's smallest and largest sizes over
    // each replay transport, 3 repeats per round (2 rounds, 1 workload); the model and the
    // bounds use them.
    let between = run["replay_allreduce"].as_array().unwrap();
    for transport in ["tcp", "shm"] {
        let mut sizes: Vec<u64> = between
            .iter()
            .filter(|r| r["transport"] == transport)
            .map(|r| {
                assert_eq!(r["time"]["n"], 6, "{r:#}");
                r["bytes"].as_u64().unwrap()
            })
            .collect();
        sizes.sort_unstable();
        assert_eq!(sizes, [8, 4096], "{transport}: {between:#?}");
    }
    // Reported in their own table. (That calibration prefers them is a unit test: here, at
    // 8 B and 4 KiB over loopback, the larger allreduce is often the faster, and no line can
    // be fitted.)
    assert!(
        md.contains("### Allreduce between the replay's rounds"),
        "{md}"
    );
    assert!(md.contains("(replay-exposed.png)"));
    // Each replay beside its transport's own bound (bytes ÷ measured allreduce bandwidth).
    assert!(md.contains("The transport's own bound"), "{md}");
    assert!(md.contains("| resnet50 | tcp |"), "{md}");
    // On one host, the CPU of every row per step.
    assert!(
        md.contains(
            "| workload | schedule (transport) | CPU per step | of it, main threads | CPU s per GB of gradients |"
        ),
        "{md}"
    );
    assert!(md.contains("| resnet50 | fasthorovod K=4 (shm) |"), "{md}");

    // The simulation projects every schedule, link and rank count, and says it is a model.
    let sim = &run["simulation"];
    assert!(sim["note"].as_str().unwrap().contains("MODEL"));
    // 4 links × 6 schedules × 8 rank counts.
    assert_eq!(sim["rows"].as_array().unwrap().len(), 4 * 6 * 8);

    // The report links its plots, which exist.
    for stem in [
        "collectives-allreduce",
        "collectives-tcp",
        "simulate-resnet50",
    ] {
        assert!(
            md.contains(&format!("({stem}.png)")),
            "{stem} not in report.md"
        );
        assert!(out.join(format!("{stem}.png")).is_file());
        assert!(out.join(format!("{stem}.svg")).is_file());
    }
    assert!(stdout.contains("report:"), "{stdout}");
    std::fs::remove_dir_all(&out).unwrap();
}
