//! Ranks as processes: this test binary re-runs itself, one process per rank, with the
//! environment a launcher gives, and collects each rank's exit and output.

use std::io::Read;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Children killed and reaped when dropped (a failed assertion leaves nothing behind).
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Run `size` ranks, each as `<this test binary> <child_test> --exact --ignored --nocapture`
/// on 127.0.0.1 with a fresh port and token, plus `env`; returns each rank's exit success and
/// output (stdout then stderr). Panics if the ranks do not all finish within `limit`.
pub fn run_ranks(
    size: usize,
    child_test: &str,
    env: &[(&str, &str)],
    limit: Duration,
) -> Vec<(bool, String)> {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("an ephemeral port");
    let token = format!(
        "tok-5f1d0c3a-{:032x}",
        (u128::from(std::process::id()) << 64) | u128::from(port) << 16 | 0xbeef
    );
    let exe = std::env::current_exe().expect("current exe");
    let mut kids = Children(Vec::new());
    for rank in 0..size {
        let mut cmd = Command::new(&exe);
        cmd.args([
            child_test,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .envs({
            let mut info = fh_job::LaunchInfo::for_rank(
                fh_job::Topology::single_host(rank, size),
                format!("127.0.0.1:{port}"),
                fh_job::JobToken::new(token.clone()),
            );
            info.timeout = Duration::from_secs(20);
            info.to_vars()
        })
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        kids.0.push(cmd.spawn().expect("spawn a rank"));
    }
    let deadline = Instant::now() + limit;
    let mut status = vec![None; size];
    while status.iter().any(Option::is_none) {
        for (i, c) in kids.0.iter_mut().enumerate() {
            if status[i].is_none() {
                if let Ok(Some(s)) = c.try_wait() {
                    status[i] = Some(s.success());
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "ranks did not finish within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    kids.0
        .iter_mut()
        .zip(status)
        .map(|(c, ok)| {
            let mut out = String::new();
            if let Some(mut s) = c.stdout.take() {
                let _ = s.read_to_string(&mut out);
            }
            if let Some(mut s) = c.stderr.take() {
                let _ = s.read_to_string(&mut out);
            }
            (ok.unwrap_or(false), out)
        })
        .collect()
}

/// The text after `RESULT ` on a rank's output line.
pub fn result_line(out: &str) -> &str {
    out.lines()
        .find_map(|l| l.find("RESULT ").map(|i| &l[i + 7..]))
        .unwrap_or_else(|| panic!("no RESULT line in:\n{out}"))
}
