//! Registration rounds: a generation is formed when every expected worker has registered (a
//! worker that does not within `--start-timeout` is lost), never without a member of the last
//! one; the job fails at once when every member of the last world has ended, and ends when
//! one worker exits 0.

use std::time::Instant;

use fh_job::elastic::{Assignment, Membership};

use super::super::generation::{self, Candidate};
use super::super::workers::{End, PartProc};
use super::Driver;

impl Driver {
    pub(super) fn rounds(&mut self, now: Instant) {
        if self.stopping_all.is_some() || self.finishing.is_some() {
            return;
        }
        let any = self
            .workers
            .iter()
            .any(|w| w.registered.is_some() && self.expected(w));
        if self.round.is_none() && any {
            self.round = Some(now);
        }
        let Some(began) = self.round else {
            return;
        };
        // A worker has --start-timeout (or --elastic-timeout, if longer) to register, from its
        // start or from the round's, whichever is later: a new worker's interpreter and
        // imports, a survivor's way to its next collective. One that does not is lost.
        let bound = self.s.start_timeout.max(self.s.elastic_timeout);
        let late: Vec<usize> = (0..self.workers.len())
            .filter(|&i| {
                let w = &self.workers[i];
                self.expected(w) && w.registered.is_none() && now >= began.max(w.started) + bound
            })
            .collect();
        for i in late {
            let why = self.describe_loss(
                &self.workers[i],
                &format!(
                    "did not register within {} s (--start-timeout {} s, --elastic-timeout {} s)",
                    bound.as_secs_f64(),
                    self.s.start_timeout.as_secs_f64(),
                    self.s.elastic_timeout.as_secs_f64()
                ),
            );
            let host = self.workers[i].host.clone();
            self.lose_host(&host, why);
        }
        let expected: Vec<usize> = (0..self.workers.len())
            .filter(|&i| self.expected(&self.workers[i]))
            .collect();
        let registered = expected
            .iter()
            .filter(|&&i| self.workers[i].registered.is_some())
            .count();
        if registered < expected.len() {
            return;
        }
        if registered >= self.s.min_np.max(1) {
            return self.form();
        }
        // Everyone registered, but too few: new hosts may still come within --elastic-timeout.
        if now >= began + self.s.elastic_timeout {
            self.fail(format!(
                "fewer than --min-np {} ranks remain ({})",
                self.s.min_np,
                self.lost_list()
            ));
        }
    }

    fn form(&mut self) {
        self.round = None;
        if let (Some(limit), Some(_)) = (self.s.reset_limit, self.generation) {
            if self.resets >= limit {
                return self.fail(format!(
                    "--reset-limit {limit} reached: the world was re-formed {} times and may not be \
                     again ({})",
                    self.resets,
                    self.lost_list()
                ));
            }
        }
        let candidates: Vec<Candidate> = self
            .workers
            .iter()
            .filter(|w| self.expected(w) && w.registered.is_some())
            .map(|w| Candidate {
                id: w.id.clone(),
                host: w.host.clone(),
                slot: w.slot,
                previous: w.rank,
                host_order: self.hosts.order(&w.host),
            })
            .collect();
        // The state is synchronised from the new rank 0, the lowest survivor: a world without
        // a member of the last one would start training over from the script's initial
        // state (Horovod refuses too: "No hosts from previous set remaining").
        if let Some(g) = self.generation {
            if !candidates.iter().any(|c| c.previous.is_some()) {
                return self.fail(format!(
                    "no worker of generation {g} remains to synchronise the training state from, \
                     and the new workers ({}) hold none ({})",
                    candidates
                        .iter()
                        .map(|c| c.id.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                    self.lost_list()
                ));
            }
        }
        let plan = generation::plan(candidates, self.s.max_np);
        let g = match self.generation {
            Some(g) => {
                self.resets += 1;
                g + 1
            }
            None => 0,
        };
        self.generation = Some(g);
        let rank0 = plan.members.first().and_then(|m| self.find(&m.0));
        let rendezvous = rank0
            .and_then(|i| self.workers[i].registered.clone())
            .unwrap_or_default();
        for w in &mut self.workers {
            w.rank = None;
        }
        for (id, _, topology) in &plan.members {
            let a = Assignment {
                generation: g,
                topology: *topology,
                rendezvous: rendezvous.clone(),
                hosts_stamp: self.hosts.stamp(),
            };
            // A worker gone meanwhile makes the world fail and re-form: nothing to do here.
            let _ = self.server.answer(id, &Membership::Member(a));
            if let Some(i) = self.find(id) {
                self.workers[i].rank = Some(topology.rank);
            }
        }
        for id in &plan.above_max {
            let why = format!("above --max-np {}", self.s.max_np.unwrap_or(0));
            let _ = self.server.answer(id, &Membership::Removed(why));
            if let Some(i) = self.find(id) {
                self.workers[i].removed = true;
            }
        }
        for w in &mut self.workers {
            w.registered = None;
        }
        let mut on: Vec<&str> = Vec::new();
        for (_, host, _) in &plan.members {
            if !on.contains(&host.as_str()) {
                on.push(host);
            }
        }
        let lost = if self.lost_since.is_empty() {
            String::new()
        } else {
            let l: Vec<String> = self
                .lost_since
                .iter()
                .map(|(h, why)| format!("{h}: {why}"))
                .collect();
            format!(" (lost {})", l.join(", "))
        };
        eprintln!(
            "fhrun: generation {g}: {} rank{} on {}{lost}",
            plan.members.len(),
            if plan.members.len() == 1 { "" } else { "s" },
            on.join(", ")
        );
        self.lost_since.clear();
        // Parts on hosts no longer usable have no member left: stop them.
        let now = Instant::now();
        for p in 0..self.parts.len() {
            if self.parts[p].running() && !self.hosts.is_usable(&self.parts[p].host.clone()) {
                self.parts[p].stop(now);
            }
        }
    }

    pub(super) fn starvation(&mut self, now: Instant) {
        // Every worker started so far ended, in failure, before the first world formed: the
        // command cannot run (a typo, a missing module), and waiting --elastic-timeout for
        // hosts that would run it the same way helps nobody.
        if self.stopping_all.is_none()
            && self.generation.is_none()
            && !self.workers.is_empty()
            && self
                .workers
                .iter()
                .all(|w| w.end.is_some_and(|e| !e.success()))
        {
            return self.fail(format!(
                "every worker ended before the first world formed ({}); does the command run \
                 on its own? (its output is above)",
                self.lost_list()
            ));
        }
        // Every member of the last world has ended (none with success: that would be the
        // job's end): nobody holds the training state any more, and new hosts could only
        // start it over. Fail at once, as Horovod does when every worker failed.
        if self.stopping_all.is_none() && self.finishing.is_none() {
            if let Some(g) = self.generation {
                let mut members = self.workers.iter().filter(|w| w.rank.is_some()).peekable();
                if members.peek().is_some() && members.all(|w| w.end.is_some()) {
                    return self.fail(format!(
                        "every rank of generation {g} has ended, so no worker holds the \
                         training state any more ({})",
                        self.lost_list()
                    ));
                }
            }
        }
        if self.stopping_all.is_some()
            || self.finishing.is_some()
            || !self.started
            || self.round.is_some()
        {
            self.starve = None;
            return;
        }
        let alive = self.workers.iter().filter(|w| self.expected(w)).count();
        if alive >= self.s.min_np {
            self.starve = None;
            return;
        }
        let at = *self.starve.get_or_insert(now + self.s.elastic_timeout);
        if now >= at {
            self.fail(format!(
                "fewer than --min-np {} ranks remain ({})",
                self.s.min_np,
                self.lost_list()
            ));
        }
    }

    /// The job's status once every worker has ended, if it has.
    pub(super) fn finished(&self) -> Option<i32> {
        if self.parts.iter().any(PartProc::running) {
            return None;
        }
        if let Some(code) = self.stopping_all {
            return Some(code);
        }
        if !self.started {
            return None;
        }
        self.finishing.as_ref()?;
        let clean = self
            .workers
            .iter()
            .filter(|w| w.rank.is_some())
            .all(|w| w.end.is_some_and(End::success));
        if clean {
            Some(0)
        } else {
            eprintln!(
                "fhrun: elastic job failed: not every worker of the last generation exited 0 ({})",
                self.lost_list()
            );
            Some(1)
        }
    }
}
