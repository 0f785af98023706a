//! Project automation, run as `cargo xtask <task>` (see `.cargo/config.toml`).
//!
//! - `cargo xtask test`: the whole test suite (prerequisites, format, tidy, `cargo test`, extra
//!   suites); ends with `N passed, M failed[, K skipped]` and a non-zero exit on any failure.
//! - `cargo xtask ci`: what `.ci/run` runs (the same as `test`).
//! - `cargo xtask multihost`: the multi-host checks on an emulated cluster (network namespaces,
//!   root only; also a stage of `test`, skipped with a message where it cannot run).
//! - `cargo xtask cluster [--hosts N] [--link RATE [--flow RATE]] [--rtt TIME] -- COMMAND`:
//!   COMMAND on host h0 of an emulated cluster (root only; `--flow` caps each TCP connection,
//!   `--rtt` adds a round-trip time), torn down afterwards.
//! - `cargo xtask tidy`: the repository's structural checks (also run as `#[test]`s).
//! - `cargo xtask bench [--quick] [--np N] [--hosts H,..|--launcher mpirun|srun] [--out DIR]
//!   [suite..]`: builds `fh-bench` in release mode and runs it; `--emulate HxR [--link RATE
//!   [--flow RATE]] [--rtt TIME]` runs it on an emulated cluster (root only); `... synthetic
//!   [OPTIONS]` there runs Horovod's synthetic benchmark (VGG-16) on fasthorovod.torch, Horovod
//!   and DDP, interleaved (`synthetic.rs`).
//! - `cargo xtask nccl-bindings [--check]`: regenerates (or checks) the committed NCCL bindings
//!   of `fh-nccl-sys` with bindgen (feature `nccl-bindings`, the only dependency of xtask).
//! - `cargo xtask wheel [--test]`: the binary wheel of `fasthorovod` with `fhrun` inside, and
//!   its sdist (tools from the package registry, in `target/wheel/tools`).
//! - `cargo xtask compat`: that wheel against several torch releases and Pythons (outside the
//!   default test run).
//! - `cargo xtask horovod [--force]`: real Horovod 0.28.1 built into `target/hvd-venv`, the
//!   bench's Horovod peer (outside the default test run).
//!
//! Nearly dependency-free on purpose: `cargo xtask` must build in seconds on a fresh machine
//! (`nfq` and `rustix`, both small, hold packets for the emulated cluster's round-trip time).

mod bench;
mod cluster;
mod compat;
mod horovod;
mod multihost;
mod nccl;
mod python;
mod synthetic;
mod test;
mod tidy;
mod wheel;
mod wheel_env;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

const USAGE: &str = "\
usage: cargo xtask <task> [args]

tasks:
  test     run the whole test suite (installs missing Debian packages when root)
  ci       what .ci/run runs (= test)
  tidy     structural checks: layering, docs, README, .ci/run, ARCHITECTURE.md
  bench    build fh-bench in release mode and run it:
           cargo xtask bench [--quick] [--np N] [--hosts H1,H2|--launcher mpirun|srun]
                             [--out DIR] [SUITE..]   (suites: collectives replay negotiation simulate)
           anything else after `bench` is passed to `fh-bench suite` (see `fh-bench suite --help`)
           --emulate HxR [--link RATE [--flow RATE]] [--rtt TIME]: on an emulated cluster of
           H hosts x R ranks (root), links at RATE, each TCP connection capped at the --flow
           RATE, the round trip raised by TIME (a cloud); reports 1- and 8-stream TCP rates
           and bounds at the best of them
  multihost
           the multi-host checks on an emulated cluster (network namespaces; needs root),
           also a stage of `test`: cargo xtask multihost [FILTER]
           cargo xtask multihost --elastic-runs N   (the elastic check N times: recovery
           and growth times, median and worst)
  cluster [--hosts N] [--link RATE [--flow RATE]] [--rtt TIME] -- COMMAND [ARGS]
           run COMMAND on host h0 of an emulated cluster (hosts h0..; FH_RSH_AGENT set);
           RATE as tc writes it (500mbit, 2gbit); --flow caps each TCP connection (tbf + htb
           leaf per connection, nftables); --rtt 1ms adds a round trip (NFQUEUE, needs
           iptables); prints the measured 1- and 8-stream rates first
  nccl-bindings [--check] [--header PATH]
           regenerate fh-nccl-sys/src/bindings.rs from the NCCL wheel's nccl.h (bindgen)
  wheel    the binary wheel of fasthorovod (Linux x86_64, manylinux_2_17, abi3: every CPython
           >= 3.9; fhrun and fh-selftest inside) and its sdist, in target/wheel/dist;
           --test: then the wheel in a fresh environment outside the tree (a stage of test)
  compat [--torch V1,V2,..] [--python PATH1,PATH2,..]
           the wheel against several torch releases and Pythons (ranks suite at np 2 each);
           the table into README.md (several GB of downloads, cached in target/compat)
  horovod [--force]
           real Horovod 0.28.1 (sdist from the package registry, C++ standard patched to 20,
           CPU, Gloo and MPI) built into target/hvd-venv beside target/fh-venv's torch, checked
           with horovodrun --check-build and 2-rank allreduces; `cargo xtask bench` then runs
           the Horovod rows (about 5 minutes on 2 cores; a second run says it is built)
";

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let task = args.next().unwrap_or_default();
    let rest: Vec<String> = args.collect();
    let root = project_root();
    match task.as_str() {
        "test" | "ci" => test::run(&root, &rest),
        "tidy" => {
            let failures = tidy::run_all(&root);
            if failures.is_empty() {
                eprintln!("tidy: all checks passed");
                ExitCode::SUCCESS
            } else {
                for f in &failures {
                    eprintln!("tidy: {f}");
                }
                eprintln!("tidy: {} check(s) failed", failures.len());
                ExitCode::FAILURE
            }
        }
        "bench" => bench::run(&root, &rest),
        "multihost" => multihost::task(&root, &rest),
        "cluster" => cluster::task(&rest),
        "__link-probe" => cluster::link_probe(&rest),
        "nccl-bindings" => nccl::run(&root, &rest),
        "wheel" => wheel::run(&root, &rest),
        "compat" => compat::run(&root, &rest),
        "horovod" => horovod::run(&root, &rest),
        "" | "help" | "-h" | "--help" => {
            eprint!("{USAGE}");
            if task.is_empty() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            }
        }
        other => {
            eprintln!("xtask: unknown task `{other}`\n");
            eprint!("{USAGE}");
            ExitCode::from(2)
        }
    }
}

/// The workspace root: the parent of this crate's manifest directory.
pub(crate) fn project_root() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    dir.parent().unwrap_or(dir).to_path_buf()
}

/// The `cargo` that runs us (cargo sets `CARGO` for `cargo run`), else `cargo` from PATH.
pub(crate) fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string())
}
