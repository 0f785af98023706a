//! The elastic driver's loop: hosts from discovery, parts started and stopped, workers'
//! registrations gathered into generations ([`rounds`]), workers started with Horovod's
//! variables ([`start`]), failures blacklisting hosts, the job's end.

mod rounds;
mod start;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use fh_job::elastic::{Event, Membership, Server};

use super::discovery::Discovery;
use super::state::{Change, HostState};
use super::workers::{End, Exit, PartContext, PartProc, Report};
use crate::guardian::Guardian;
use crate::hosts::{self, Host};
use crate::launch::{EXIT_TIMEOUT, RECORD_WINDOW};
use crate::sys;

/// The driver's settings, from the flags.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `--min-np`.
    pub min_np: usize,
    /// `--max-np`.
    pub max_np: Option<usize>,
    /// `-np`: workers to wait for before the first world.
    pub initial_np: usize,
    /// `--elastic-timeout`: how long to wait for hosts.
    pub elastic_timeout: Duration,
    /// `--start-timeout`: how long a worker has to register (or `elastic_timeout`, if longer).
    pub start_timeout: Duration,
    /// `--reset-limit`.
    pub reset_limit: Option<u32>,
    /// `--timeout` of the whole job.
    pub timeout: Option<Duration>,
    /// Whether the session listener is on loopback (every host was this machine at start):
    /// other hosts cannot reach it.
    pub loopback: bool,
}

struct Worker {
    id: String,
    host: String,
    part: usize,
    slot: usize,
    /// Its rank in the last generation, when it is a member of it.
    rank: Option<usize>,
    registered: Option<String>,
    /// When its part was started.
    started: Instant,
    session_closed: Option<Instant>,
    end: Option<End>,
    removed: bool,
}

/// The driver.
pub struct Driver {
    s: Settings,
    ctx: PartContext,
    server: Server,
    hosts: HostState,
    hostname: String,
    parts: Vec<PartProc>,
    workers: Vec<Worker>,
    exits_tx: mpsc::Sender<(usize, Report)>,
    exits: mpsc::Receiver<(usize, Report)>,
    generation: Option<u64>,
    resets: u32,
    round: Option<Instant>,
    starve: Option<Instant>,
    /// Hosts lost since the last generation, and over the whole job: (host, why).
    lost_since: Vec<(String, String)>,
    lost_all: Vec<(String, String)>,
    began: Instant,
    /// When `--timeout` passed (the workers were asked for their records then).
    timed_out_at: Option<Instant>,
    started: bool,
    /// Why the job is finishing (a worker exited 0): no worker starts or joins any more, and
    /// no world forms.
    finishing: Option<String>,
    discovered_once: bool,
    last_discovery_error: Option<String>,
    /// Stopping everything; fhrun's exit status when the parts have ended.
    stopping_all: Option<i32>,
}

/// How long a worker whose session ended may take to report its exit before it counts lost.
const SESSION_GRACE: Duration = Duration::from_secs(2);

/// How long a reaped part's last exit reports may take to come through its stdout (held open
/// only by a process the part left behind) before its workers count as ended with it.
const REPORTS_GRACE: Duration = Duration::from_secs(5);

impl Driver {
    /// A driver serving `server`, starting parts with `ctx`.
    pub fn new(
        s: Settings,
        ctx: PartContext,
        server: Server,
        cooldown: Option<(u64, u64)>,
    ) -> Self {
        let (exits_tx, exits) = mpsc::channel();
        Driver {
            s,
            ctx,
            server,
            hosts: HostState::new(cooldown),
            hostname: hosts::this_hostname(),
            parts: Vec::new(),
            workers: Vec::new(),
            exits_tx,
            exits,
            generation: None,
            resets: 0,
            round: None,
            starve: None,
            lost_since: Vec::new(),
            lost_all: Vec::new(),
            began: Instant::now(),
            timed_out_at: None,
            started: false,
            finishing: None,
            discovered_once: false,
            last_discovery_error: None,
            stopping_all: None,
        }
    }

    fn publish(&self, change: Option<Change>) {
        if let Some(c) = change {
            self.server.set_hosts(c.stamp, c.added, c.removed);
        }
    }

    /// Take a discovery result.
    pub fn discovered(&mut self, found: Result<Vec<Host>, String>) {
        match found {
            Ok(hosts) => {
                self.discovered_once = true;
                self.last_discovery_error = None;
                let c = self.hosts.discovered(hosts);
                self.publish(c);
            }
            Err(e) if !self.discovered_once => self.fail(e),
            Err(e) => {
                if self.last_discovery_error.as_ref() != Some(&e) {
                    eprintln!("fhrun: warning: {e}; keeping the hosts found before");
                    self.last_discovery_error = Some(e);
                }
            }
        }
    }

    fn alive(&self, w: &Worker) -> bool {
        w.end.is_none() && self.parts[w.part].running()
    }

    fn expected(&self, w: &Worker) -> bool {
        self.alive(w)
            && !w.removed
            && self.parts[w.part].stopping.is_none()
            && self.hosts.is_usable(&w.host)
    }

    /// The live worker with this id (a worker restarted on a host keeps its id: the record of
    /// the one that ended is never the one a session, a registration or a rank belongs to).
    fn find(&self, id: &str) -> Option<usize> {
        self.workers
            .iter()
            .rposition(|w| w.id == id && w.end.is_none() && self.parts[w.part].running())
    }

    fn describe_loss(&self, w: &Worker, what: &str) -> String {
        match w.rank {
            Some(r) => format!("rank {r} {what}"),
            None => format!("worker {} {what}", w.id),
        }
    }

    /// `host` is lost because `why`: blacklisted (once) and its workers stopped.
    fn lose_host(&mut self, host: &str, why: String) {
        let now = Instant::now();
        if !self.hosts.is_blacklisted(host) {
            let (c, cooldown) = self.hosts.blacklist(host, now, uniform);
            self.publish(c);
            let until = match cooldown {
                Some(d) => format!("for {} s", d.as_secs()),
                None => "for the rest of the job".into(),
            };
            eprintln!("fhrun: lost {host} ({why}); blacklisted {until}");
            self.lost_since.push((host.to_string(), why.clone()));
            self.lost_all.push((host.to_string(), why));
        }
        for p in self.parts.iter_mut().filter(|p| p.host == host) {
            p.stop(now);
        }
    }

    fn lost_list(&self) -> String {
        if self.lost_all.is_empty() {
            return "no host was lost".into();
        }
        let l: Vec<String> = self
            .lost_all
            .iter()
            .map(|(h, why)| format!("{h} ({why})"))
            .collect();
        format!("lost: {}", l.join(", "))
    }

    /// The job cannot go on: say why, tell the waiting workers, stop everything.
    fn fail(&mut self, why: String) {
        if self.stopping_all.is_some() {
            return;
        }
        eprintln!("fhrun: elastic job failed: {why}");
        for w in &self.workers {
            if w.registered.is_some() && w.end.is_none() {
                let _ = self.server.answer(&w.id, &Membership::Failed(why.clone()));
            }
        }
        self.stop_all(1, libc::SIGTERM);
    }

    /// Stop every part with `sig`; fhrun exits with `code` once they have ended.
    /// Passes `SIGUSR1` to every running part that is not stopping, which passes it to its
    /// workers; returns how many parts it reached.
    fn ask_for_records(&mut self) -> usize {
        let mut asked = 0;
        for p in &mut self.parts {
            if p.stopping.is_none() && p.running() {
                p.signal(libc::SIGUSR1);
                asked += 1;
            }
        }
        asked
    }

    fn stop_all(&mut self, code: i32, sig: i32) {
        self.stopping_all = Some(code);
        let now = Instant::now();
        for p in &mut self.parts {
            p.stop_with(now, sig);
        }
    }

    fn on_event(&mut self, e: Event) {
        match e {
            Event::Connected { worker } => {
                if self.ctx.verbose {
                    eprintln!("fhrun: worker {worker} connected");
                }
            }
            Event::HostUpdatesAsked { .. } => {}
            Event::Closed { worker, .. } => {
                if let Some(i) = self.find(&worker) {
                    self.workers[i].session_closed = Some(Instant::now());
                    self.workers[i].registered = None;
                }
            }
            Event::Registered { worker, candidate } => {
                let Some(i) = self.find(&worker) else {
                    let why = format!("fhrun does not know a running worker {worker}");
                    let _ = self.server.answer(&worker, &Membership::Removed(why));
                    return;
                };
                let host = self.workers[i].host.clone();
                if self.stopping_all.is_some() {
                    let why = "the job is stopping".to_string();
                    let _ = self.server.answer(&worker, &Membership::Failed(why));
                } else if let Some(why) = self.finishing.clone() {
                    // The job has ended for one of its workers: a world formed now would
                    // train again from a state nobody holds any more (Horovod's driver stops
                    // the job at its first successful exit).
                    let _ = self.server.answer(&worker, &Membership::Removed(why));
                    self.workers[i].removed = true;
                    self.stop_idle_part(self.workers[i].part);
                } else if !self.hosts.is_usable(&host) || self.workers[i].removed {
                    let why = if self.hosts.is_blacklisted(&host) {
                        format!("host {host} is blacklisted")
                    } else if self.workers[i].removed {
                        format!("worker {worker} was removed")
                    } else {
                        format!("host {host} is no longer listed by the host discovery script")
                    };
                    let _ = self.server.answer(&worker, &Membership::Removed(why));
                    self.workers[i].removed = true;
                    self.stop_idle_part(self.workers[i].part);
                } else {
                    self.workers[i].registered = Some(candidate);
                }
            }
        }
    }

    /// Stop a part whose every live worker was removed.
    fn stop_idle_part(&mut self, part: usize) {
        let idle = self
            .workers
            .iter()
            .filter(|w| w.part == part && w.end.is_none())
            .all(|w| w.removed);
        if idle {
            self.parts[part].stop(Instant::now());
        }
    }

    /// Take the parts' reports that have come; with `until: Some((part, deadline))`, wait
    /// (up to the deadline) for that part's stdout to end, so that every report it wrote is
    /// taken.
    fn take_reports(&mut self, until: Option<(usize, Instant)>) {
        loop {
            let next = match until {
                Some((p, deadline)) if !self.parts[p].reports_closed => self
                    .exits
                    .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                    .ok(),
                _ => self.exits.try_recv().ok(),
            };
            match next {
                Some((part, Report::Exit(e))) => self.on_exit(part, e),
                Some((part, Report::Closed)) => self.parts[part].reports_closed = true,
                None => return,
            }
        }
    }

    fn on_exit(&mut self, part: usize, e: Exit) {
        let Some(i) = self
            .workers
            .iter()
            .position(|w| w.part == part && w.id == e.worker && w.end.is_none())
        else {
            // Unknown, or a second report of an end already recorded.
            return;
        };
        self.workers[i].end = Some(e.end);
        let w = &self.workers[i];
        if e.end.success() {
            // A worker that ends its script with success ends the job (as in Horovod: the
            // first success stops the driver), unless fhrun sent it away: a member of the
            // last world, or a worker that exited 0 before joining any (its command does not
            // train elastically: restarting it would run it again).
            if !w.removed && self.parts[part].stopping.is_none() && self.finishing.is_none() {
                let who = match w.rank {
                    Some(r) => format!("worker {} (rank {r})", w.id),
                    None => format!("worker {}", w.id),
                };
                self.finish(format!("the job is finishing: {who} exited 0"));
            }
        } else if !w.removed && self.parts[part].stopping.is_none() {
            let why = self.describe_loss(w, &e.end.describe());
            let host = w.host.clone();
            self.lose_host(&host, why);
        }
    }

    /// The job is finishing because `why`: no worker starts or joins any more, the parts with
    /// no member of the last world are stopped, and the job ends when every part has.
    fn finish(&mut self, why: String) {
        let mut turned_away: Vec<String> = Vec::new();
        for i in 0..self.workers.len() {
            let w = &self.workers[i];
            if w.registered.is_some() && w.end.is_none() && !w.removed {
                let _ = self.server.answer(&w.id, &Membership::Removed(why.clone()));
                turned_away.push(w.id.clone());
                self.workers[i].registered = None;
                self.workers[i].removed = true;
            }
        }
        self.round = None;
        let now = Instant::now();
        for p in 0..self.parts.len() {
            let has_member = self
                .workers
                .iter()
                .any(|w| w.part == p && w.rank.is_some() && w.end.is_none());
            if self.parts[p].running() && !has_member {
                self.parts[p].stop(now);
                let more: Vec<String> = self
                    .workers
                    .iter()
                    .filter(|w| w.part == p && w.end.is_none() && !turned_away.contains(&w.id))
                    .map(|w| w.id.clone())
                    .collect();
                turned_away.extend(more);
            }
        }
        if self.generation.is_none() || self.ctx.verbose || !turned_away.is_empty() {
            let stopped = if turned_away.is_empty() {
                String::new()
            } else {
                format!(
                    " (stopping {}, which joined no world)",
                    turned_away.join(", ")
                )
            };
            eprintln!("fhrun: {why}; no new world forms{stopped}");
        }
        self.finishing = Some(why);
    }

    fn poll_parts(&mut self, now: Instant, guardian: &mut Option<&mut Guardian>) {
        let grace = self.ctx.kill_grace + Duration::from_secs(1);
        for p in 0..self.parts.len() {
            let Some(status) = self.parts[p].poll(now, grace) else {
                continue;
            };
            if let Some(g) = guardian.as_mut() {
                g.forget(self.parts[p].pid);
            }
            // The reports the part wrote before it ended first: its relay may not have read
            // them yet (a worker that exited 0 would otherwise count as gone with its part).
            self.take_reports(Some((p, now + REPORTS_GRACE)));
            // The ranks of the last generation that the part still ran, for the blame.
            let mut held: Vec<usize> = Vec::new();
            for w in self.workers.iter_mut().filter(|w| w.part == p) {
                if w.end.is_none() {
                    w.end = Some(End::PartGone);
                    held.extend(w.rank);
                }
            }
            held.sort_unstable();
            let host = self.parts[p].host.clone();
            if !status.success() && self.parts[p].stopping.is_none() {
                let whose = match held.as_slice() {
                    [] => "its workers".to_string(),
                    [r] => format!("rank {r}"),
                    rs => format!(
                        "ranks {}",
                        rs.iter()
                            .map(|r| r.to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                };
                let why = format!(
                    "{whose} gone: the fhrun part running {} {}",
                    if held.len() == 1 { "it" } else { "them" },
                    crate::launch::describe(status)
                );
                self.lose_host(&host, why);
            }
        }
    }

    fn check_sessions(&mut self, now: Instant) {
        let grace = SESSION_GRACE + self.ctx.kill_grace;
        let lost: Vec<usize> = (0..self.workers.len())
            .filter(|&i| {
                let w = &self.workers[i];
                w.session_closed.is_some_and(|t| now >= t + grace)
                    && self.alive(w)
                    && !w.removed
                    && self.parts[w.part].stopping.is_none()
            })
            .collect();
        for i in lost {
            let why = self.describe_loss(
                &self.workers[i],
                "closed its session to fhrun but still ran",
            );
            let host = self.workers[i].host.clone();
            self.lose_host(&host, why);
        }
    }

    /// Run the job to its end; returns fhrun's exit status.
    pub fn run(mut self, discovery: &Discovery, mut guardian: Option<&mut Guardian>) -> i32 {
        loop {
            for r in discovery.drain() {
                self.discovered(r);
            }
            let now = Instant::now();
            let (back, c) = self.hosts.expire(now);
            for h in back {
                eprintln!("fhrun: {h}'s blacklist cooldown is over");
            }
            self.publish(c);
            if let Some(e) = self.server.next_event(Duration::from_millis(50)) {
                self.on_event(e);
                while let Some(e) = self.server.next_event(Duration::ZERO) {
                    self.on_event(e);
                }
            }
            self.take_reports(None);
            let now = Instant::now();
            self.poll_parts(now, &mut guardian);
            self.check_sessions(now);
            while let Some(sig) = sys::wait_signal(Duration::from_millis(1)) {
                if sig == libc::SIGUSR1 {
                    // Every running worker writes its flight record (and its stacks) into its
                    // generation's directory; parts on other hosts send theirs back.
                    let asked = self.ask_for_records();
                    let at = self
                        .ctx
                        .env
                        .iter()
                        .find(|(k, _)| k == "FH_FLIGHT_DIR")
                        .map_or_else(
                            || "where FH_FLIGHT_DIR says".to_string(),
                            |(_, v)| v.replace("{generation}", "N"),
                        );
                    eprintln!(
                        "fhrun: received SIGUSR1; the workers of {asked} host(s) write their \
                         flight records (in {at}; other hosts' are sent back)"
                    );
                    continue;
                }
                if matches!(
                    sig,
                    libc::SIGINT | libc::SIGTERM | libc::SIGHUP | libc::SIGQUIT
                ) {
                    if self.stopping_all.is_none() {
                        eprintln!(
                            "fhrun: received {}; stopping all workers",
                            sys::signal_name(sig)
                        );
                        self.stop_all(128 + sig, sig);
                    } else {
                        for p in &mut self.parts {
                            p.stopping = Some(now - self.ctx.kill_grace - Duration::from_secs(2));
                        }
                    }
                }
            }
            if let Some(t) = self.s.timeout {
                // As for fixed jobs: SIGUSR1 first (every worker writes its flight record),
                // SIGTERM a record window later.
                if self.stopping_all.is_none() && now >= self.began + t {
                    if self.timed_out_at.is_none() {
                        eprintln!(
                            "fhrun: the job timed out after {:.1} s (--timeout); asking the \
                             workers for their flight records, then stopping them",
                            t.as_secs_f64()
                        );
                        self.ask_for_records();
                        self.timed_out_at = Some(now);
                    }
                    if self
                        .timed_out_at
                        .is_some_and(|at| now >= at + RECORD_WINDOW)
                    {
                        self.stop_all(EXIT_TIMEOUT, libc::SIGTERM);
                    }
                }
            }
            self.start_workers(now, &mut guardian);
            self.rounds(now);
            self.starvation(now);
            if let Some(code) = self.finished() {
                return code;
            }
        }
    }
}

/// A uniform number in `[0, 1)`, from the kernel's random numbers (0 if they cannot be read).
fn uniform() -> f64 {
    let r = sys::random_hex(8)
        .ok()
        .and_then(|h| u64::from_str_radix(&h, 16).ok())
        .unwrap_or(0);
    (r >> 11) as f64 / (1u64 << 53) as f64
}
