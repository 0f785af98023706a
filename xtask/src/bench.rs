//! `cargo xtask bench`: build `fh-bench` in release mode and run its suite; with
//! `--emulate HxR [--link RATE [--flow RATE]]`, on an emulated cluster of H hosts with R ranks
//! each ([`crate::cluster`]; `--flow` caps every TCP connection, as clouds do), after measuring
//! the rate one and eight parallel TCP streams reach across its link.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use crate::cargo;
use crate::cluster::{link_bound_rate, show_rates, Shaping, STREAMS};

/// `--emulate HxR`, `--link RATE`, `--flow RATE` and `--rtt TIME`, taken out of the
/// arguments.
struct Emulate {
    hosts: usize,
    ranks: usize,
    shaping: Shaping,
}

/// Takes `--emulate HxR`, `--link RATE`, `--flow RATE` and `--rtt TIME` out of `args`.
fn take_emulate(args: &[String]) -> Result<(Option<Emulate>, Vec<String>), String> {
    let mut rest = Vec::new();
    let (mut layout, mut link, mut flow, mut rtt) = (None, None, None, None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--emulate" => layout = Some(it.next().ok_or("--emulate wants HOSTSxRANKS, e.g. 2x2")?),
            "--link" => link = Some(it.next().ok_or("--link wants a rate, e.g. 1gbit")?.clone()),
            "--flow" => {
                flow = Some(
                    it.next()
                        .ok_or("--flow wants a rate, e.g. 500mbit")?
                        .clone(),
                )
            }
            "--rtt" => rtt = Some(it.next().ok_or("--rtt wants a time, e.g. 1ms")?.clone()),
            _ => rest.push(a.clone()),
        }
    }
    let Some(layout) = layout else {
        return match (&link, &flow, &rtt) {
            (None, None, None) => Ok((None, rest)),
            _ => Err("--link, --flow and --rtt need --emulate HOSTSxRANKS".into()),
        };
    };
    let shaping = Shaping::new(link.as_deref(), flow.as_deref())?.with_rtt(rtt.as_deref())?;
    let parsed = layout
        .split_once('x')
        .and_then(|(h, r)| Some((h.parse::<usize>().ok()?, r.parse::<usize>().ok()?)))
        .filter(|&(h, r)| h >= 2 && r >= 1);
    match parsed {
        Some((hosts, ranks)) => Ok((
            Some(Emulate {
                hosts,
                ranks,
                shaping,
            }),
            rest,
        )),
        None => Err(format!(
            "--emulate {layout}: expected HOSTSxRANKS with at least 2 hosts, e.g. 2x2"
        )),
    }
}

pub(crate) fn run(root: &Path, args: &[String]) -> ExitCode {
    if args.iter().any(|a| a == "-h" || a == "--help") {
        eprintln!(
            "cargo xtask bench [--emulate HOSTSxRANKS [--link RATE [--flow RATE]] [--rtt TIME]] \
             ARGS: builds fh-bench (release) and runs `fh-bench suite ARGS` (with --emulate: on \
             an emulated cluster, as root, each TCP connection capped at the --flow rate when \
             given, the round trip between hosts raised by --rtt (e.g. 1ms), \
             through mpirun with --hosts h0:R,h1:R,... and --link-gbps MEASURED (the best of 1 \
             and 8 parallel TCP streams); default \
             --transports hier,tcp; the Python peers across the hosts, fasthorovod.torch through \
             fhrun -H and the cluster's rsh agent, DDP through the agent with MASTER_ADDR h0):\n"
        );
    }
    let (emulate, args) = match take_emulate(args) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("xtask bench: {e}");
            return ExitCode::from(2);
        }
    };
    let args = &args[..];
    if args.first().is_some_and(|a| a == "synthetic") {
        return synthetic(root, emulate.as_ref(), &args[1..]);
    }
    let target_dir: PathBuf = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    // Across hosts, fhrun starts the fasthorovod.torch peer's ranks.
    let packages: &[&str] = if emulate.is_some() {
        &["-p", "fh-bench", "-p", "fh-launch"]
    } else {
        &["-p", "fh-bench"]
    };
    eprintln!("==> cargo build --release {}", packages.join(" "));
    let built = Command::new(cargo())
        .current_dir(root)
        .args(["build", "--release"])
        .args(packages)
        .status();
    match built {
        Ok(s) if s.success() => {}
        Ok(s) => {
            eprintln!("xtask bench: building fh-bench failed ({s})");
            return ExitCode::FAILURE;
        }
        Err(e) => {
            eprintln!("xtask bench: could not run cargo: {e}");
            return ExitCode::FAILURE;
        }
    }
    let exe = target_dir.join("release").join("fh-bench");
    let (cluster, measured) = match &emulate {
        None => (None, None),
        Some(e) => match emulated(e) {
            Ok((c, rates)) => (Some(c), Some(rates)),
            Err(why) => {
                eprintln!("xtask bench: --emulate: {why}");
                return ExitCode::FAILURE;
            }
        },
    };
    let mut cmd = match &cluster {
        None => Command::new(&exe),
        Some(c) => c.command(0, &exe),
    };
    cmd.current_dir(root)
        .arg("suite")
        .args(args)
        .env("FH_BENCH_TARGET_DIR", &target_dir);
    if let (Some(c), Some(e)) = (&cluster, &emulate) {
        let hosts: Vec<String> = (0..e.hosts).map(|h| format!("h{h}:{}", e.ranks)).collect();
        cmd.args(["--hosts", &hosts.join(",")])
            .args(["--np", &(e.hosts * e.ranks).to_string()]);
        if !args.iter().any(|a| a.starts_with("--transports")) {
            cmd.args(["--transports", "hier,tcp"]);
        }
        if let Some(rates) = &measured {
            cmd.args([
                "--link-gbps",
                &format!("{:.4}", link_bound_rate(rates) / 1e9),
            ]);
            // One stream's rate: the model's per-flow cap.
            if let Some((_, one)) = rates.iter().find(|r| r.0 == 1) {
                cmd.args(["--flow-gbps", &format!("{:.4}", one / 1e9)]);
            }
        }
        cmd.env("FH_BENCH_FHRUN", target_dir.join("release").join("fhrun"));
        match c.rsh_agent() {
            Ok(agent) => {
                cmd.env("OMPI_MCA_plm_rsh_agent", &agent)
                    .env("FH_RSH_AGENT", &agent);
            }
            Err(why) => {
                eprintln!("xtask bench: --emulate: {why}");
                return ExitCode::FAILURE;
            }
        }
    }
    // The Python peers (PyTorch DDP, Horovod, fasthorovod.torch) run under the project's
    // environment when `cargo xtask test` has made one, unless FH_BENCH_PYTHON names another.
    let venv_python = crate::python::python(root);
    if std::env::var_os("FH_BENCH_PYTHON").is_none() && venv_python.is_file() {
        eprintln!(
            "==> Python peers under {} (FH_BENCH_PYTHON overrides)",
            venv_python.display()
        );
        cmd.env("FH_BENCH_PYTHON", &venv_python);
    }
    // Horovod's rows run under target/hvd-venv when `cargo xtask horovod` has built it there;
    // across emulated hosts over their `eth0`.
    let hvd_python = crate::horovod::python(root);
    if std::env::var_os("FH_BENCH_HOROVOD_PYTHON").is_none() {
        if hvd_python.is_file() {
            eprintln!(
                "==> Horovod peer under {} (FH_BENCH_HOROVOD_PYTHON overrides)",
                hvd_python.display()
            );
            cmd.env("FH_BENCH_HOROVOD_PYTHON", &hvd_python);
        } else {
            eprintln!("==> no target/hvd-venv: `cargo xtask horovod` builds Horovod for its rows");
        }
    }
    if emulate.is_some() && std::env::var_os("FH_BENCH_HOROVOD_NICS").is_none() {
        cmd.env("FH_BENCH_HOROVOD_NICS", "eth0");
    }
    let status = cmd.status();
    if let (Some(e), Some(rates)) = (&emulate, &measured) {
        let text = link_table(root, args, e, rates);
        eprintln!("\n{text}");
        if let Some(out) = arg_value(args, "--out") {
            let report = root.join(out).join("report.md");
            let appended = std::fs::OpenOptions::new()
                .append(true)
                .open(&report)
                .and_then(|mut f| {
                    std::io::Write::write_all(&mut f, format!("\n{text}").as_bytes())
                });
            if let Err(why) = appended {
                eprintln!(
                    "xtask bench: cannot add the link table to {}: {why}",
                    report.display()
                );
            }
        }
    }
    drop(cluster);
    match status {
        Ok(s) if s.success() => ExitCode::SUCCESS,
        Ok(s) => {
            eprintln!("xtask bench: fh-bench {s}");
            ExitCode::from(s.code().and_then(|c| u8::try_from(c).ok()).unwrap_or(1))
        }
        Err(e) => {
            eprintln!("xtask bench: could not start {}: {e}", exe.display());
            ExitCode::FAILURE
        }
    }
}

/// `synthetic [OPTIONS]` after `--emulate`: builds fhrun, brings up the cluster and runs
/// [`crate::synthetic`] on it.
fn synthetic(root: &Path, emulate: Option<&Emulate>, args: &[String]) -> ExitCode {
    let (e, o) = match (emulate, crate::synthetic::parse(args)) {
        (Some(e), Ok(o)) => (e, o),
        (None, _) => {
            eprintln!(
                "xtask bench synthetic: runs across emulated hosts only: give --emulate HxR\n\
                 usage: {}",
                crate::synthetic::USAGE
            );
            return ExitCode::from(2);
        }
        (_, Err(why)) => {
            eprintln!("xtask bench synthetic: {why}");
            return ExitCode::from(2);
        }
    };
    eprintln!("==> cargo build --release -p fh-launch");
    let built = Command::new(cargo())
        .current_dir(root)
        .args(["build", "--release", "-p", "fh-launch"])
        .status();
    if !built.is_ok_and(|s| s.success()) {
        eprintln!("xtask bench synthetic: building fhrun failed");
        return ExitCode::FAILURE;
    }
    let fhrun = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
        .join("release")
        .join("fhrun");
    let cluster = match emulated(e) {
        Ok((c, _)) => c,
        Err(why) => {
            eprintln!("xtask bench synthetic: --emulate: {why}");
            return ExitCode::FAILURE;
        }
    };
    let code = crate::synthetic::run(root, &cluster, &fhrun, e.hosts, e.ranks, &o);
    if let Err(why) = cluster.down() {
        eprintln!("xtask bench synthetic: {why}");
    }
    code
}

/// Brings up the emulated cluster and says what it is: the layout, the links' shaping and the
/// rates of 1 and 8 parallel TCP streams measured across a link (h0 → h1, 2 s each).
fn emulated(e: &Emulate) -> Result<(crate::cluster::Cluster, Vec<(usize, f64)>), String> {
    let c = crate::cluster::Cluster::up(e.hosts, &e.shaping)?;
    let rates = c.link_rates(0, 1, 2.0, &STREAMS, &|c: &mut Command, a: &[&str]| {
        c.arg("__link-probe").args(a);
    })?;
    eprintln!(
        "==> emulated cluster: {} hosts x {} ranks (h0..h{}), {}; TCP h0 -> h1 measured: {}",
        e.hosts,
        e.ranks,
        e.hosts - 1,
        e.shaping.describe(),
        show_rates(&rates)
    );
    Ok((c, rates))
}

/// The value after `name` in `args` (`--name VALUE` or `--name=VALUE`).
fn arg_value<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let eq = format!("{name}=");
    args.iter().enumerate().find_map(|(i, a)| {
        if a == name {
            args.get(i + 1).map(String::as_str)
        } else {
            a.strip_prefix(&eq)
        }
    })
}

/// A model's gradient bytes per step: `parameters_total` of its workload file × 4 (float32).
fn gradient_bytes(root: &Path, model: &str) -> Option<f64> {
    let text = std::fs::read_to_string(
        root.join("fh-bench")
            .join("workloads")
            .join(format!("{model}.json")),
    )
    .ok()?;
    if !text.contains("\"dtype\": \"float32\"") {
        return None;
    }
    let at = text.find("\"parameters_total\":")? + "\"parameters_total\":".len();
    let digits: String = text[at..]
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    Some(digits.parse::<f64>().ok()? * 4.0)
}

/// What must cross each host's link per step, per direction, and the exposed time that implies
/// at the measured rate (bytes ÷ rate − backward, the backward hiding the rest at best):
/// hierarchical allreduce (a ring among the hosts, each host's share reduced within it first)
/// sends 2(H−1)/H of the gradients out of each host; a flat ring over all N ranks, hosts taken
/// one after the other, crosses each host's link in each direction on one ring edge, which
/// carries 2(N−1)/N of the gradients.
fn link_table(root: &Path, args: &[String], e: &Emulate, rates: &[(usize, f64)]) -> String {
    let rate = link_bound_rate(rates);
    let backward_ms: f64 = arg_value(args, "--backward-ms")
        .and_then(|v| v.parse().ok())
        .unwrap_or(100.0);
    let models: Vec<String> = match arg_value(args, "--models") {
        Some(m) => m.split(',').map(str::to_string).collect(),
        None => ["resnet50", "bert-base"].map(String::from).to_vec(),
    };
    let (h, n) = (e.hosts as f64, (e.hosts * e.ranks) as f64);
    let mut t = format!(
        "## Across the emulated link\n\n{} hosts x {} ranks, {}; TCP measured across a link: \
         {}, the link rate taken as {:.3} Gbit/s (the best of them); backward {backward_ms} ms. \
         Bytes per step across each host's link, per direction, and the link bound (those bytes \
         at the measured link rate, minus the backward):\n\n| workload | gradients | hier: \
         bytes | hier: bound | flat ring: bytes | flat ring: bound |\n|---|---|---|---|---|---|\n",
        e.hosts,
        e.ranks,
        e.shaping.describe(),
        show_rates(rates),
        rate / 1e9
    );
    for m in &models {
        let Some(s) = gradient_bytes(root, m) else {
            t += &format!("| {m} | (no float32 workload file) | | | | |\n");
            continue;
        };
        let hier = 2.0 * (h - 1.0) / h * s;
        let ring = 2.0 * (n - 1.0) / n * s;
        let bound = |b: f64| (b * 8.0 / rate * 1e3 - backward_ms).max(0.0);
        t += &format!(
            "| {m} | {:.1} MB | {:.1} MB | {:.0} ms | {:.1} MB | {:.0} ms |\n",
            s / 1e6,
            hier / 1e6,
            bound(hier),
            ring / 1e6,
            bound(ring)
        );
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn emulate_and_link_are_taken_out() {
        let (e, rest) = take_emulate(&args(&[
            "--quick",
            "--emulate",
            "2x3",
            "--link",
            "1gbit",
            "--flow",
            "250mbit",
            "--rtt",
            "1ms",
            "replay",
        ]))
        .unwrap();
        let e = e.unwrap();
        assert_eq!((e.hosts, e.ranks), (2, 3));
        assert_eq!(
            e.shaping,
            Shaping::new(Some("1gbit"), Some("250mbit"))
                .unwrap()
                .with_rtt(Some("1ms"))
                .unwrap()
        );
        assert_eq!(rest, ["--quick", "replay"]);
        let (e, rest) = take_emulate(&args(&["--quick"])).unwrap();
        assert!(e.is_none());
        assert_eq!(rest, ["--quick"]);
    }

    #[test]
    fn the_link_table_counts_what_crosses() {
        let root = crate::project_root();
        let e = Emulate {
            hosts: 2,
            ranks: 2,
            shaping: Shaping::link("1gbit").unwrap(),
        };
        // ResNet-50: 25,557,032 float32 parameters = 102.228128 MB. Two hosts: hierarchical
        // sends all of it out of each host (2·1/2), a ring of 4 sends 1.5 times it (2·3/4); at
        // 1 Gbit/s that is 817.8 ms and 1226.7 ms, less the 100 ms backward.
        // The bound is at the best measured rate: 8 streams, when a per-flow cap binds.
        let rates = [(1, 0.25e9), (8, 1e9)];
        let t = link_table(&root, &args(&["--models", "resnet50"]), &e, &rates);
        assert!(t.contains("1 stream 0.250, 8 streams 1.000 Gbit/s"), "{t}");
        assert!(
            t.contains("| resnet50 | 102.2 MB | 102.2 MB | 718 ms | 153.3 MB | 1127 ms |"),
            "{t}"
        );
    }

    #[test]
    fn bad_layouts_are_refused() {
        for (a, want) in [
            (&["--emulate", "1x4"][..], "at least 2 hosts"),
            (&["--emulate", "2by2"][..], "HOSTSxRANKS"),
            (&["--emulate"][..], "wants HOSTSxRANKS"),
            (&["--link", "1gbit"][..], "need --emulate"),
            (&["--flow", "1gbit"][..], "need --emulate"),
            (
                &["--emulate", "2x2", "--flow", "1gbit"][..],
                "needs a link rate",
            ),
            (&["--emulate", "2x2", "--link", "2gb"][..], "not a rate"),
            (&["--emulate", "2x2", "--rtt", "1"][..], "not a time"),
            (&["--rtt", "1ms"][..], "need --emulate"),
        ] {
            let err = take_emulate(&args(a)).err().unwrap();
            assert!(err.contains(want), "{a:?}: {err}");
        }
    }
}
