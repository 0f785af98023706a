//! The training check: `fasthorovod.torch` training on 2 × 2 through fhrun's rsh agent.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use super::common::{bounded, tail};
use super::Bins;
use crate::cluster::Cluster;

/// Compares the saved parameters: every rank's equal to rank 0's bit for bit, and rank 0's
/// equal to one process's on the ranks' batches concatenated (to float tolerance: the sum
/// runs in another order). Prints the largest difference from one process.
const COMPARE_PARAMS: &str = r#"
import sys, torch
n, ranks, ref = int(sys.argv[1]), sys.argv[2], sys.argv[3]
ps = [torch.load(ranks.format(rank=r)) for r in range(n)]
want = torch.load(ref)
for r in range(1, n):
    for k in ps[0]:
        if not torch.equal(ps[0][k], ps[r][k]):
            sys.exit(f"{k}: rank {r} differs from rank 0")
worst = 0.0
for k in ps[0]:
    if not torch.allclose(ps[0][k], want[k], rtol=1e-4, atol=1e-5):
        sys.exit(f"{k}: {n} ranks and one process differ")
    worst = max(worst, (ps[0][k] - want[k]).abs().max().item())
print(f"{n} ranks bit-identical; largest difference from one process {worst:.3g}")
"#;

/// `fh-torch/examples/train_synthetic_cnn.py` on 2 × 2 through fhrun's rsh agent (rank 0 on h0,
/// ranks 2 and 3 on h1): bit-identical parameters on every rank, equal to one process.
pub(super) fn training(c: &Cluster, bins: &Bins, root: &Path, py: &Path) -> Result<String, String> {
    let agent = c.rsh_agent()?;
    let example = root
        .join("fh-torch")
        .join("examples")
        .join("train_synthetic_cnn.py");
    let ranks = c.dir().join("params-{rank}.pt");
    let reference = c.dir().join("params-ref.pt");
    let steps = "12";
    let mut cmd = c.command(0, &bins.fhrun);
    cmd.args([
        "-np",
        "4",
        "-H",
        "h0:2,h1:2",
        "-x",
        "FH_TIMEOUT_SECONDS",
        "-x",
        "OMP_NUM_THREADS",
    ])
    .arg(py)
    .arg(&example)
    .args(["--steps", steps, "--save"])
    .arg(&ranks)
    .env("FH_RSH_AGENT", &agent)
    .env("FH_TIMEOUT_SECONDS", "60")
    .env("OMP_NUM_THREADS", "1");
    let (status, out) = bounded(cmd, &c.dir().join("train.log"), Duration::from_secs(300))?;
    if !matches!(status, Some(s) if s.success()) {
        return Err(format!(
            "the 4-rank run ended with {status:?}; output:\n{}",
            tail(&out)
        ));
    }
    let mut one = Command::new(py);
    one.arg(&example)
        .args(["--steps", steps, "--concat-ranks", "4", "--save"])
        .arg(&reference)
        .env("OMP_NUM_THREADS", "1");
    let (status, out1) = bounded(one, &c.dir().join("one.log"), Duration::from_secs(300))?;
    if !matches!(status, Some(s) if s.success()) {
        return Err(format!(
            "the one-process run ended with {status:?}; output:\n{}",
            tail(&out1)
        ));
    }
    let mut cmp = Command::new(py);
    cmp.args(["-c", COMPARE_PARAMS, "4"])
        .arg(&ranks)
        .arg(&reference);
    let (status, said) = bounded(cmp, &c.dir().join("compare.log"), Duration::from_secs(120))?;
    if !matches!(status, Some(s) if s.success()) {
        return Err(format!("the parameters differ: {}", tail(&said)));
    }
    Ok(said.lines().last().unwrap_or("").trim().to_string())
}
