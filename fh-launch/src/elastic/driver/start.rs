//! Starting workers: a part on each usable host that runs none, up to `--max-np` (at first,
//! once the hosts offer `-np` slots), each worker with Horovod's launch variables for its
//! place in the world that forms when it registers.

use std::time::Instant;

use super::super::generation::{self, Candidate};
use super::super::workers::PartProc;
use super::{Driver, Worker};
use crate::guardian::Guardian;
use crate::hosts::{self, Host};

impl Driver {
    /// Start parts on the usable hosts that run none, up to `--max-np` workers (at first,
    /// once the hosts offer `-np` slots).
    pub(super) fn start_workers(&mut self, now: Instant, guardian: &mut Option<&mut Guardian>) {
        if self.stopping_all.is_some() || self.finishing.is_some() || !self.discovered_once {
            return;
        }
        let usable: Vec<Host> = self.hosts.usable().into_iter().cloned().collect();
        let cap = self.s.max_np.unwrap_or(usize::MAX);
        if !self.started {
            let slots: usize = usable.iter().map(|h| h.slots).sum();
            let want = self.s.initial_np.min(cap);
            if slots < want {
                if now >= self.began + self.s.elastic_timeout {
                    self.fail(format!(
                        "the host discovery script offers {slots} slots, fewer than the {want} \
                         to start with (-np, default --min-np), after --elastic-timeout {} s",
                        self.s.elastic_timeout.as_secs_f64()
                    ));
                }
                return;
            }
            self.started = true;
        }
        // The workers to start now, host by host.
        let mut alive = self.workers.iter().filter(|w| self.expected(w)).count();
        let mut to_start: Vec<(Host, usize, bool)> = Vec::new();
        for h in usable {
            if self.parts.iter().any(|p| p.host == h.name && p.running()) {
                continue;
            }
            let n = h.slots.min(cap.saturating_sub(alive));
            if n == 0 {
                continue;
            }
            let local = hosts::is_local(&h.name, &self.hostname);
            if !local && self.s.loopback {
                self.lose_host(
                    &h.name,
                    "it is not this machine, and fhrun's elastic listener is on 127.0.0.1 \
                     because every host was local at the start"
                        .into(),
                );
                continue;
            }
            alive += n;
            to_start.push((h, n, local));
        }
        if to_start.is_empty() {
            return;
        }
        let env = self.horovod_env(&to_start);
        for (h, n, local) in to_start {
            let ids: Vec<String> = (0..n).map(|s| format!("{}:{s}", h.name)).collect();
            let workers: Vec<(String, Vec<(String, String)>)> = ids
                .iter()
                .map(|id| (id.clone(), env.get(id).cloned().unwrap_or_default()))
                .collect();
            let index = self.parts.len();
            match PartProc::start(&self.ctx, &h.name, local, workers, index, &self.exits_tx) {
                Ok(part) => {
                    if let Some(g) = guardian.as_mut() {
                        g.watch(part.pid);
                    }
                    if self.ctx.verbose {
                        eprintln!(
                            "fhrun: started {} on {} (pid {})",
                            ids.join(", "),
                            h.name,
                            part.pid
                        );
                    }
                    self.parts.push(part);
                    for (slot, id) in ids.into_iter().enumerate() {
                        self.workers.push(Worker {
                            id,
                            host: h.name.clone(),
                            part: index,
                            slot,
                            rank: None,
                            registered: None,
                            started: now,
                            session_closed: None,
                            end: None,
                            removed: false,
                        });
                    }
                }
                Err(e) => self.lose_host(&h.name, e),
            }
        }
    }

    /// Horovod's launch variables for the workers about to start (`HOROVOD_RANK`, `_SIZE`,
    /// `LOCAL_*`, `CROSS_*`), as horovodrun gives them: each worker's place in the world that
    /// forms when every expected worker and these register (survivors keep their order). A
    /// script reads them before `init()` to pick a device or a log file; the world itself, and
    /// every later one, comes from the driver.
    fn horovod_env(
        &self,
        to_start: &[(Host, usize, bool)],
    ) -> std::collections::HashMap<String, Vec<(String, String)>> {
        let mut candidates: Vec<Candidate> = self
            .workers
            .iter()
            .filter(|w| self.expected(w))
            .map(|w| Candidate {
                id: w.id.clone(),
                host: w.host.clone(),
                slot: w.slot,
                previous: w.rank,
                host_order: self.hosts.order(&w.host),
            })
            .collect();
        for (h, n, _) in to_start {
            for slot in 0..*n {
                candidates.push(Candidate {
                    id: format!("{}:{slot}", h.name),
                    host: h.name.clone(),
                    slot,
                    previous: None,
                    host_order: self.hosts.order(&h.name),
                });
            }
        }
        generation::plan(candidates, self.s.max_np)
            .members
            .into_iter()
            .map(|(id, _, t)| {
                let vars = [
                    ("HOROVOD_RANK", t.rank),
                    ("HOROVOD_SIZE", t.size),
                    ("HOROVOD_LOCAL_RANK", t.local_rank),
                    ("HOROVOD_LOCAL_SIZE", t.local_size),
                    ("HOROVOD_CROSS_RANK", t.cross_rank),
                    ("HOROVOD_CROSS_SIZE", t.cross_size),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
                (id, vars)
            })
            .collect()
    }
}
