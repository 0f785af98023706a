//! The rendezvous address: where it comes from (`FH_RENDEZVOUS_ADDR`, or a launcher's
//! `MASTER_ADDR`/`MASTER_PORT`), what it must be (an address of rank 0's host, never a
//! wildcard unless allowed), and free local ports for launchers that choose one.

use crate::error::config;
use crate::Result;

use super::{Get, Launcher};

/// `n` distinct ports on 127.0.0.1 that were free a moment ago (held together while probed,
/// so that they differ): where a launcher on one machine, a bench or a test puts a rendezvous
/// (and a store). Another process may take one before it is used; callers that start ranks
/// on it see that as the rendezvous' own clear error.
pub fn free_local_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let held = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()?;
    held.iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect()
}

/// One port on 127.0.0.1 that was free a moment ago ([`free_local_ports`]).
pub fn free_local_port() -> std::io::Result<u16> {
    Ok(free_local_ports(1)?[0])
}

fn check_addr(var: &str, addr: &str) -> Result<()> {
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(config(
            var,
            format!("expected host:port (e.g. 10.0.0.1:29400), got {addr:?}"),
        ));
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(config(
            var,
            format!("the host part of {addr:?} is empty; expected host:port"),
        ));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(config(
            var,
            format!("the port of {addr:?} must be an integer in 1..=65535"),
        )),
    }
}

/// Whether `host` (without brackets) is a wildcard address: listening there means every
/// interface.
pub fn is_wildcard_host(host: &str) -> bool {
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_unspecified())
}

fn check_not_wildcard(var: &str, addr: &str, allow: bool) -> Result<()> {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    if !allow && is_wildcard_host(host) {
        return Err(config(
            var,
            format!(
                "{addr:?} is a wildcard address: rank 0 would listen on every interface of its \
                 host. Give an address of rank 0's host that the other ranks can reach (e.g. \
                 127.0.0.1 for one host, or the cluster network's address), or set \
                 FH_ALLOW_WILDCARD=1 if listening everywhere is really intended"
            ),
        ));
    }
    Ok(())
}

pub(super) fn rendezvous(
    get: &Get<'_>,
    launcher: Launcher,
    allow_wildcard: bool,
) -> Result<String> {
    if let Some(addr) = get("FH_RENDEZVOUS_ADDR") {
        let addr = addr.trim().to_owned();
        check_addr("FH_RENDEZVOUS_ADDR", &addr)?;
        check_not_wildcard("FH_RENDEZVOUS_ADDR", &addr, allow_wildcard)?;
        return Ok(addr);
    }
    match (get("MASTER_ADDR"), get("MASTER_PORT")) {
        (Some(host), Some(port)) => {
            let mut port: u16 = port.trim().parse().ok().filter(|&p| p > 0).ok_or_else(|| {
                config(
                    "MASTER_PORT",
                    format!("expected a port number in 1..=65535, got {port:?}"),
                )
            })?;
            // torchrun's agent serves its own store on MASTER_PORT; use the next port.
            if launcher == Launcher::Torchrun
                && get("TORCHELASTIC_USE_AGENT_STORE")
                    .is_some_and(|v| v.eq_ignore_ascii_case("true"))
            {
                port = port.checked_add(1).ok_or_else(|| {
                    config(
                        "MASTER_PORT",
                        "the torchrun agent holds MASTER_PORT and MASTER_PORT + 1 overflows; \
                         set FH_RENDEZVOUS_ADDR",
                    )
                })?;
            }
            let host = host.trim();
            let addr = if host.contains(':') && !host.starts_with('[') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            };
            check_addr("MASTER_ADDR", &addr)?;
            check_not_wildcard("MASTER_ADDR", &addr, allow_wildcard)?;
            Ok(addr)
        }
        (Some(_), None) => Err(config(
            "MASTER_PORT",
            "MASTER_ADDR is set but MASTER_PORT is missing",
        )),
        (None, Some(_)) => Err(config(
            "MASTER_ADDR",
            "MASTER_PORT is set but MASTER_ADDR is missing",
        )),
        (None, None) => Err(config(
            "FH_RENDEZVOUS_ADDR",
            format!(
                "this is a job of several ranks (started by {launcher}) but no rendezvous address \
                 is set: launch with fhrun, or set FH_RENDEZVOUS_ADDR=host:port (where rank 0 will \
                 listen), or MASTER_ADDR and MASTER_PORT, in every rank's environment"
            ),
        )),
    }
}
