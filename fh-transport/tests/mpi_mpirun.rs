//! Runs the MPI collective suite (`tests/mpi/suite.rs`) under `mpirun` with 2, 3 and 4 ranks,
//! in serialized mode, and as an MPI singleton; skips with a message when `mpirun` is absent.
//!
//! This file is its own harness (`harness = false`): started by `cargo test` it is the parent,
//! which launches `mpirun -np N <this executable>`; started with `FH_MPI_SUITE_CHILD=1` it is one
//! rank of the suite.
//!
//! `cargo test -p fh-transport --features mpi --test mpi_mpirun`

use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use fh_transport::backend::mpi::MpiTransport;
use fh_transport::{Transport, TransportError};

#[path = "mpi/suite.rs"]
mod suite;

const CHILD: &str = "FH_MPI_SUITE_CHILD";
/// Longest a single `mpirun` may take (the suite takes seconds; a loaded 2-core machine with 4
/// oversubscribed ranks can take a minute).
const RUN_TIMEOUT: Duration = Duration::from_secs(300);

fn child() -> ExitCode {
    let mut world = match MpiTransport::new() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("mpi suite rank: cannot start the MPI transport: {e}");
            return ExitCode::FAILURE;
        }
    };
    match suite::run(&mut world) {
        Ok(rep) => {
            let ok = rep.failures.is_empty();
            eprintln!("{}", suite::summary(&world, &rep));
            drop(world);
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("mpi suite rank {}: FATAL {e}", world.rank());
            // Do not finalize: other ranks may be blocked in a collective; mpirun ends the job.
            std::process::exit(1);
        }
    }
}

/// Kills the launched process group if the run does not finish (or the test panics).
struct Reaper(Option<Child>);

impl Reaper {
    fn wait(&mut self, timeout: Duration) -> Result<std::process::ExitStatus, String> {
        let deadline = Instant::now() + timeout;
        let child = self.0.as_mut().ok_or("no child")?;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => {
                    self.0 = None;
                    return Ok(status);
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Ok(None) => return Err(format!("still running after {timeout:?}; killed")),
                Err(e) => return Err(format!("waiting for mpirun: {e}")),
            }
        }
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let pgid = child.id() as i32;
            // SAFETY: signalling the process group we created for this run.
            unsafe { libc::kill(-pgid, libc::SIGTERM) };
            std::thread::sleep(Duration::from_secs(2));
            // SAFETY: as above.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn find_mpirun() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("mpirun"))
        .find(|p| p.is_file())
}

fn is_open_mpi(mpirun: &PathBuf) -> bool {
    Command::new(mpirun)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("Open MPI"))
        .unwrap_or(false)
}

/// Run `exe` under `mpirun -np np` (or alone when `np` is `None`) with `env`.
fn launch(
    mpirun: &PathBuf,
    open_mpi: bool,
    np: Option<usize>,
    env: &[(&str, &str)],
) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let mut cmd = match np {
        Some(np) => {
            let mut c = Command::new(mpirun);
            c.arg("-np").arg(np.to_string());
            if open_mpi {
                c.args(["--oversubscribe", "--bind-to", "none"]);
                // SAFETY: geteuid has no preconditions.
                if unsafe { libc::geteuid() } == 0 {
                    c.arg("--allow-run-as-root");
                }
                for (k, _) in env {
                    c.args(["-x", k]);
                }
            }
            c.arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    cmd.env(CHILD, "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    cmd.stdin(Stdio::null());
    let mut reaper = Reaper(Some(
        cmd.spawn().map_err(|e| format!("spawning {cmd:?}: {e}"))?,
    ));
    let status = reaper.wait(RUN_TIMEOUT)?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{status}"))
    }
}

fn main() -> ExitCode {
    if std::env::var_os(CHILD).is_some() {
        return child();
    }
    if std::env::var_os("FH_MPI_SIZE_PROBE").is_some() {
        return size_probe();
    }
    let Some(mpirun) = find_mpirun() else {
        println!(
            "mpi_mpirun: SKIPPED: `mpirun` is not on PATH (Debian: apt-get install openmpi-bin \
             libopenmpi-dev libclang-dev)"
        );
        return ExitCode::SUCCESS;
    };
    let open_mpi = is_open_mpi(&mpirun);
    let mut failed = Vec::new();
    type Run<'a> = (&'a str, Option<usize>, Vec<(&'a str, &'a str)>);
    let runs: Vec<Run<'_>> = vec![
        ("np=2", Some(2), vec![]),
        ("np=3", Some(3), vec![]),
        (
            "np=4 FH_TRANSPORT=mpi",
            Some(4),
            vec![("FH_TRANSPORT", "mpi")],
        ),
        (
            "np=3 serialized",
            Some(3),
            vec![("FH_MPI_THREAD_LEVEL", "serialized")],
        ),
        ("singleton", None, vec![]),
    ];
    for (name, np, env) in &runs {
        let started = Instant::now();
        let res = launch(&mpirun, open_mpi, *np, env);
        println!(
            "mpi_mpirun: {name}: {} ({:.1} s)",
            if res.is_ok() { "ok" } else { "FAILED" },
            started.elapsed().as_secs_f64()
        );
        if let Err(e) = res {
            failed.push(format!("{name}: {e}"));
        }
    }

    // A singleton whose launcher claims a bigger world must refuse clearly, not run alone.
    let exe = std::env::current_exe().expect("current_exe");
    let out = Command::new(&exe)
        .env("FH_MPI_SIZE_PROBE", "1")
        .env("FH_SIZE", "3")
        .output();
    match out {
        Ok(o) => {
            let text = String::from_utf8_lossy(&o.stdout).into_owned();
            if !(o.status.success() && text.contains("FH_SIZE=3") && text.contains("mpirun")) {
                failed.push(format!("FH_SIZE mismatch probe: {:?} {text}", o.status));
            }
        }
        Err(e) => failed.push(format!("FH_SIZE mismatch probe: {e}")),
    }

    if failed.is_empty() {
        println!("mpi_mpirun: all runs passed");
        ExitCode::SUCCESS
    } else {
        eprintln!("mpi_mpirun: FAILED:\n  {}", failed.join("\n  "));
        ExitCode::FAILURE
    }
}

/// With `FH_MPI_SIZE_PROBE` set: report what `MpiTransport::new` says in a singleton started
/// with `FH_SIZE=3` (it must refuse with a Config error naming mpirun).
fn size_probe() -> ExitCode {
    match MpiTransport::new() {
        Err(e @ TransportError::Config { .. }) => {
            println!("{e}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("unexpected error: {e}");
            ExitCode::FAILURE
        }
        Ok(_) => {
            println!("a singleton accepted FH_SIZE=3");
            ExitCode::FAILURE
        }
    }
}
