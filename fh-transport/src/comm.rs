//! The communicator and transport traits.

use fh_core::{kernels, DType, Element, ReduceOp};

pub use fh_job::Topology;

use crate::{algorithms, Result, TransportError};

/// What a communicator carries. A world made of two (`FH_TRANSPORT=CONTROL+DATA`,
/// [`SplitTransport`](crate::compose::split::SplitTransport)) opens each role on its own
/// backend ([`Transport::open_as`]); every other world opens both alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// The engine's negotiation: small messages every cycle.
    Control,
    /// Tensors: the fused collectives.
    Data,
}

/// How a world's data moves between its ranks, as far as the engine's defaults care (e.g.
/// back-pressure on a network).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WireKind {
    /// Through a network stack (TCP, over loopback too, or between hosts): every message pays
    /// system calls and protocol latency.
    Network,
    /// Through one host's memory (shared memory, threads; MPI within a host).
    Memory,
}

/// A world of ranks, able to open independent communicators.
///
/// Opening is collective: every rank must call [`Transport::open`] the same number of times, in
/// the same order; the n-th communicator opened on every rank are connected to each other.
/// Communicators opened from one transport never see each other's messages.
pub trait Transport: Send {
    /// The backend's name (`"local"`, `"tcp"`, `"shm"`, `"mpi"`, ...).
    fn backend(&self) -> &'static str;
    /// This rank's place in the world.
    fn topology(&self) -> Topology;
    /// How this world's data moves ([`Role::Data`]'s communicators).
    fn wire(&self) -> WireKind;
    /// Collectively open a new communicator over all ranks. `label` is used in logs and errors.
    fn open(&mut self, label: &str) -> Result<Box<dyn Communicator>>;

    /// Collectively open a communicator for `role` ([`Transport::open`] for every world but
    /// one made of two, which opens each role on its own backend).
    fn open_as(&mut self, role: Role, label: &str) -> Result<Box<dyn Communicator>> {
        let _ = role;
        self.open(label)
    }

    /// This rank.
    fn rank(&self) -> usize {
        self.topology().rank
    }
    /// Number of ranks.
    fn size(&self) -> usize {
        self.topology().size
    }

    /// Whether [`Transport::open_group`] is supported (the same answer on every rank of a
    /// backend). When it is not, [`crate::compose::subset::open_subset`] carries a subset over world
    /// communicators instead.
    fn can_open_group(&self) -> bool {
        false
    }

    /// Open a communicator over the world ranks `members` (ascending, this rank among them),
    /// numbered by their position: collective among the members only (each must call it the
    /// same number of times for the same list, in the same order); other ranks take no part
    /// and their loss does not disturb it. Errors unless [`Transport::can_open_group`].
    fn open_group(&mut self, label: &str, members: &[usize]) -> Result<Box<dyn Communicator>> {
        Err(TransportError::InvalidArgument(format!(
            "the '{}' backend cannot open '{label}' over the ranks {members:?} alone",
            self.backend()
        )))
    }

    /// The world's liveness watch ([`crate::liveness`]), when its ranks exchange heartbeats
    /// (every backend that starts with the TCP rendezvous, unless turned off); `None` otherwise.
    /// Its verdict raises the interrupt of every communicator the world opened.
    fn liveness(&self) -> Option<crate::liveness::Watch> {
        None
    }

    /// The parallel TCP streams this world's data uses to each peer on another host, and what
    /// they were chosen from ([`crate::backend::tcp::streams`]; the same on every rank), for
    /// logs and reports; `None` where no data goes over TCP between hosts.
    fn stream_choice(&self) -> Option<crate::backend::tcp::StreamChoice> {
        None
    }
}

/// Point-to-point messaging among a fixed group of ranks, and collectives on top of it.
///
/// Messages between a pair of ranks arrive in the order they were sent. A receive names its
/// source and the exact number of bytes expected; a message of another length is a protocol
/// error, never a silent truncation. Every wait is bounded by the backend's timeout, and a peer
/// that disappears is reported as [`TransportError::PeerLost`] naming its rank.
///
/// The collective methods have default implementations in [`algorithms`] written against the
/// point-to-point methods; a backend overrides them only when it has something faster. All
/// collectives must be called by every rank of the communicator, in the same order, with
/// compatible arguments. Buffers hold elements in native byte order.
///
/// Dropping a communicator closes its connections; peers then see `PeerLost`.
pub trait Communicator: Send {
    /// The backend's name.
    fn backend(&self) -> &'static str;
    /// This rank within the communicator.
    fn rank(&self) -> usize;
    /// Number of ranks in the communicator.
    fn size(&self) -> usize;

    /// Send one message to `peer`. Returns once the bytes are handed to the backend (they may
    /// still be in flight). May block while the backend's buffers are full.
    fn send(&mut self, peer: usize, data: &[u8]) -> Result<()>;

    /// Receive one message of exactly `buf.len()` bytes from `peer`.
    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()>;

    /// Send `send` to `to` while receiving `recv.len()` bytes from `from`, without deadlocking
    /// when the peers do the same at once with messages larger than any buffer.
    fn send_recv(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<()>;

    /// Whether [`Communicator::send_recv_vectored`] moves the bytes straight from and into the
    /// caller's slices (`true`: scatter-gather I/O, as TCP's `sendmsg`/`recvmsg`) rather than
    /// through a contiguous copy (the default). Callers use it to choose between reducing a
    /// fused group in place ([`algorithms::allreduce_segments`]) and packing it first: with
    /// the default implementation the in-place path copies more, not less.
    fn vectored_io(&self) -> bool {
        false
    }

    /// [`Communicator::send_recv`] of the concatenation of `send` into the concatenation of
    /// `recv`: the peer sees one message of the total length, exactly as if it had been sent
    /// from one buffer (and a message sent from one buffer may be received in pieces). The
    /// default gathers into and scatters out of a contiguous copy.
    fn send_recv_vectored(
        &mut self,
        to: usize,
        send: &[&[u8]],
        from: usize,
        recv: &mut [&mut [u8]],
    ) -> Result<()> {
        if let ([s], [r]) = (send, &mut *recv) {
            return self.send_recv(to, s, from, r);
        }
        let out = send.concat();
        let mut inc = vec![0u8; recv.iter().map(|r| r.len()).sum()];
        self.send_recv(to, &out, from, &mut inc)?;
        let mut at = 0;
        for r in recv.iter_mut() {
            r.copy_from_slice(&inc[at..at + r.len()]);
            at += r.len();
        }
        Ok(())
    }

    /// Reduce `buf` element-wise across all ranks; every rank ends with the result.
    /// `Average` divides the sum by [`Communicator::size`].
    fn allreduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        algorithms::allreduce(self, buf, dtype, op)
    }

    /// [`Communicator::allreduce`] that also ANDs one flag across the ranks: `Ok(true)` when
    /// every rank passed `mine = true`, and only then is `buf` the reduction. A rank that
    /// cannot contribute passes zeros of the same length and `false`; with `false` agreed,
    /// `buf` holds nothing meaningful and the caller must not use it. The default agrees on
    /// the flag first (a one-byte AND) and reduces only when every rank can; backends whose
    /// allreduce runs over their point-to-point messages carry the flag inside the
    /// reduction's own messages ([`algorithms::allreduce_agreeing`]), one collective for both.
    fn allreduce_agreeing(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        mine: bool,
    ) -> Result<bool> {
        let mut flag = [u8::from(mine)];
        self.allreduce(&mut flag, DType::U8, ReduceOp::BitAnd)?;
        if flag[0] != 1 {
            return Ok(false);
        }
        self.allreduce(buf, dtype, op)?;
        Ok(true)
    }

    /// Whether [`Communicator::allreduce_agreeing`] carries the flag inside the reduction's
    /// own messages (below the ring threshold), so that agreeing costs no extra collective.
    /// `false` by default (the flag is a collective of its own first, which a caller may
    /// rather run where it is cheapest).
    fn agrees_in_band(&self) -> bool {
        false
    }

    /// Allreduce `buf` as consecutive `parts`, each with its own dtype and op (every rank
    /// passes the same parts). Where the allreduce runs over this communicator's own messages
    /// ([`Communicator::agrees_in_band`]) a small buffer is one collective
    /// ([`algorithms::allreduce_parts`]); elsewhere, by default, each part is an allreduce of
    /// its own (a backend with its own small allreduce may do better:
    /// [`Communicator::parts_in_band`]).
    fn allreduce_parts(&mut self, buf: &mut [u8], parts: &[algorithms::ReducePart]) -> Result<()> {
        if self.agrees_in_band() {
            algorithms::allreduce_parts(self, buf, parts)
        } else {
            algorithms::allreduce_each_part(self, buf, parts)
        }
    }

    /// Whether [`Communicator::allreduce_parts`] of a buffer below the ring threshold costs one
    /// collective, whatever the number of parts (by default where
    /// [`Communicator::agrees_in_band`] says so).
    fn parts_in_band(&self) -> bool {
        self.agrees_in_band()
    }

    /// Whether [`Communicator::allreduce_segments`] reduces a fused group where its slices lie
    /// for less than packing it into one buffer and calling [`Communicator::allreduce`] costs:
    /// by default where [`Communicator::vectored_io`] says so (the ring moves the slices
    /// straight to and from the wire); a backend with its own in-place allreduce of slices says
    /// so too.
    fn segments_in_place(&self) -> bool {
        self.vectored_io()
    }

    /// Allreduce the concatenation of `segs` in place, combining with `op` (`Average` combines
    /// as `Sum`: nothing here divides), and apply `finish` exactly once to every byte of the
    /// result (the caller's division and postscale), as
    /// [`algorithms::allreduce_segments`] does, which is the default. Only the total length
    /// must agree across ranks.
    fn allreduce_segments(
        &mut self,
        segs: &mut [&mut [u8]],
        dtype: DType,
        op: ReduceOp,
        finish: &mut (dyn FnMut(&mut [u8]) -> Result<()> + Send),
    ) -> Result<()> {
        algorithms::allreduce_segments(self, segs, dtype, op, finish)
    }

    /// Gather every rank's `send` into `recv`, rank by rank; `counts[r]` is rank r's length in
    /// bytes and `recv.len()` must be their sum.
    fn allgatherv(&mut self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<()> {
        algorithms::allgatherv(self, send, recv, counts)
    }

    /// Copy `root`'s `buf` into every rank's `buf`.
    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<()> {
        algorithms::broadcast(self, buf, root)
    }

    /// Personalised all-to-all: the `send_counts[r]` bytes of `send` at offset
    /// `sum(send_counts[..r])` go to rank r; `recv` receives `recv_counts[r]` bytes from rank r.
    fn alltoallv(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<()> {
        algorithms::alltoallv(self, send, send_counts, recv, recv_counts)
    }

    /// Reduce `send` (the whole vector, identical length on every rank) element-wise and leave
    /// block r of the result on rank r; `counts[r]` is the number of *elements* in block r and
    /// `recv` must hold `counts[rank]` elements. `Average` divides by the size.
    fn reduce_scatter(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        algorithms::reduce_scatter(self, send, recv, counts, dtype, op)
    }

    /// Return once every rank has entered the barrier.
    fn barrier(&mut self) -> Result<()> {
        algorithms::barrier(self)
    }

    /// Give up on this communicator because rank `lost` failed or left (numbered as this
    /// communicator's errors name ranks; this rank itself when it is the one failing): peers
    /// waiting for this rank fail at once, or when they next wait for it, naming `lost`
    /// rather than this rank, so that a rank that stops because of another is never blamed
    /// for it. The communicator is unusable afterwards. The default does nothing: peers then
    /// blame this rank when the communicator is dropped.
    fn abort(&mut self, lost: usize) {
        let _ = lost;
    }

    /// The [`Interrupt`](crate::Interrupt) this communicator's waits watch: raised from any
    /// thread, it ends the operation in progress (and every later one) with the error it
    /// names, as if the communicator had lost that rank itself — peers are told whom to
    /// blame. `None` when the backend's waits cannot be interrupted (they end at their
    /// timeout).
    fn interrupter(&self) -> Option<crate::Interrupt> {
        None
    }
}

/// Convenience forms of the collectives, available on every [`Communicator`]
/// (including `dyn Communicator`).
pub trait CollectivesExt: Communicator {
    /// Allreduce with pre- and post-scaling: every input is multiplied by `prescale` before the
    /// reduction and the result by `postscale` after it (Horovod's `prescale_factor` /
    /// `postscale_factor`).
    fn allreduce_scaled(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        prescale: f64,
        postscale: f64,
    ) -> Result<()> {
        kernels::scale(dtype, buf, prescale)?;
        self.allreduce(buf, dtype, op)?;
        kernels::scale(dtype, buf, postscale)?;
        Ok(())
    }

    /// Allreduce `send` into `recv`, leaving `send` untouched.
    fn allreduce_into(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        if send.len() != recv.len() {
            return Err(TransportError::InvalidArgument(format!(
                "allreduce_into: send has {} bytes but recv has {}",
                send.len(),
                recv.len()
            )));
        }
        recv.copy_from_slice(send);
        self.allreduce(recv, dtype, op)
    }

    /// Typed in-place allreduce.
    fn allreduce_typed<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.allreduce(bytemuck::cast_slice_mut(buf), T::DTYPE, op)
    }

    /// Allgather with the same length on every rank: `recv.len()` must be
    /// `send.len() * size`.
    fn allgather(&mut self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let counts = vec![send.len(); self.size()];
        self.allgatherv(send, recv, &counts)
    }

    /// Alltoall with equal blocks: `send` and `recv` are split into `size` equal blocks.
    fn alltoall(&mut self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let n = self.size();
        if send.len() % n != 0 || recv.len() != send.len() {
            return Err(TransportError::InvalidArgument(format!(
                "alltoall: {} bytes cannot be split into {n} equal blocks (recv has {} bytes)",
                send.len(),
                recv.len()
            )));
        }
        let counts = vec![send.len() / n; n];
        self.alltoallv(send, &counts, recv, &counts)
    }
}

impl<C: Communicator + ?Sized> CollectivesExt for C {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn communicator_is_object_safe_and_send() {
        fn takes(_: &mut dyn Communicator) {}
        fn is_send<T: Send>() {}
        is_send::<Box<dyn Communicator>>();
        is_send::<Box<dyn Transport>>();
        let _ = takes;
    }
}
