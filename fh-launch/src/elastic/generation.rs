//! A new generation's ranks (pure): survivors first in the order of their previous rank,
//! then new workers in host discovery order and slot order; at most `--max-np`; local and
//! cross values from the workers' hosts.

use fh_job::Topology;

/// A registered worker that may join the new generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// Its id, `host:slot`.
    pub id: String,
    /// Its host.
    pub host: String,
    /// Its slot on the host.
    pub slot: usize,
    /// Its rank in the previous generation, if it was in it.
    pub previous: Option<usize>,
    /// Its host's place in the discovery order.
    pub host_order: usize,
}

/// The new generation: each member's id and topology in rank order, and the candidates above
/// `max_np` (not in it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// `(id, host, topology)` by rank.
    pub members: Vec<(String, String, Topology)>,
    /// Ids left out by the cap.
    pub above_max: Vec<String>,
}

/// Order `candidates` into the next generation (see the module documentation).
pub fn plan(mut candidates: Vec<Candidate>, max_np: Option<usize>) -> Plan {
    candidates.sort_by(|a, b| match (a.previous, b.previous) {
        (Some(x), Some(y)) => x.cmp(&y),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => (a.host_order, &a.host, a.slot).cmp(&(b.host_order, &b.host, b.slot)),
    });
    let keep = max_np.unwrap_or(usize::MAX).min(candidates.len());
    let above_max = candidates
        .split_off(keep)
        .into_iter()
        .map(|c| c.id)
        .collect();
    let size = candidates.len();
    // Hosts in the order of their first rank.
    let mut hosts: Vec<&str> = Vec::new();
    for c in &candidates {
        if !hosts.contains(&c.host.as_str()) {
            hosts.push(&c.host);
        }
    }
    let members = candidates
        .iter()
        .enumerate()
        .map(|(rank, c)| {
            let local_rank = candidates[..rank]
                .iter()
                .filter(|o| o.host == c.host)
                .count();
            let local_size = candidates.iter().filter(|o| o.host == c.host).count();
            let cross_rank = hosts.iter().position(|h| *h == c.host).unwrap_or(0);
            (
                c.id.clone(),
                c.host.clone(),
                Topology {
                    rank,
                    size,
                    local_rank,
                    local_size,
                    cross_rank,
                    cross_size: hosts.len(),
                },
            )
        })
        .collect();
    Plan { members, above_max }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(host: &str, slot: usize, previous: Option<usize>, host_order: usize) -> Candidate {
        Candidate {
            id: format!("{host}:{slot}"),
            host: host.into(),
            slot,
            previous,
            host_order,
        }
    }

    fn ids(p: &Plan) -> Vec<&str> {
        p.members.iter().map(|m| m.0.as_str()).collect()
    }

    #[test]
    fn survivors_first_by_previous_rank_then_new_workers_in_discovery_order() {
        // h0 held ranks 2 and 3, h1 ranks 0 and 1 before; h1:0 (rank 0) died; h3 is new and
        // discovered before h2.
        let p = plan(
            vec![
                c("h2", 1, None, 3),
                c("h0", 0, Some(2), 0),
                c("h2", 0, None, 3),
                c("h1", 1, Some(1), 1),
                c("h3", 0, None, 2),
                c("h0", 1, Some(3), 0),
            ],
            None,
        );
        assert_eq!(ids(&p), ["h1:1", "h0:0", "h0:1", "h3:0", "h2:0", "h2:1"]);
        assert!(p.above_max.is_empty());
        let t: Vec<_> = p.members.iter().map(|m| m.2).collect();
        assert!(t
            .iter()
            .enumerate()
            .all(|(r, t)| t.rank == r && t.size == 6));
        // Rank 0 is the lowest survivor: state is synced from it.
        assert_eq!(p.members[0].0, "h1:1");
        // Local and cross values from the hosts, hosts in the order of their first rank.
        let lc: Vec<_> = t
            .iter()
            .map(|t| (t.local_rank, t.local_size, t.cross_rank, t.cross_size))
            .collect();
        assert_eq!(
            lc,
            [
                (0, 1, 0, 4),
                (0, 2, 1, 4),
                (1, 2, 1, 4),
                (0, 1, 2, 4),
                (0, 2, 3, 4),
                (1, 2, 3, 4)
            ]
        );
    }

    #[test]
    fn max_np_leaves_out_the_last_new_workers() {
        let p = plan(
            vec![
                c("h1", 0, None, 1),
                c("h0", 0, Some(0), 0),
                c("h1", 1, None, 1),
            ],
            Some(2),
        );
        assert_eq!(ids(&p), ["h0:0", "h1:0"]);
        assert_eq!(p.above_max, ["h1:1"]);
        assert_eq!(p.members[1].2.size, 2);
        assert_eq!(plan(Vec::new(), Some(3)).members, vec![]);
    }
}
