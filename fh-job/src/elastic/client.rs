//! The worker's side of the elastic session.

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::wire::{self, Msg, ReadError};
use super::{HostUpdate, Membership, ADDR_VAR, TIMEOUT_VAR, WORKER_VAR};
use crate::launch::DEFAULT_TIMEOUT;
use crate::token::{fresh_nonce, JobToken};
use crate::{JobError, Result};

/// A worker's authenticated session with its driver, kept for the process's life.
pub struct Client {
    stream: TcpStream,
    addr: String,
    worker: String,
    /// Bounds a connection, a handshake and a host-update query (`FH_TIMEOUT_SECONDS`).
    timeout: Duration,
    /// The driver's `--elastic-timeout` (or `FH_ELASTIC_TIMEOUT`).
    elastic_timeout: Duration,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("addr", &self.addr)
            .field("worker", &self.worker)
            .field("elastic_timeout", &self.elastic_timeout)
            .finish()
    }
}

fn never() -> bool {
    false
}

impl Client {
    /// Connect to `FH_ELASTIC_ADDR` as `FH_ELASTIC_WORKER` with `FH_JOB_TOKEN`; `None` when
    /// not elastic (`FH_ELASTIC_ADDR` unset).
    pub fn from_env() -> Result<Option<Client>> {
        let var = |n: &str| std::env::var(n).ok().filter(|v| !v.trim().is_empty());
        let Some(addr) = var(ADDR_VAR) else {
            return Ok(None);
        };
        let config = |v: &str, reason: String| JobError::Config {
            var: v.into(),
            reason,
        };
        let worker = var(WORKER_VAR).ok_or_else(|| {
            config(
                WORKER_VAR,
                format!(
                    "{ADDR_VAR} is set (an elastic worker) but {WORKER_VAR} is not; start \
                     elastic workers with fhrun --host-discovery-script"
                ),
            )
        })?;
        let base = super::base_info()?;
        let token = base
            .token
            .clone()
            .unwrap_or_else(|| unreachable!("base_info requires the token"));
        let override_timeout = match var(TIMEOUT_VAR) {
            None => None,
            Some(v) => Some(
                v.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite() && *s > 0.0 && *s <= 86_400.0 * 365.0)
                    .map(Duration::from_secs_f64)
                    .ok_or_else(|| {
                        config(
                            TIMEOUT_VAR,
                            format!("expected a positive number of seconds, got {v:?}"),
                        )
                    })?,
            ),
        };
        let mut client = Client::connect(addr.trim(), &worker, &token, base.timeout)?;
        if let Some(t) = override_timeout {
            client.elastic_timeout = t;
        }
        Ok(Some(client))
    }

    /// Connect to the driver at `addr` as `worker`, proving `token`; the connection and the
    /// handshake are bounded by `timeout`.
    pub fn connect(
        addr: &str,
        worker: &str,
        token: &JobToken,
        timeout: Duration,
    ) -> Result<Client> {
        let timeout = if timeout.is_zero() {
            DEFAULT_TIMEOUT
        } else {
            timeout
        };
        if worker.is_empty() || worker.len() > wire::MAX_NAME_LEN {
            return Err(JobError::InvalidArgument(format!(
                "an elastic worker id of {} bytes (1 to {})",
                worker.len(),
                wire::MAX_NAME_LEN
            )));
        }
        let who = format!("the elastic driver at {addr}");
        let target: SocketAddr = addr
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| JobError::Config {
                var: ADDR_VAR.into(),
                reason: format!("{addr:?} is not a reachable ip:port"),
            })?;
        let deadline = Instant::now() + timeout;
        let mut stream = TcpStream::connect_timeout(&target, timeout)
            .map_err(|e| JobError::io(format!("connecting to {who}"), e))?;
        let _ = stream.set_nodelay(true);
        let io = |what: &str, e: std::io::Error| JobError::io(format!("{what} {who}"), e);
        let nonce = fresh_nonce().map_err(|e| io("a nonce for", e))?;
        let hello = Msg::Hello {
            worker: worker.to_string(),
            nonce,
        }
        .encode();
        wire::write_frame(&mut stream, &hello, timeout).map_err(|e| io("greeting", e))?;
        let read = |s: &mut TcpStream| -> Result<Msg> {
            let body = wire::read_frame(s, Some(deadline), &never).map_err(|e| match e {
                ReadError::TimedOut => JobError::Handshake {
                    peer: who.clone(),
                    reason: format!(
                        "no answer to the handshake within {timeout:?} (FH_TIMEOUT_SECONDS)"
                    ),
                },
                e => wire::protocol(&who, format!("during the handshake: {e}")),
            })?;
            Msg::decode(&body).map_err(|e| wire::protocol(&who, e))
        };
        let (driver_nonce, proof) = match read(&mut stream)? {
            Msg::Challenge { nonce, proof } => (nonce, proof),
            Msg::Refuse(why) => return Err(wire::protocol(&who, format!("refused: {why}"))),
            other => {
                return Err(wire::protocol(
                    &who,
                    format!("expected a challenge, got {other:?}"),
                ))
            }
        };
        if !wire::verify(true, &token.key(), &hello, &driver_nonce, &proof) {
            return Err(wire::protocol(
                &who,
                "the driver could not prove the job token (FH_JOB_TOKEN differs: is this \
                 address another job's driver?)",
            ));
        }
        let mine = wire::worker_proof(&token.key(), &hello, &driver_nonce);
        wire::write_frame(&mut stream, &Msg::Proof(mine).encode(), timeout)
            .map_err(|e| io("proving the token to", e))?;
        let elastic_timeout = match read(&mut stream)? {
            Msg::Welcome { timeout_ms } => Duration::from_millis(timeout_ms.max(1)),
            Msg::Refuse(why) => return Err(wire::protocol(&who, format!("refused: {why}"))),
            other => {
                return Err(wire::protocol(
                    &who,
                    format!("expected a welcome, got {other:?}"),
                ))
            }
        };
        Ok(Client {
            stream,
            addr: addr.to_string(),
            worker: worker.to_string(),
            timeout,
            elastic_timeout,
        })
    }

    /// This worker's id (`host:slot`).
    pub fn worker(&self) -> &str {
        &self.worker
    }

    /// The elastic timeout that bounds a Register's wait (the driver's, or
    /// `FH_ELASTIC_TIMEOUT`).
    pub fn elastic_timeout(&self) -> Duration {
        self.elastic_timeout
    }

    /// How long [`Client::next_world`] waits: the driver answers within its elastic timeout
    /// of the first registration, and may wait one more for new hosts before it fails the
    /// job; plus the connection timeout as slack.
    pub fn register_wait(&self) -> Duration {
        self.elastic_timeout
            .saturating_mul(2)
            .saturating_add(self.timeout)
    }

    /// Where this worker would listen as rank 0: the IP of its side of the session (reachable
    /// from the driver's other hosts) and a port found free there.
    fn candidate(&self) -> Result<String> {
        let ip = self
            .stream
            .local_addr()
            .map_err(|e| JobError::io("reading the elastic session's local address", e))?
            .ip();
        let port = TcpListener::bind((ip, 0))
            .and_then(|l| l.local_addr())
            .map_err(|e| JobError::io(format!("finding a free port on {ip}"), e))?
            .port();
        Ok(SocketAddr::new(ip, port).to_string())
    }

    fn send(&mut self, msg: &Msg, what: &str) -> Result<()> {
        wire::write_frame(&mut self.stream, &msg.encode(), self.timeout).map_err(|e| {
            JobError::io(
                format!("sending {what} to the elastic driver at {}", self.addr),
                e,
            )
        })
    }

    fn receive(&mut self, wait: Duration, what: &str) -> Result<Msg> {
        let deadline = Instant::now() + wait;
        let who = format!("the elastic driver at {}", self.addr);
        let body =
            wire::read_frame(&mut self.stream, Some(deadline), &never).map_err(|e| match e {
                ReadError::TimedOut => JobError::Handshake {
                    peer: who.clone(),
                    reason: format!(
                        "worker {} waited {wait:?} for the answer to {what} and got none (the \
                     driver answers a Register when every worker it expects has registered or \
                     its --elastic-timeout of {:?} has passed); is fhrun still running?",
                        self.worker, self.elastic_timeout
                    ),
                },
                ReadError::Closed => JobError::Closed(format!(
                    "{who} closed worker {}'s session while it waited for {what} (fhrun ended or \
                 stopped this worker)",
                    self.worker
                )),
                e => wire::protocol(&who, format!("while waiting for {what}: {e}")),
            })?;
        Msg::decode(&body).map_err(|e| wire::protocol(&who, e))
    }

    /// Register for the next generation and wait (bounded by [`Client::register_wait`]) for
    /// the driver's answer.
    pub fn next_world(&mut self) -> Result<Membership> {
        let candidate = self.candidate()?;
        self.send(&Msg::Register { candidate }, "a Register")?;
        let wait = self.register_wait();
        match self.receive(wait, "its Register (the next world)")? {
            Msg::Answer(m) => Ok(m),
            other => Err(wire::protocol(
                &format!("the elastic driver at {}", self.addr),
                format!("expected the answer to a Register, got {other:?}"),
            )),
        }
    }

    /// Host-set changes after `since` (bounded by `FH_TIMEOUT_SECONDS`).
    pub fn host_updates(&mut self, since: u64) -> Result<HostUpdate> {
        self.send(&Msg::HostUpdates { since }, "a host-update query")?;
        let wait = self.timeout;
        match self.receive(wait, "its host-update query")? {
            Msg::Update(u) => Ok(u),
            other => Err(wire::protocol(
                &format!("the elastic driver at {}", self.addr),
                format!("expected a host update, got {other:?}"),
            )),
        }
    }
}
