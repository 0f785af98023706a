//! The token derived from what every rank of a launch shares, when `FH_JOB_TOKEN` is not set:
//! it keeps other jobs out but authenticates nothing, and rank 0 says so once.

use fh_core::hash::{fnv1a, FNV_OFFSET};

use super::{Get, LaunchInfo, Launcher};

/// What rank 0 says when the token is derived.
pub(super) const DERIVED_TOKEN_NOTICE: &str =
    "FH_JOB_TOKEN is not set, so the job token is derived from \
     the rendezvous address, the world size and the launcher's job id. That keeps other jobs and \
     accidents out, but anyone who can see those facts can compute it: it authenticates nothing. \
     To fix, export a random secret in the environment every rank inherits, e.g. \
     `export FH_JOB_TOKEN=$(openssl rand -hex 32)` before torchrun/srun/mpirun (mpirun: add \
     `-x FH_JOB_TOKEN`), or launch with fhrun; set FH_REQUIRE_TOKEN=1 to refuse to start without \
     one.";

/// Say once per process, on stderr, that the token is derived. This is the one place where
/// this library writes to stderr itself: a warning that only a `tracing` subscriber could show
/// would go unseen in exactly the jobs it is about.
pub(super) fn announce_derived_token(launcher: Launcher) {
    use std::io::Write as _;
    use std::sync::atomic::{AtomicBool, Ordering};
    static SAID: AtomicBool = AtomicBool::new(false);
    if SAID.swap(true, Ordering::Relaxed) {
        return;
    }
    let mut err = std::io::stderr().lock();
    // Nothing to do if stderr is closed.
    let _ = writeln!(
        err,
        "fasthorovod (rank 0, {launcher}): warning: {DERIVED_TOKEN_NOTICE}"
    );
}

pub(super) fn derive_token(get: &Get<'_>, info: &LaunchInfo) -> String {
    let job_id = [
        "SLURM_JOB_ID",
        "SLURM_STEP_ID",
        "OMPI_MCA_ess_base_jobid",
        "OMPI_MCA_orte_ess_jobid",
        "PMI_JOBID",
        "PMIX_NAMESPACE",
        "TORCHELASTIC_RUN_ID",
    ]
    .iter()
    .map(|v| format!("{v}={};", get(v).unwrap_or_default()))
    .collect::<String>();
    let facts = format!(
        "fasthorovod-derived-token;{};size={};{job_id}",
        info.rendezvous.as_deref().unwrap_or(""),
        info.size
    );
    let a = fnv1a(FNV_OFFSET, facts.as_bytes());
    let b = fnv1a(0x6c62_272e_07bb_0142, facts.as_bytes());
    format!("derived-{a:016x}{b:016x}")
}
