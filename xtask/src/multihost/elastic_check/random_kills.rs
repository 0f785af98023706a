//! The random-kill check: the elastic example on h1–h4 (`--min-np 2`), a worker or a whole host
//! SIGKILLed at a random moment after the first commit (and in 40 % of the runs a second one
//! while the survivors re-form); the survivors train on, fhrun exits 0 naming each lost host,
//! nothing is left running, and the replay agrees.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use super::{commits, finish, now, read_progress, start_job, tail, worlds, COMMITS};
use crate::cluster::Cluster;
use crate::multihost::chaos::Rng;
use crate::multihost::median_and_worst;

/// Runs of the random-kill check in CI (`FH_CLUSTER_EKILL_RUNS` asks for another number).
pub(crate) const RANDOM_KILL_RUNS: usize = 6;

/// One planned kill of the random-kill check: a host (1–4) and whether all its processes die
/// (the host lost, fhrun's part with it) or only its worker (a worker killed).
#[derive(Debug, Clone, Copy)]
struct Kill {
    host: usize,
    whole_host: bool,
}

/// One run's plan: the first kill lands `delay_ms` after the first world's first commit
/// (inside a step's forward or backward pass, its reductions, or a commit: a step takes about
/// 60 ms); a second one, when planned, `reform_ms` after the first, while the survivors
/// re-form.
#[derive(Debug, Clone)]
struct KillPlan {
    first: Kill,
    second: Option<Kill>,
    delay_ms: u64,
    reform_ms: u64,
}

fn kill_plan(rng: &mut Rng) -> KillPlan {
    let first = Kill {
        host: 1 + rng.below(4) as usize,
        whole_host: rng.below(2) == 0,
    };
    let second = (rng.below(5) < 2).then(|| {
        let others: Vec<usize> = (1..=4).filter(|&h| h != first.host).collect();
        Kill {
            host: others[rng.below(3) as usize],
            whole_host: rng.below(2) == 0,
        }
    });
    KillPlan {
        first,
        second,
        delay_ms: rng.below(1500),
        reform_ms: rng.below(400),
    }
}

/// SIGKILL every process on `host` of `c`, or only its worker (a Python process running the
/// example): how many were killed.
fn kill_on(c: &Cluster, kill: Kill) -> usize {
    let pids: Vec<u32> = c
        .processes(kill.host)
        .into_iter()
        .filter(|pid| {
            kill.whole_host
                || std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|cmd| String::from_utf8_lossy(&cmd).contains("elastic_train.py"))
        })
        .collect();
    for pid in &pids {
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    }
    pids.len()
}

/// One run of the random-kill check on `c` (5 hosts): the example trains on h1–h4 (4 ranks,
/// `--min-np 2`); after the first commit one worker or host is SIGKILLed at a random moment,
/// in 40% of the runs a second one while the survivors re-form. The survivors must train on
/// in a smaller world (without the victims, which are blacklisted), and the job, ended by
/// the stop file after two commits there, must exit 0 with the replay agreeing. Returns the
/// seconds from the last kill to the first step of the smaller world, and a summary.
fn random_kill_once(
    c: &Cluster,
    fhrun: &Path,
    root: &Path,
    py: &Path,
    n: usize,
    plan: &KillPlan,
) -> Result<(f64, String), String> {
    let dir = c.dir().join(format!("ekill{n}"));
    let hosts = ["h1", "h2", "h3", "h4"];
    let (mut job, files) = start_job(c, fhrun, root, py, &dir, &hosts, (4, 2, 4))?;
    let logs = files.logs.clone();
    let first = job.wait_for(&logs, "a commit in a world of 4 ranks", |p| {
        worlds(p, 4, None, 0.0)
            .into_iter()
            .find(|&g| commits(p, g) >= 1)
            .map(|g| g as f64)
    })? as u64;
    std::thread::sleep(Duration::from_millis(plan.delay_ms));
    // Each kill's time, taken before it (recovery is counted from there) and after it (a
    // victim's line written after that came from a worker started again).
    let t = now();
    if kill_on(c, plan.first) == 0 {
        return Err(format!("nothing to kill on h{}", plan.first.host));
    }
    let mut kills = vec![(plan.first, t, now())];
    if let Some(second) = plan.second {
        std::thread::sleep(Duration::from_millis(plan.reform_ms));
        let t = now();
        kill_on(c, second);
        kills.push((second, t, now()));
    }
    let last = kills.last().map_or(0.0, |k| k.1);
    let victims: Vec<String> = kills
        .iter()
        .map(|(k, _, _)| format!("h{}", k.host))
        .collect();
    let size = 4 - kills.len();
    let smaller = job.wait_for(
        &logs,
        &format!("a step in a world of {size} ranks after the kills"),
        |p| {
            p.iter()
                .filter(|x| {
                    x.kind == "step" && x.size == size && x.generation > first && x.time > last
                })
                .map(|x| x.time)
                .reduce(f64::min)
        },
    )?;
    let recovery = smaller - last;
    let world = job.wait_for(&logs, "two commits in the smaller world", |p| {
        worlds(p, size, None, last)
            .into_iter()
            .find(|&g| commits(p, g) >= COMMITS)
            .map(|g| g as f64)
    })? as u64;
    let (out, replayed) = finish(job, c, root, py, &files)?;
    let progress = read_progress(&logs);
    for ((kill, _, after), name) in kills.iter().zip(&victims) {
        if !out.contains(&format!("lost {name} (")) {
            return Err(format!(
                "fhrun's output does not name the lost host {name} ({kill:?}):\n{}",
                tail(&out)
            ));
        }
        // A margin for a line being written as the signal lands (a worker started again
        // imports torch for seconds before its first step).
        if progress
            .iter()
            .any(|x| &x.host == name && x.time > after + 0.5)
        {
            return Err(format!(
                "{name} trained again after its kill (it is blacklisted)"
            ));
        }
    }
    Ok((
        recovery,
        format!(
            "{plan:?}: generation {first} (4 ranks), then generation {world} ({size} ranks); \
             from the last kill to training {recovery:.2} s; {replayed}"
        ),
    ))
}

/// The random-kill check: `runs` runs on `c` (see [`random_kill_once`]), their plans drawn
/// from `seed`; the first failure ends it, naming the seed and the run to replay
/// (`FH_CLUSTER_EKILL_SEED`, `FH_CLUSTER_EKILL_RUNS`).
pub(crate) fn random_kills(
    c: &Cluster,
    fhrun: &Path,
    root: &Path,
    py: &Path,
    runs: usize,
    seed: u64,
) -> Result<String, String> {
    let mut rng = Rng::new(seed);
    let mut recovery = Vec::new();
    for i in 0..runs {
        let plan = kill_plan(&mut rng);
        match random_kill_once(c, fhrun, root, py, i, &plan) {
            Ok((r, summary)) => {
                eprintln!("multihost: random kill {}/{runs}: {summary}", i + 1);
                recovery.push(r);
            }
            Err(e) => {
                return Err(format!(
                    "random kill {}/{runs} (FH_CLUSTER_EKILL_SEED={seed}, run {i}) {plan:?}: {e}",
                    i + 1
                ))
            }
        }
    }
    let (m, w) = median_and_worst(&recovery);
    Ok(format!(
        "{runs} runs (seed {seed}), every one finished with the replay agreeing; from the last \
         kill to training again: median {m:.2} s, worst {w:.2} s"
    ))
}
