//! The link probe: how fast one and several parallel TCP streams go from one emulated host to
//! another (under a per-flow cap, one stream gets the cap and several the link).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::Cluster;

/// The stream counts [`Cluster::link_rates`] measures by default: one, and enough to fill a
/// link whose flows are capped at a quarter of it or more.
pub(crate) const STREAMS: [usize; 2] = [1, 8];

/// Which end of the probe's connections opens them (a per-flow cap must hold for the data of
/// either).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Opener {
    /// The sender connects to the receiver (the usual probe).
    Sender,
    /// The receiver connects to the sender, which sends on the connections it accepted (the
    /// cluster's tests check the cap holds there too; the reports measure the usual way).
    #[cfg_attr(not(test), allow(dead_code))]
    Receiver,
}

/// The hidden `cargo xtask __link-probe` that [`Cluster::link_rate`] runs inside the hosts:
/// `recv ADDR:PORT [N]` accepts N connections (default 1), reads them to the end and prints
/// `BYTES SECONDS` (all connections together, from the first byte to the last end);
/// `send ADDR:PORT SECONDS [N]` sends over N parallel TCP streams, as fast as each goes, for
/// that long. `recv-dial` and `send-listen` do the same with the receiver connecting to the
/// sender.
pub(crate) fn link_probe(args: &[String]) -> ExitCode {
    let fail = |e: String| {
        eprintln!("link probe: {e}");
        ExitCode::FAILURE
    };
    let streams = |n: Option<&String>| -> Result<usize, String> {
        match n {
            None => Ok(1),
            Some(n) => n
                .parse::<usize>()
                .ok()
                .filter(|&n| (1..=256).contains(&n))
                .ok_or(format!("not a number of streams (1 to 256): {n}")),
        }
    };
    match args {
        [role, addr, rest @ ..] if (role == "recv" || role == "recv-dial") && rest.len() <= 1 => {
            let n = match streams(rest.first()) {
                Ok(n) => n,
                Err(e) => return fail(e),
            };
            match receive(addr, n, role == "recv-dial") {
                Ok((bytes, secs)) => {
                    println!("{bytes} {secs}");
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            }
        }
        [role, addr, secs, rest @ ..]
            if (role == "send" || role == "send-listen") && rest.len() <= 1 =>
        {
            let Ok(secs) = secs.parse::<f64>() else {
                return fail(format!("not seconds: {secs}"));
            };
            let n = match streams(rest.first()) {
                Ok(n) => n,
                Err(e) => return fail(e),
            };
            match send(addr, secs, n, role == "send-listen") {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail(e),
            }
        }
        _ => fail(
            "usage: __link-probe recv|recv-dial ADDR:PORT [STREAMS] | send|send-listen ADDR:PORT \
             SECONDS [STREAMS]"
                .into(),
        ),
    }
}

/// `n` connections to or from `addr`: accepted on it (saying `listening` first), or with
/// `dial` made to it.
fn connections(addr: &str, n: usize, dial: bool) -> Result<Vec<TcpStream>, String> {
    if dial {
        return (0..n)
            .map(|_| TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}")))
            .collect();
    }
    let l = TcpListener::bind(addr).map_err(|e| format!("bind {addr}: {e}"))?;
    println!("listening");
    let _ = std::io::stdout().flush();
    (0..n)
        .map(|_| {
            l.accept()
                .map(|(s, _)| s)
                .map_err(|e| format!("accept: {e}"))
        })
        .collect()
}

/// Reads `n` connections (see [`connections`]) each to its end: the bytes, and the seconds
/// from the first byte on any of them to the end of the last.
fn receive(addr: &str, n: usize, dial: bool) -> Result<(u64, f64), String> {
    let first: Arc<Mutex<Option<Instant>>> = Arc::default();
    let mut readers = Vec::new();
    for mut s in connections(addr, n, dial)? {
        let first = first.clone();
        readers.push(std::thread::spawn(move || -> Result<u64, String> {
            let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
            let mut buf = vec![0u8; 1 << 20];
            let mut got = 0u64;
            loop {
                match s.read(&mut buf) {
                    Ok(0) => return Ok(got),
                    Ok(k) => {
                        if got == 0 {
                            let mut f = first.lock().unwrap_or_else(|p| p.into_inner());
                            f.get_or_insert_with(Instant::now);
                        }
                        got += k as u64;
                    }
                    Err(e) => return Err(format!("read: {e}")),
                }
            }
        }));
    }
    let mut bytes = 0;
    for r in readers {
        bytes += r.join().map_err(|_| "a reader panicked".to_string())??;
    }
    let first = *first.lock().unwrap_or_else(|p| p.into_inner());
    Ok((bytes, first.map_or(0.0, |t| t.elapsed().as_secs_f64())))
}

/// Sends over `n` connections (see [`connections`]; made to `addr` unless `listen`) for
/// `secs` seconds, as fast as each goes.
fn send(addr: &str, secs: f64, n: usize, listen: bool) -> Result<(), String> {
    let writers: Vec<_> = connections(addr, n, !listen)?
        .into_iter()
        .map(|mut s| {
            std::thread::spawn(move || -> Result<(), String> {
                let buf = vec![0x5au8; 1 << 20];
                let t = Instant::now();
                while t.elapsed().as_secs_f64() < secs {
                    s.write_all(&buf).map_err(|e| format!("write: {e}"))?;
                }
                Ok(())
            })
        })
        .collect();
    for w in writers {
        w.join().map_err(|_| "a writer panicked".to_string())??;
    }
    Ok(())
}

impl Cluster {
    /// The rate `streams` parallel TCP streams reach together from host `from` to host `to`
    /// in `secs` seconds, in bits per second, over connections opened by `opener`:
    /// [`link_probe`] on both ends, run as this executable with the arguments `probe` adds to
    /// a command (`__link-probe` and the probe's own arguments, for xtask).
    pub(crate) fn link_rate(
        &self,
        (from, to): (usize, usize),
        secs: f64,
        streams: usize,
        opener: Opener,
        probe: &dyn Fn(&mut Command, &[&str]),
    ) -> Result<f64, String> {
        let exe = std::env::current_exe().map_err(|e| format!("cannot find xtask: {e}"))?;
        let n = streams.to_string();
        let secs = secs.to_string();
        // The listening end starts first and says so; the other connects to it.
        let (listener, dialer, addr) = match opener {
            Opener::Sender => (to, from, format!("{}:5201", self.hosts[to].addr)),
            Opener::Receiver => (from, to, format!("{}:5201", self.hosts[from].addr)),
        };
        let (listen_args, dial_args): (Vec<&str>, Vec<&str>) = match opener {
            Opener::Sender => (vec!["recv", &addr, &n], vec!["send", &addr, &secs, &n]),
            Opener::Receiver => (
                vec!["send-listen", &addr, &secs, &n],
                vec!["recv-dial", &addr, &n],
            ),
        };
        let mut first = self.command(listener, &exe);
        probe(&mut first, &listen_args);
        let mut first = first
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start the link probe: {e}"))?;
        let mut out = std::io::BufReader::new(first.stdout.take().expect("piped"));
        // Lines until the one asked for (a test harness may print its own around them).
        let next_line = |out: &mut dyn std::io::BufRead, want: &dyn Fn(&str) -> bool| {
            let mut line = String::new();
            loop {
                line.clear();
                match out.read_line(&mut line) {
                    Ok(0) | Err(_) => return None,
                    Ok(_) if want(line.trim()) => return Some(line.trim().to_string()),
                    Ok(_) => {}
                }
            }
        };
        let two_numbers = |l: &str| {
            let w: Vec<&str> = l.split_whitespace().collect();
            w.len() == 2 && w.iter().all(|x| x.parse::<f64>().is_ok())
        };
        if next_line(&mut out, &|l| l == "listening").is_none() {
            let _ = first.kill();
            let _ = first.wait();
            return Err("the link probe's listening end did not start".into());
        }
        let mut second = self.command(dialer, &exe);
        probe(&mut second, &dial_args);
        let said = match opener {
            Opener::Sender => {
                let sent = second.stdout(Stdio::null()).status();
                let said = match sent {
                    Ok(s) if s.success() => next_line(&mut out, &two_numbers),
                    _ => None,
                };
                said.ok_or(format!("the link probe's sender failed: {sent:?}"))
            }
            Opener::Receiver => {
                let got = second.stderr(Stdio::inherit()).output();
                match &got {
                    Ok(o) if o.status.success() => {
                        let text = String::from_utf8_lossy(&o.stdout).to_string();
                        next_line(&mut text.as_bytes(), &two_numbers)
                            .ok_or(format!("the link probe's receiver said {text:?}"))
                    }
                    _ => Err(format!("the link probe's receiver failed: {got:?}")),
                }
            }
        };
        let _ = first.kill();
        let _ = first.wait();
        let said = said?;
        let mut it = said.split_whitespace().map(str::parse::<f64>);
        match (it.next(), it.next()) {
            (Some(Ok(bytes)), Some(Ok(took))) if took > 0.0 => Ok(bytes * 8.0 / took),
            _ => Err(format!("the link probe said {said:?}")),
        }
    }

    /// [`Cluster::link_rate`] for each count in `streams`, one after the other, `secs`
    /// seconds each: `(streams, bits per second)`.
    pub(crate) fn link_rates(
        &self,
        from: usize,
        to: usize,
        secs: f64,
        streams: &[usize],
        probe: &dyn Fn(&mut Command, &[&str]),
    ) -> Result<Vec<(usize, f64)>, String> {
        streams
            .iter()
            .map(|&n| {
                Ok((
                    n,
                    self.link_rate((from, to), secs, n, Opener::Sender, probe)?,
                ))
            })
            .collect()
    }
}

/// The probe's figures for a report: `1 stream 0.478, 8 streams 1.913 Gbit/s`.
pub(crate) fn show_rates(rates: &[(usize, f64)]) -> String {
    let parts: Vec<String> = rates
        .iter()
        .map(|(n, r)| {
            format!(
                "{n} stream{} {:.3}",
                if *n == 1 { "" } else { "s" },
                r / 1e9
            )
        })
        .collect();
    format!("{} Gbit/s", parts.join(", "))
}

/// The rate the link allows: the best of the measured stream counts (the many-stream rate
/// when a per-flow cap binds, and about the one-stream rate when none does).
pub(crate) fn link_bound_rate(rates: &[(usize, f64)]) -> f64 {
    rates.iter().map(|r| r.1).fold(0.0, f64::max)
}
