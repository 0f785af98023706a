//! # fh-scheduler
//!
//! The FastHorovod engine (work in progress: see the scheduler issue). It will own the enqueue
//! API and handles, readiness negotiation, fusion and parallel dispatch over channels.
//!
//! **Invariant:** it reaches the network only through `fh-transport`'s traits and knows nothing
//! of Python.
#![deny(missing_docs)]
