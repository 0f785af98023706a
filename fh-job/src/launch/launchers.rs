//! Each launcher's variables (fhrun, OpenMPI, MPICH, Slurm, torchrun) into a [`LaunchInfo`],
//! and what a launcher leaves out filled in.

use crate::error::config;
use crate::Result;

use super::{Get, HeartbeatSettings, LaunchInfo, Launcher, DEFAULT_TIMEOUT};

fn parse_usize(get: &Get<'_>, name: &str) -> Result<Option<usize>> {
    match get(name) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse::<usize>()
            .map(Some)
            .map_err(|_| config(name, format!("expected a non-negative integer, got {v:?}"))),
    }
}

fn require_usize(get: &Get<'_>, name: &str, launcher: Launcher, other: &str) -> Result<usize> {
    parse_usize(get, name)?.ok_or_else(|| {
        config(
            name,
            format!("{other} is set (a {launcher} launch) but {name} is missing"),
        )
    })
}

/// Fill in what a launcher left out: without local information every rank is assumed on one
/// host; without cross information hosts are assumed to hold `local_size` consecutive ranks.
fn derive_rest(
    launcher: Launcher,
    rank: usize,
    size: usize,
    local: Option<(usize, usize)>,
    cross: (Option<usize>, Option<usize>),
    vars: Vars,
) -> LaunchInfo {
    let local_vars = local.and(vars.local);
    let cross_vars = match cross {
        (Some(_), Some(_)) => vars.cross,
        _ => None,
    };
    let (local_rank, local_size) = local.unwrap_or((rank, size));
    let ls = local_size.max(1);
    let cross_rank = cross.0.unwrap_or(rank / ls);
    let cross_size = cross.1.unwrap_or(size.div_ceil(ls));
    LaunchInfo {
        rank,
        size,
        local_rank,
        local_size,
        cross_rank,
        cross_size,
        rendezvous: None,
        token: None,
        token_derived: false,
        allow_wildcard: false,
        launcher,
        timeout: DEFAULT_TIMEOUT,
        liveness: Some(HeartbeatSettings::default()),
        host_id: None,
        local_vars,
        cross_vars,
    }
}

/// The variables a launcher's local and cross values come from (when it sets them).
#[derive(Default)]
struct Vars {
    local: Option<(&'static str, &'static str)>,
    cross: Option<(&'static str, &'static str)>,
}

fn local_pair(get: &Get<'_>, rank_var: &str, size_var: &str) -> Result<Option<(usize, usize)>> {
    match (parse_usize(get, rank_var)?, parse_usize(get, size_var)?) {
        (Some(r), Some(s)) => Ok(Some((r, s))),
        (None, None) => Ok(None),
        (Some(_), None) => Err(config(
            size_var,
            format!("{rank_var} is set but {size_var} is missing; set both or neither"),
        )),
        (None, Some(_)) => Err(config(
            rank_var,
            format!("{size_var} is set but {rank_var} is missing; set both or neither"),
        )),
    }
}

/// fhrun's variables of the local rank and size.
pub(super) const FHRUN_LOCAL_VARS: (&str, &str) = ("FH_LOCAL_RANK", "FH_LOCAL_SIZE");
/// fhrun's variables of the host index and host count.
pub(super) const FHRUN_CROSS_VARS: (&str, &str) = ("FH_CROSS_RANK", "FH_CROSS_SIZE");

pub(super) fn from_fhrun(get: &Get<'_>) -> Result<LaunchInfo> {
    let l = Launcher::Fhrun;
    let rank = require_usize(get, "FH_RANK", l, "FH_SIZE")?;
    let size = require_usize(get, "FH_SIZE", l, "FH_RANK")?;
    let local = local_pair(get, "FH_LOCAL_RANK", "FH_LOCAL_SIZE")?;
    let cross = (
        parse_usize(get, "FH_CROSS_RANK")?,
        parse_usize(get, "FH_CROSS_SIZE")?,
    );
    let vars = Vars {
        local: Some(FHRUN_LOCAL_VARS),
        cross: Some(FHRUN_CROSS_VARS),
    };
    Ok(derive_rest(l, rank, size, local, cross, vars))
}

pub(super) fn from_openmpi(get: &Get<'_>) -> Result<LaunchInfo> {
    let l = Launcher::OpenMpi;
    let rank = require_usize(get, "OMPI_COMM_WORLD_RANK", l, "OMPI_COMM_WORLD_SIZE")?;
    let size = require_usize(get, "OMPI_COMM_WORLD_SIZE", l, "OMPI_COMM_WORLD_RANK")?;
    let local = local_pair(
        get,
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    )?;
    let vars = Vars {
        local: Some(("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")),
        cross: None,
    };
    Ok(derive_rest(l, rank, size, local, (None, None), vars))
}

pub(super) fn from_mpich(get: &Get<'_>) -> Result<LaunchInfo> {
    let l = Launcher::Mpich;
    let rank = require_usize(get, "PMI_RANK", l, "PMI_SIZE")?;
    let size = require_usize(get, "PMI_SIZE", l, "PMI_RANK")?;
    let local = local_pair(get, "MPI_LOCALRANKID", "MPI_LOCALNRANKS")?;
    let vars = Vars {
        local: Some(("MPI_LOCALRANKID", "MPI_LOCALNRANKS")),
        cross: None,
    };
    Ok(derive_rest(l, rank, size, local, (None, None), vars))
}

/// Parse Slurm's `SLURM_TASKS_PER_NODE` (`"2(x3),1"`) and return the count of node `node`.
/// A plain number (`SLURM_NTASKS_PER_NODE=2`) applies to every node.
fn slurm_tasks_on_node(spec: &str, node: usize) -> Option<usize> {
    if let Ok(n) = spec.trim().parse::<usize>() {
        return Some(n);
    }
    let mut seen = 0usize;
    for part in spec.split(',') {
        let part = part.trim();
        let (count, repeat) = match part.split_once("(x") {
            Some((c, rest)) => (c.parse().ok()?, rest.strip_suffix(')')?.parse().ok()?),
            None => (part.parse().ok()?, 1usize),
        };
        seen = seen.checked_add(repeat)?;
        if node < seen {
            return Some(count);
        }
    }
    None
}

/// The first of `names` that is set, with its name.
pub(super) fn first_set(get: &Get<'_>, names: &[&'static str]) -> Option<(&'static str, String)> {
    names.iter().find_map(|&n| get(n).map(|v| (n, v)))
}

pub(super) fn from_slurm(get: &Get<'_>) -> Result<LaunchInfo> {
    let l = Launcher::Slurm;
    let rank = require_usize(get, "SLURM_PROCID", l, "SLURM_PROCID")?;
    // A job step may use fewer tasks and nodes than the allocation: prefer the step's view.
    let size = match first_set(
        get,
        &["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"],
    ) {
        Some((name, _)) => require_usize(get, name, l, "SLURM_PROCID")?,
        None => {
            return Err(config(
                "SLURM_NTASKS",
                "SLURM_PROCID is set (a Slurm job step) but none of SLURM_STEP_NUM_TASKS, \
                 SLURM_NTASKS and SLURM_NPROCS is",
            ))
        }
    };
    let node = parse_usize(get, "SLURM_NODEID")?;
    let local_rank = parse_usize(get, "SLURM_LOCALID")?;
    let spec = first_set(
        get,
        &[
            "SLURM_STEP_TASKS_PER_NODE",
            "SLURM_NTASKS_PER_NODE",
            "SLURM_TASKS_PER_NODE",
        ],
    );
    let local_size_var = spec.as_ref().map(|(name, _)| *name);
    let local_size = match spec {
        None => None,
        Some((name, spec)) => {
            let node = node.unwrap_or(0);
            Some(slurm_tasks_on_node(&spec, node).ok_or_else(|| {
                config(
                    name,
                    format!(
                        "expected a task count or a list like \"2(x3),1\" covering node {node}, \
                         got {spec:?}"
                    ),
                )
            })?)
        }
    };
    let local = match (local_rank, local_size) {
        (Some(r), Some(s)) => Some((r, s)),
        (None, None) => None,
        (Some(_), None) => {
            return Err(config(
                "SLURM_TASKS_PER_NODE",
                "SLURM_LOCALID is set but none of SLURM_STEP_TASKS_PER_NODE, \
                 SLURM_NTASKS_PER_NODE and SLURM_TASKS_PER_NODE is",
            ))
        }
        (None, Some(_)) => {
            return Err(config(
                "SLURM_LOCALID",
                "the tasks per node are set but SLURM_LOCALID is missing",
            ))
        }
    };
    let nodes_var = first_set(get, &["SLURM_STEP_NUM_NODES", "SLURM_NNODES"]).map(|(n, _)| n);
    let nodes = match nodes_var {
        Some(name) => parse_usize(get, name)?,
        None => None,
    };
    let vars = Vars {
        local: local_size_var.map(|s| ("SLURM_LOCALID", s)),
        cross: nodes_var.map(|n| ("SLURM_NODEID", n)),
    };
    Ok(derive_rest(l, rank, size, local, (node, nodes), vars))
}

pub(super) fn from_torchrun(get: &Get<'_>) -> Result<LaunchInfo> {
    let l = Launcher::Torchrun;
    let rank = require_usize(get, "RANK", l, "WORLD_SIZE")?;
    let size = require_usize(get, "WORLD_SIZE", l, "RANK")?;
    let local = local_pair(get, "LOCAL_RANK", "LOCAL_WORLD_SIZE")?;
    let cross = (
        parse_usize(get, "GROUP_RANK")?,
        parse_usize(get, "GROUP_WORLD_SIZE")?,
    );
    let vars = Vars {
        local: Some(("LOCAL_RANK", "LOCAL_WORLD_SIZE")),
        cross: Some(("GROUP_RANK", "GROUP_WORLD_SIZE")),
    };
    Ok(derive_rest(l, rank, size, local, cross, vars))
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tasks_per_node_syntax() {
        assert_eq!(slurm_tasks_on_node("2(x3),1", 0), Some(2));
        assert_eq!(slurm_tasks_on_node("2(x3),1", 2), Some(2));
        assert_eq!(slurm_tasks_on_node("2(x3),1", 3), Some(1));
        assert_eq!(slurm_tasks_on_node("2(x3),1", 4), None);
        assert_eq!(slurm_tasks_on_node("4", 0), Some(4));
        assert_eq!(slurm_tasks_on_node("4", 3), Some(4));
        assert_eq!(slurm_tasks_on_node("x", 0), None);
    }
}
