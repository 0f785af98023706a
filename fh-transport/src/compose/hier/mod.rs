//! The hierarchical backend (Linux) for jobs on several hosts: shared memory among the ranks
//! of a host, TCP between hosts.
//!
//! A [`HierTransport`] holds a full-world [`TcpTransport`](crate::backend::tcp::TcpTransport) and a [`ShmTransport`](crate::backend::shm::ShmTransport) among the
//! ranks of this host (joined with a token derived from the job token and the host index, so
//! that hosts simulated on one machine never share a segment). Each communicator it opens
//! combines a full-world TCP communicator and a shared-memory communicator of this host:
//!
//! - **Allreduce** (the hot path). When every host runs the same number `L` of ranks, the
//!   vector is split into `L` blocks: a shared-memory reduce-scatter leaves block `i` of the
//!   host's sum on local rank `i`; the local ranks `i` of all hosts ("lane" `i`) allreduce
//!   their block over TCP, all lanes at once; a shared-memory allgather reassembles the vector.
//!   Every byte crosses the network once per host instead of once per rank, and every rank
//!   drives a share of the traffic. All three steps work in the caller's buffer: the
//!   reduce-scatter reduces the rank's block where it lies (only the rest goes through the
//!   shared-memory slots), the TCP allreduce runs on that block in place, and the allgather
//!   writes the other ranks' blocks around it — no block is copied to a buffer of its own. A vector larger than the pipeline chunk
//!   ([`crate::backend::tcp::settings::PIPELINE_VAR`], agreed at the rendezvous) is reduced chunk
//!   by chunk, the three steps overlapping: the shared-memory steps on the calling thread, the
//!   TCP allreduce of each chunk on a scoped thread, so that the link is kept busy while the
//!   CPU reduces and copies within the host. When hosts differ in size, the host reduces over shared
//!   memory, the host leaders (local rank 0) allreduce over TCP, and each leader broadcasts
//!   the result over shared memory. Either way `Average` sums and divides by the world size
//!   exactly once.
//! - **Broadcast** and **barrier** are hierarchical too: shared memory on the root's host, TCP
//!   among the leaders, shared memory on the other hosts (a barrier: shared memory, leaders,
//!   shared memory).
//! - **Everything else** (point-to-point, allgather(v), alltoall(v), reduce-scatter) runs on
//!   the full-world TCP communicator, with the generic [`crate::algorithms`].
//!
//! The cross-host steps run over *views* of the full-world TCP communicator restricted to the
//! lane or the leaders, so no extra connections are made.
//!
//! # Layout
//!
//! Which ranks share a host is settled from facts during the TCP rendezvous
//! ([`fh_job::hosts`]; a launcher's `FH_CROSS_RANK`, `FH_LOCAL_RANK`/`FH_LOCAL_SIZE` that
//! contradict them stop every rank there). The hierarchy is built from that settled
//! [`Layout`] and the room in `/dev/shm` each rank reported there, the same on every rank, with
//! no exchange of its own; [`HierTransport::connect`] fails with [`TransportError::Config`]
//! where some host lacks room, and `FH_TRANSPORT=auto` ([`connect_auto`]) falls back to plain
//! TCP instead, as it does when every host runs a single rank.
//!
//! # Failures
//!
//! A failure anywhere is propagated both ways: an error on the TCP side makes the rank give up
//! its shared-memory communicator (its local peers stop waiting and report the rank the error
//! blamed), and an error on the shared-memory side makes it give up its TCP communicator (the
//! other hosts are told which rank to blame). Every error names global ranks.
//!
//! A rank is never blamed for waiting across hosts. While a rank waits on TCP it says so in
//! its shared-memory slot, with the rank it waits for when that rank is on another host
//! (`ShmComm::waiting_outside`, set per message by the views the steps run on). A local
//! peer whose shared-memory wait for it times out meanwhile does not blame it: it waits once
//! more, at most as long as a TCP wait can take to fail (`TcpComm::longest_stall`), for the
//! rank's verdict (its TCP error, published when it gives up its shared-memory half), and
//! reports the rank that verdict names; with no verdict by then, it names the rank on the
//! other host that the peer waits for. So when a host becomes unreachable (its link cut),
//! every rank names a rank across the cut.

use std::sync::Arc;
use std::time::Duration;

use fh_core::{kernels, CoreError, DType, ReduceOp};

use fh_job::hosts::Layout;

mod group;
mod lanes;
mod parts;
mod pipeline;
mod slices;
mod transport;

use crate::backend::shm::{OutsideWord, ShmComm};
use crate::backend::tcp::TcpComm;
use crate::{algorithms, Communicator, Interrupt, Result, Topology, TransportError};
use group::{Group, Marks};
pub(crate) use transport::connect_auto_over;
pub use transport::{connect_auto, host_token, suits, HierTransport};

/// `FH_HIER_STAGED=1`: the communicators do not offer to reduce a fused group where it lies
/// (the engine packs it into its fusion buffer, [`Communicator::segments_in_place`]), and the
/// lanes' allreduce copies each block out of the buffer for the TCP step and back in, as before
/// the steps worked in place: kept only to compare the two in one benchmark run. The rounds on
/// the wire are the same either way, and the engine agrees on nothing that depends on it.
const STAGED_VAR: &str = "FH_HIER_STAGED";

/// A communicator of the hierarchical backend (see the [module documentation](self)).
#[derive(Debug)]
pub struct HierComm {
    label: String,
    tcp: TcpComm,
    shm: ShmComm,
    layout: Arc<Layout>,
    topology: Topology,
    homogeneous: bool,
    /// The global ranks this rank allreduces with across hosts (its lane, or the leaders when
    /// hosts differ in size; empty for a non-leader then), and its index among them.
    group: Vec<usize>,
    group_rank: usize,
    /// The host leaders' global ranks, by host.
    leaders: Vec<usize>,
    /// The host of every global rank.
    host_of: Vec<usize>,
    /// Every global rank (the full world's view, `0..size`).
    all: Vec<usize>,
    /// [`STAGED_VAR`], and the blocks' copies then.
    staged: bool,
    staging: Vec<u8>,
    broken: Option<String>,
    timeout: Duration,
    /// Shared by both halves (see [`HierTransport::open_hier`]).
    interrupt: Interrupt,
    /// This rank's `outside` word in the shared-memory communicator (see [`Marks`]).
    outside: OutsideWord,
    /// The allreduce pipeline's chunk in bytes, 0 for none (agreed with the TCP stream
    /// settings, [`crate::backend::tcp::settings::PIPELINE_VAR`]).
    pipeline_chunk: usize,
}

/// The views of the TCP communicator that a [`HierComm`] runs steps on.
enum View {
    /// This rank's cross-host group: its lane, or the leaders when hosts differ in size.
    Across,
    /// The host leaders.
    Leaders,
    /// Every rank.
    World,
}

/// Which part of the communicator failed.
enum Side {
    Shm,
    Tcp,
}

type Step<T> = std::result::Result<T, (Side, TransportError)>;

fn on_shm<T>(r: Result<T>) -> Step<T> {
    r.map_err(|e| (Side::Shm, e))
}

fn on_tcp<T>(r: Result<T>) -> Step<T> {
    r.map_err(|e| (Side::Tcp, e))
}

impl HierComm {
    /// The label given to [`Transport::open`](crate::Transport::open).
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Run `f`; on failure give up both halves (see *Failures* in the
    /// [module documentation](self)) and make every later call fail.
    fn guarded<T>(&mut self, f: impl FnOnce(&mut Self) -> Step<T>) -> Result<T> {
        if let Some(why) = &self.broken {
            return Err(TransportError::Closed(format!(
                "hierarchical communicator '{}' is unusable after an earlier error: {why}",
                self.label
            )));
        }
        match f(self) {
            Ok(v) => Ok(v),
            // Rejected arguments are detected before anything is sent: nothing to undo.
            Err((
                _,
                err @ (TransportError::InvalidArgument(_)
                | TransportError::Core(CoreError::UnsupportedOp { .. })),
            )) => Err(err),
            // Interrupted (on either side): the cause names the global rank.
            Err((_, err)) if self.interrupt.is_raised() => {
                let err = self.interrupt.cause().map_or(err, |c| c.error());
                Err(self.fail(Side::Tcp, err))
            }
            Err((side, err)) => Err(self.fail(side, err)),
        }
    }

    fn fail(&mut self, side: Side, err: TransportError) -> TransportError {
        let err = match side {
            Side::Shm => {
                let err = self.shm_error_to_global(err);
                self.shm.give_up(None, false, &err.to_string());
                self.tcp.give_up(&err);
                err
            }
            Side::Tcp => {
                let timeout = matches!(err, TransportError::Timeout { .. });
                self.shm
                    .give_up(err.blamed_rank(), timeout, &err.to_string());
                self.tcp.give_up(&err);
                err
            }
        };
        tracing::error!(
            communicator = %self.label,
            rank = self.topology.rank,
            error = %err,
            "hierarchical communicator failed"
        );
        self.broken = Some(err.to_string());
        err
    }

    /// Rewrite an error of the shared-memory communicator (local ranks) in global ranks,
    /// preferring the root cause a local peer recorded when it gave up.
    fn shm_error_to_global(&self, err: TransportError) -> TransportError {
        if let Some((rank, timeout)) = self.shm.external_blame() {
            return if timeout {
                TransportError::Timeout {
                    rank,
                    op: "a collective (another rank gave up waiting for it first)",
                    after: self.timeout,
                }
            } else {
                TransportError::PeerLost {
                    rank,
                    detail: format!(
                        "a rank of this host gave up on communicator '{}' after losing rank \
                         {rank} ({err})",
                        self.label
                    ),
                }
            };
        }
        if let Some(rank) = self.shm.outside_blame() {
            // This rank timed out on a local peer that was (and stayed) waiting across hosts
            // for `rank`, without a verdict: blame that rank, not the live local peer.
            return TransportError::Timeout {
                rank,
                op: "a collective (a rank of this host waited across hosts for it)",
                after: self.timeout,
            };
        }
        let host = &self.layout.hosts()[self.topology.cross_rank];
        let global = |r: usize| host.get(r).copied().unwrap_or(r);
        match err {
            TransportError::PeerLost { rank, detail } => TransportError::PeerLost {
                rank: global(rank),
                detail: format!(
                    "{detail} (local rank {rank} of host {})",
                    self.topology.cross_rank
                ),
            },
            TransportError::Timeout { rank, op, after } => TransportError::Timeout {
                rank: global(rank),
                op,
                after,
            },
            TransportError::Protocol { rank, detail } => TransportError::Protocol {
                rank: global(rank),
                detail,
            },
            other => other,
        }
    }
}

impl HierComm {
    /// Run `f` over a view of the TCP communicator, which marks whom this rank waits for
    /// (see [`Marks`]) until `f` returns.
    fn on_view<T>(&mut self, view: View, f: impl FnOnce(&mut Group<'_>) -> Result<T>) -> Step<T> {
        let (members, rank) = match view {
            View::Across => (&self.group, self.group_rank),
            View::Leaders => (&self.leaders, self.topology.cross_rank),
            View::World => (&self.all, self.topology.rank),
        };
        let mut group = Group {
            inner: &mut self.tcp,
            members,
            rank,
            marks: Marks {
                word: &self.outside,
                host_of: &self.host_of,
                host: self.topology.cross_rank,
            },
        };
        let res = f(&mut group);
        self.shm.waiting_outside(None);
        on_tcp(res)
    }

    /// Run `f` on the full-world TCP communicator itself (point to point, where its own
    /// messages name a bad peer), marking that this rank waits for `peer` (see [`Marks`]).
    fn on_world_p2p<T>(
        &mut self,
        peer: usize,
        f: impl FnOnce(&mut TcpComm) -> Result<T>,
    ) -> Step<T> {
        Marks {
            word: &self.outside,
            host_of: &self.host_of,
            host: self.topology.cross_rank,
        }
        .waiting_for(peer);
        let res = f(&mut self.tcp);
        self.shm.waiting_outside(None);
        on_tcp(res)
    }

    /// Shared-memory broadcast on the root's host, TCP broadcast among the leaders from the
    /// root's host, shared-memory broadcast from the leader on the other hosts.
    fn broadcast_hier(&mut self, buf: &mut [u8], root: usize) -> Step<()> {
        let t = self.topology;
        let (root_host, root_local) = self
            .layout
            .hosts()
            .iter()
            .enumerate()
            .find_map(|(h, ranks)| ranks.iter().position(|&r| r == root).map(|l| (h, l)))
            .ok_or_else(|| {
                (
                    Side::Tcp,
                    TransportError::InvalidArgument(format!("broadcast root {root} is on no host")),
                )
            })?;
        if t.cross_rank == root_host {
            on_shm(self.shm.broadcast(buf, root_local))?;
        }
        if t.local_rank == 0 && self.leaders.len() > 1 {
            self.on_view(View::Leaders, |g| algorithms::broadcast(g, buf, root_host))?;
        }
        if t.cross_rank != root_host {
            on_shm(self.shm.broadcast(buf, 0))?;
        }
        Ok(())
    }

    /// Shared-memory barrier, TCP barrier among the leaders, shared-memory barrier: nobody
    /// leaves before every rank of every host has entered.
    fn barrier_hier(&mut self) -> Step<()> {
        on_shm(self.shm.barrier())?;
        if self.topology.local_rank == 0 && self.leaders.len() > 1 {
            self.on_view(View::Leaders, |g| algorithms::barrier(g))?;
        }
        on_shm(self.shm.barrier())
    }
}

impl Communicator for HierComm {
    fn backend(&self) -> &'static str {
        "hier"
    }

    fn rank(&self) -> usize {
        self.topology.rank
    }

    fn size(&self) -> usize {
        self.topology.size
    }

    fn send(&mut self, peer: usize, data: &[u8]) -> Result<()> {
        self.guarded(|c| c.on_world_p2p(peer, |t| t.send(peer, data)))
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        self.guarded(|c| c.on_world_p2p(peer, |t| t.recv(peer, buf)))
    }

    fn send_recv(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<()> {
        let waits_for = if from == self.topology.rank { to } else { from };
        self.guarded(|c| c.on_world_p2p(waits_for, |t| t.send_recv(to, send, from, recv)))
    }

    fn allreduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        // Check everything up front: past this point an argument error on one rank would
        // leave the others waiting.
        algorithms::check_reduction("allreduce", dtype, op, buf.len())?;
        if self.topology.size == 1 || buf.is_empty() {
            return Ok(());
        }
        let size = self.topology.size;
        let mut finish = |b: &mut [u8]| -> Result<()> {
            if op == ReduceOp::Average {
                kernels::divide(dtype, b, size)?;
            }
            Ok(())
        };
        self.guarded(|c| {
            if c.homogeneous {
                c.allreduce_lanes(vec![buf], dtype, op.combining(), &mut finish)
            } else {
                c.allreduce_leaders(buf, dtype, op)
            }
        })
    }

    fn allreduce_parts(&mut self, buf: &mut [u8], parts: &[algorithms::ReducePart]) -> Result<()> {
        self.allreduce_parts_via_leaders(buf, parts)
    }

    fn parts_in_band(&self) -> bool {
        true
    }

    fn segments_in_place(&self) -> bool {
        self.homogeneous && !self.staged
    }

    fn allreduce_segments(
        &mut self,
        segs: &mut [&mut [u8]],
        dtype: DType,
        op: ReduceOp,
        finish: &mut (dyn FnMut(&mut [u8]) -> Result<()> + Send),
    ) -> Result<()> {
        let mut total = 0;
        for s in segs.iter() {
            total += algorithms::check_reduction("allreduce", dtype, op, s.len())?;
        }
        if self.topology.size == 1 || total == 0 || !self.homogeneous {
            // Packed, as the engine would have, where the lanes do not apply.
            return algorithms::allreduce_segments_packed(self, segs, dtype, op, finish);
        }
        self.guarded(|c| {
            let segs = segs.iter_mut().map(|s| &mut **s).collect();
            c.allreduce_lanes(segs, dtype, op.combining(), finish)
        })
    }

    fn allgatherv(&mut self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<()> {
        self.guarded(|c| c.on_view(View::World, |g| g.allgatherv(send, recv, counts)))
    }

    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<()> {
        crate::algorithms::check_root(root, self.topology.size)?;
        if buf.is_empty() {
            return Ok(());
        }
        self.guarded(|c| c.broadcast_hier(buf, root))
    }

    fn alltoallv(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<()> {
        self.guarded(|c| {
            c.on_view(View::World, |g| {
                g.alltoallv(send, send_counts, recv, recv_counts)
            })
        })
    }

    fn reduce_scatter(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        self.guarded(|c| {
            c.on_view(View::World, |g| {
                g.reduce_scatter(send, recv, counts, dtype, op)
            })
        })
    }

    fn barrier(&mut self) -> Result<()> {
        self.guarded(|c| c.barrier_hier())
    }

    fn abort(&mut self, lost: usize) {
        if self.broken.is_some() {
            return;
        }
        let err = TransportError::PeerLost {
            rank: lost,
            detail: format!("this rank gave up on communicator '{}'", self.label),
        };
        let external = (lost != self.topology.rank).then_some(lost);
        self.shm.give_up(external, false, &err.to_string());
        self.tcp.give_up(&err);
        self.broken = Some(err.to_string());
    }

    fn interrupter(&self) -> Option<Interrupt> {
        Some(self.interrupt.clone())
    }
}
