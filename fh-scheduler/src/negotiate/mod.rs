//! The negotiation steps a round may take besides the bit-vector allreduce, each a function of
//! what the ranks exchanged (and so the same on every rank), testable on its own:
//!
//! - [`collect`]: moving variable-length byte lists between ranks (gather to rank 0, allgather),
//!   with every length from a peer checked before anything is allocated;
//! - [`coordinator`]: rank 0's table of uncached requests, turned into responses once every
//!   rank (that has not joined) asked;
//! - [`stall`]: which names some ranks have submitted and others have not, for how long;
//! - [`fault`]: the agreed error when a rank cannot run a negotiated tensor;
//! - [`shutdown`]: which ranks asked for an agreed shutdown, and why;
//! - [`readiness`]: rank 0's record, while it writes a timeline, of when each rank had each
//!   tensor ready (from the readiness reports).
//!
//! The control loop (`control.rs`) runs a round and calls these; none of them imports it.

pub(crate) mod collect;
pub(crate) mod coordinator;
pub(crate) mod fault;
pub(crate) mod readiness;
pub(crate) mod shutdown;
pub(crate) mod stall;
