//! Horovod's rows: the interpreter they run under, `horovodrun`'s arguments, and the `ssh`
//! stand-in that starts its remote ranks on emulated hosts through the cluster's rsh agent.

use std::path::{Path, PathBuf};

use super::{shell_word, Peer, HOROVOD_PYTHON_ENV};

impl Peer {
    /// The interpreter this peer runs under: `$FH_BENCH_HOROVOD_PYTHON` for Horovod's rows when
    /// set, else `python` (the other peers').
    pub fn python(&self, python: &str) -> String {
        let own = (self.mode == "horovod")
            .then(|| std::env::var(HOROVOD_PYTHON_ENV).ok())
            .flatten()
            .filter(|s| !s.trim().is_empty());
        own.unwrap_or_else(|| python.to_string())
    }

    /// `horovodrun`'s arguments before the command: `-np`, `-H` and the controller of the
    /// row's mode (with Open MPI's yield setting for the MPI rows); across hosts
    /// (`across`), `--network-interfaces` when `nics` names them (else Horovod finds the
    /// common ones itself).
    pub fn horovodrun_args(&self, np: usize, host_list: &str, nics: Option<&str>) -> Vec<String> {
        let mut a = vec![
            "-np".to_string(),
            np.to_string(),
            "-H".to_string(),
            host_list.to_string(),
        ];
        match self.transport {
            "gloo" => a.push("--gloo".into()),
            "mpi" | "mpi-busy" => {
                let yield_idle = u8::from(self.transport == "mpi");
                a.push("--mpi".into());
                a.push(format!("--mpi-args=--mca mpi_yield_when_idle {yield_idle}"));
            }
            _ => {}
        }
        if let Some(n) = nics.filter(|n| !n.trim().is_empty()) {
            a.push("--network-interfaces".into());
            a.push(n.to_string());
        }
        a
    }
}

/// An `ssh` for `horovodrun` across emulated hosts: Horovod starts remote ranks (and checks
/// the hosts) with `ssh -o ... HOST [-p P] [-i F] [-o ...] COMMAND`; this drops ssh's options
/// and runs COMMAND on HOST through the cluster's rsh agent (`agent HOST COMMAND...`).
pub fn ssh_shim(agent: &str) -> String {
    format!(
        "#!/bin/sh
         # ssh for horovodrun on emulated hosts (fh-bench): options dropped, the rsh agent runs it
         while [ $# -gt 0 ]; do case \"$1\" in -o|-p|-i|-l|-F) shift 2 ;; -*) shift ;; *) break ;; esac; done
         host=\"${{1:?usage: ssh [OPTIONS] HOST COMMAND...}}\"; shift
         while [ $# -gt 0 ]; do case \"$1\" in -o|-p|-i|-l|-F) shift 2 ;; *) break ;; esac; done
         exec {} \"$host\" \"$@\"
",
        shell_word(agent)
    )
}

/// Writes [`ssh_shim`] as `dir/ssh` (executable); returns `dir`.
pub(super) fn write_ssh_shim(dir: &Path, agent: &str) -> Result<PathBuf, String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let p = dir.join("ssh");
    std::fs::write(&p, ssh_shim(agent)).map_err(|e| format!("writing {}: {e}", p.display()))?;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("making {} executable: {e}", p.display()))?;
    Ok(dir.to_path_buf())
}

/// `horovodrun` next to the interpreter (a virtual environment's `bin/`), else on `PATH`.
pub(super) fn horovodrun(python: &str) -> String {
    let beside = Path::new(python).parent().map(|d| d.join("horovodrun"));
    match beside {
        Some(p) if p.is_file() => p.display().to_string(),
        _ => "horovodrun".into(),
    }
}
