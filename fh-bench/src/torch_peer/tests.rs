use std::path::Path;
use std::process::Command;
use std::time::Duration;

use super::horovod::ssh_shim;
use super::output::strip_output_tag;
use super::{
    imports, parse_output, shell_word, write_script, Hosts, PeerRun, PEERS, PEERS_ACROSS_HOSTS,
    PYTHON_ENV,
};

const LINE: &str = r#"{"peer": "ddp-gloo", "workload": "resnet50", "np": 4, "backward_ms": 100.0, "warmup": 1, "steps": 2, "step_seconds": [0.25, 0.2], "tensors": 161, "bytes": 102228128, "version": "torch 2.15.0", "checked": true}"#;

#[test]
fn parses_the_result_among_warnings() {
    let text = format!("[W socket.cpp] some warning\n{LINE}\n");
    let r = parse_output(&text).unwrap();
    assert_eq!(r.peer, "ddp-gloo");
    assert_eq!((r.np, r.steps, r.tensors), (4, 2, 161));
    assert_eq!(r.step_seconds, [0.25, 0.2]);
}

#[test]
fn reads_the_streams_the_runtime_reports() {
    // fasthorovod.torch's line carries hvd.tcp_streams(): what the runtime chose and measured.
    let line = LINE.replace(
        r#""checked": true}"#,
        r#""checked": true, "tcp_streams": {"streams": 5, "setting": "auto", "one_stream_gbps": 0.46, "many_streams_gbps": 1.92, "probe_streams": 8}}"#,
    );
    let s = parse_output(&line).unwrap().tcp_streams.unwrap();
    assert_eq!((s.streams, s.setting.as_str()), (5, "auto"));
    assert_eq!(
        (s.one_stream_gbps, s.many_streams_gbps, s.probe_streams),
        (Some(0.46), Some(1.92), Some(8))
    );
    // Nothing crosses hosts (None), or a peer that does not say: no streams.
    let none = LINE.replace(
        r#""checked": true}"#,
        r#""checked": true, "tcp_streams": null}"#,
    );
    assert_eq!(parse_output(&none).unwrap().tcp_streams, None);
    assert_eq!(parse_output(LINE).unwrap().tcp_streams, None);
}

#[test]
fn parses_the_result_behind_a_launcher_tag() {
    // horovodrun (mpirun --tag-output): [job,rank]<stdout>:
    let hvd = format!(
        "[1,1]<stderr>:[W socket.cpp] warning\n[1,0]<stdout>:{}\n[1,1]<stdout>:\n",
        LINE.replace("ddp-gloo", "horovod")
    );
    let r = parse_output(&hvd).unwrap();
    assert_eq!((r.peer.as_str(), r.np, r.steps), ("horovod", 4, 2));
    // fhrun: [rank]<stdout>:
    let fh = format!(
        "[1]<stdout>:starting\n[0]<stdout>:{}\n",
        LINE.replace("ddp-gloo", "fasthorovod-torch")
    );
    assert_eq!(parse_output(&fh).unwrap().peer, "fasthorovod-torch");
    // mpirun may glue the next tag behind the line (seen with horovodrun -np 4).
    let glued = format!(
        "[1,0]<stdout>:{}[1,0]<stdout>:\n",
        LINE.replace("ddp-gloo", "horovod")
    );
    assert_eq!(parse_output(&glued).unwrap().peer, "horovod");
    assert_eq!(strip_output_tag("[0]<stdout>:  {\"a\": 1}"), "{\"a\": 1}");
    assert_eq!(strip_output_tag("[1,0]<stderr>:x"), "x");
    // Not a tag: left alone.
    assert_eq!(strip_output_tag("[W socket.cpp] x"), "[W socket.cpp] x");
    assert_eq!(strip_output_tag("[0]stdout:x"), "[0]stdout:x");
    assert_eq!(strip_output_tag("[]<stdout>:x"), "[]<stdout>:x");
    assert_eq!(strip_output_tag("[0"), "[0");
    // A tagged line that is not the result still fails with the tail of the output.
    let e = parse_output("[1,0]<stdout>:Traceback\n[1,0]<stderr>:boom\n").unwrap_err();
    assert!(e.contains("no result line") && e.contains("boom"), "{e}");
    // A broken JSON behind a tag is reported as such.
    let bad = parse_output("[1,0]<stdout>:{\"peer\": \"horovod\"\n").unwrap_err();
    assert!(bad.contains("bad result line"), "{bad}");
}

#[test]
fn rejects_missing_or_inconsistent_results() {
    let e = parse_output("Traceback ...\nRuntimeError: gloo timeout\n").unwrap_err();
    assert!(
        e.contains("no result line") && e.contains("gloo timeout"),
        "{e}"
    );
    let short = LINE.replace("[0.25, 0.2]", "[0.25]");
    assert!(parse_output(&short).unwrap_err().contains("1 step times"));
    let zero = LINE.replace("[0.25, 0.2]", "[0.25, 0.0]");
    assert!(parse_output(&zero).unwrap_err().contains("impossible"));
    let unchecked = LINE.replace("\"checked\": true", "\"checked\": false");
    assert!(parse_output(&unchecked)
        .unwrap_err()
        .contains("not checked"));
    let negative_cpu = LINE.replace(
        r#""checked": true}"#,
        r#""checked": true, "cpu_seconds": -1.5}"#,
    );
    assert!(parse_output(&negative_cpu)
        .unwrap_err()
        .contains("impossible CPU time -1.5"));
    let negative_main = LINE.replace(
        r#""checked": true}"#,
        r#""checked": true, "cpu_seconds": 1.0, "main_thread_cpu_seconds": -0.5}"#,
    );
    assert!(parse_output(&negative_main)
        .unwrap_err()
        .contains("impossible main-thread CPU time -0.5"));
}

#[test]
fn reads_the_cpu_time_of_all_ranks() {
    // The adapter sums every rank's process CPU time over the timed steps.
    let line = LINE.replace(
        r#""checked": true}"#,
        r#""checked": true, "cpu_seconds": 0.75}"#,
    );
    assert_eq!(parse_output(&line).unwrap().cpu_seconds, Some(0.75));
    // An adapter that does not say: unknown, not zero.
    assert_eq!(parse_output(LINE).unwrap().cpu_seconds, None);
    // And of it, the ranks' main threads (the training loops).
    let line = LINE.replace(
        r#""checked": true}"#,
        r#""checked": true, "cpu_seconds": 0.75, "main_thread_cpu_seconds": 0.25}"#,
    );
    let r = parse_output(&line).unwrap();
    assert_eq!(
        (r.cpu_seconds, r.main_thread_cpu_seconds),
        (Some(0.75), Some(0.25))
    );
    assert_eq!(parse_output(LINE).unwrap().main_thread_cpu_seconds, None);
}

#[test]
fn skip_reason_says_how_to_install() {
    let r = PEERS[0].not_installed("python3");
    assert!(
        r.starts_with("skipped: not installed (pip install torch"),
        "{r}"
    );
    assert!(r.contains("import torch") && r.contains(PYTHON_ENV), "{r}");
    assert!(PEERS[3].not_installed("py").contains("horovod"));
    assert!(PEERS[3].not_installed("py").contains("cargo xtask horovod"));
    assert!(PEERS[6]
        .not_installed("py")
        .contains("import fasthorovod.torch"));
    assert!(PEERS[1]
        .not_installed("py")
        .contains("import fasthorovod.torch.distributed"));
    // Every peer's rows are told apart by label and transport.
    for (i, a) in PEERS.iter().enumerate() {
        for b in &PEERS[i + 1..] {
            assert!(
                (a.label, a.transport) != (b.label, b.transport),
                "{a:?} {b:?}"
            );
        }
    }
    assert!(!imports(
        "python3",
        "fh_bench_no_such_module_xyz",
        Duration::from_secs(30)
    ));
    assert!(!imports(
        "/nonexistent/python",
        "sys",
        Duration::from_secs(30)
    ));
}

#[test]
fn hosts_are_parsed_and_filled_in_order() {
    let h = Hosts::parse("h0:2, h1:2", "agent".into(), "fhrun".into()).unwrap();
    assert_eq!(h.slots(), 4);
    // Ranks 0, 1 on h0 and 2, 3 on h1, each with its local rank and the host's size.
    assert_eq!(
        h.placement(),
        [("h0", 0, 2), ("h0", 1, 2), ("h1", 0, 2), ("h1", 1, 2)]
    );
    let one = Hosts::parse("a,b:3", "ssh".into(), "fhrun".into()).unwrap();
    assert_eq!(one.list, [("a".to_string(), 1), ("b".to_string(), 3)]);
    for bad in ["h0:0", "h0:x", "", " , "] {
        assert!(
            Hosts::parse(bad, "ssh".into(), "fhrun".into()).is_err(),
            "{bad:?}"
        );
    }
}

#[test]
fn shell_words_survive_sh() {
    assert_eq!(shell_word("/a/b.py"), "/a/b.py");
    assert_eq!(shell_word("MASTER_ADDR=h0"), "MASTER_ADDR=h0");
    assert_eq!(shell_word("a b"), "'a b'");
    assert_eq!(shell_word(""), "''");
    // A quote inside: closed, escaped, reopened; sh gives the word back.
    let w = shell_word("it's $HOME");
    let out = Command::new("sh")
        .args(["-c", &format!("printf %s {w}")])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "it's $HOME");
}

#[test]
fn across_hosts_the_slots_must_match_the_ranks() {
    let hosts = Hosts::parse("h0:2,h1:1", "agent".into(), "fhrun".into()).unwrap();
    let dir = std::env::temp_dir().join(format!("fh-bench-slots-{}", std::process::id()));
    let run = PeerRun {
        peer: PEERS_ACROSS_HOSTS[0],
        python: "python3",
        script: Path::new("x.py"),
        workload: Path::new("w.json"),
        np: 4,
        backward_ms: 100.0,
        warmup: 1,
        steps: 1,
        log_dir: &dir,
        timeout: Duration::from_secs(5),
        hosts: Some(&hosts),
    };
    let e = run.run("slots").unwrap_err();
    assert!(e.contains("3 slots for --np 4"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
    // Across hosts, fasthorovod.torch runs over hier and tcp, never shm.
    let t: Vec<&str> = PEERS_ACROSS_HOSTS.iter().map(|p| p.transport).collect();
    assert_eq!(t, ["gloo", "gloo", "mpi", "mpi-busy", "hier", "tcp"]);
}

#[test]
fn the_adapter_is_valid_python() {
    let dir = std::env::temp_dir().join(format!("fh-bench-pycompile-{}", std::process::id()));
    let script = write_script(&dir).unwrap();
    let available = Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if available {
        let out = Command::new("python3")
            .args(["-m", "py_compile"])
            .arg(&script)
            .env("PYTHONPYCACHEPREFIX", dir.join("pycache"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    } else {
        eprintln!("python3 not found: syntax check of torch_replay.py skipped");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn horovod_runs_in_each_controller_mode() {
    let hvd: Vec<_> = PEERS.iter().filter(|p| p.mode == "horovod").collect();
    let args: Vec<Vec<String>> = hvd
        .iter()
        .map(|p| p.horovodrun_args(4, "h0:2,h1:2", Some("eth0")))
        .collect();
    let head = ["-np", "4", "-H", "h0:2,h1:2"];
    assert_eq!(
        args[0],
        [&head[..], &["--gloo", "--network-interfaces", "eth0"]].concat()
    );
    assert_eq!(
        args[1],
        [
            &head[..],
            &[
                "--mpi",
                "--mpi-args=--mca mpi_yield_when_idle 1",
                "--network-interfaces",
                "eth0"
            ]
        ]
        .concat()
    );
    assert_eq!(args[2][5], "--mpi-args=--mca mpi_yield_when_idle 0");
    assert_eq!(hvd[0].horovodrun_args(2, "localhost:2", None).len(), 5);
    // The Horovod rows run under FH_BENCH_HOROVOD_PYTHON only when it is set; the others never.
    assert_eq!(PEERS[0].python("py"), "py");
}

#[test]
fn the_ssh_shim_drops_options_and_calls_the_agent() {
    let dir = std::env::temp_dir().join(format!("fh-bench-ssh-shim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // An "agent" that prints what it was given, one word a line.
    let agent = dir.join("agent");
    std::fs::write(&agent, "#!/bin/sh\nfor a in \"$@\"; do echo \"$a\"; done\n").unwrap();
    let shim = dir.join("ssh");
    std::fs::write(&shim, ssh_shim(&agent.display().to_string())).unwrap();
    for p in [&agent, &shim] {
        Command::new("chmod").arg("+x").arg(p).status().unwrap();
    }
    // As horovod/runner/util/remote.py writes it (empty port and identity words vanish).
    let out = Command::new(&shim)
        .args([
            "-o",
            "PasswordAuthentication=no",
            "-o",
            "StrictHostKeyChecking=no",
            "h1",
            "-o",
            "ConnectTimeout=10",
            "cd /x > /dev/null 2>&1 ; env A=1 python y.py",
        ])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "h1\ncd /x > /dev/null 2>&1 ; env A=1 python y.py\n"
    );
    let out = Command::new(&shim)
        .args(["-p", "22", "h0", "true"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "h0\ntrue\n");
    std::fs::remove_dir_all(&dir).unwrap();
}
