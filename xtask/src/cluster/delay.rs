//! Round-trip time for an emulated cluster, without `sch_netem` (this kernel has none): every
//! IP packet a host receives on `eth0` goes to an NFQUEUE (an iptables rule in the host's
//! namespace, `-j NFQUEUE --queue-num 0 --queue-bypass`; this kernel's nftables has no `queue`
//! expression, its xtables compatibility runs the target), where a thread of this process, moved into the host's
//! network namespace, holds it for half the round-trip time and then lets it in. Packets are
//! released in the order they came (a fixed delay never reorders), as metadata only (the
//! payload stays in the kernel), GSO packets whole.
//!
//! The thread polls the queue (the `nfq` crate gives no descriptor to wait on): when nothing
//! is due it sleeps [`IDLE_NAP`], so a packet waits at most that much longer than the delay.
//! It ends when its [`Delayer`] is dropped; its held packets are then dropped by the kernel (the
//! cluster is going away). If it stops early, `bypass` lets packets through undelayed.

use std::fs::File;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long the thread sleeps when no packet is due and none came.
const IDLE_NAP: Duration = Duration::from_micros(50);

/// The NFQUEUE number the rules send packets to (each namespace has its own).
pub(crate) const QUEUE: u16 = 0;

/// The delaying threads of a cluster's hosts; dropping it stops them.
#[derive(Default)]
pub(crate) struct Delayer {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Delayer {
    /// Starts a thread that holds every packet queued in network namespace `ns` for `delay`;
    /// returns once the queue is bound (so rules sending packets to it can be loaded).
    pub(crate) fn add(&mut self, ns: &str, delay: Duration) -> Result<(), String> {
        let path = ["/run/netns", "/var/run/netns"]
            .iter()
            .map(|d| std::path::Path::new(d).join(ns))
            .find(|p| p.exists())
            .ok_or(format!("no /run/netns/{ns} to enter"))?;
        let file = File::open(&path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
        let stop = self.stop.clone();
        let name = ns.to_string();
        let thread = std::thread::Builder::new()
            .name(format!("delay-{ns}"))
            .spawn(move || {
                let queue = enter_and_bind(&file);
                match queue {
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("{name}: {e}")));
                    }
                    Ok(q) => {
                        let _ = ready_tx.send(Ok(()));
                        hold(q, delay, &stop);
                    }
                }
            })
            .map_err(|e| format!("cannot start the delaying thread: {e}"))?;
        self.threads.push(thread);
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| format!("the delaying thread for {ns} did not start"))?
    }
}

impl Drop for Delayer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Moves this thread into the network namespace `netns` and binds its NFQUEUE [`QUEUE`].
fn enter_and_bind(netns: &File) -> Result<nfq::Queue, String> {
    use std::os::fd::AsFd;
    rustix::thread::move_into_link_name_space(
        netns.as_fd(),
        Some(rustix::thread::LinkNameSpaceType::Network),
    )
    .map_err(|e| format!("cannot enter the host's network namespace: {e}"))?;
    let mut q = nfq::Queue::open().map_err(|e| format!("cannot open an NFQUEUE socket: {e}"))?;
    q.bind(QUEUE)
        .map_err(|e| format!("cannot bind NFQUEUE {QUEUE}: {e}"))?;
    // Metadata only, GSO packets whole, and never a packet lost to a full queue.
    q.set_copy_range(QUEUE, 0)
        .and_then(|()| q.set_recv_gso(QUEUE, true))
        .and_then(|()| q.set_queue_max_len(QUEUE, 65536))
        .and_then(|()| q.set_fail_open(QUEUE, true))
        .map_err(|e| format!("cannot configure NFQUEUE {QUEUE}: {e}"))?;
    q.set_nonblocking(true);
    Ok(q)
}

/// Holds each packet of `q` for `delay`, in arrival order, until `stop`.
fn hold(mut q: nfq::Queue, delay: Duration, stop: &AtomicBool) {
    let mut held: std::collections::VecDeque<(Instant, nfq::Message)> = Default::default();
    while !stop.load(Ordering::Relaxed) {
        let mut came = false;
        loop {
            match q.recv() {
                Ok(mut m) => {
                    m.set_verdict(nfq::Verdict::Accept);
                    held.push_back((Instant::now() + delay, m));
                    came = true;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(_) => return,
            }
        }
        let now = Instant::now();
        while held.front().is_some_and(|(due, _)| *due <= now) {
            if let Some((_, m)) = held.pop_front() {
                if q.verdict(m).is_err() {
                    return;
                }
            }
        }
        if !came {
            let nap = held
                .front()
                .map_or(IDLE_NAP, |(due, _)| due.saturating_duration_since(now))
                .min(IDLE_NAP);
            std::thread::sleep(nap);
        }
    }
}
