//! Which ranks share a host, from facts rather than from the launcher's variables.
//!
//! A launcher that gives only `FH_RANK`/`FH_SIZE` (or `RANK`/`WORLD_SIZE`, ...) says nothing of
//! hosts; assuming one host then sends `FH_TRANSPORT=auto` into shared memory that the ranks of
//! other hosts never see. So every rank computes a [`HostId`] from facts of its own process —
//! the UTS host name, the kernel's boot id (`/proc/sys/kernel/random/boot_id`), the device and
//! inode of `/dev/shm` (two network or mount namespaces of one machine that share `/dev/shm`
//! can share memory; ones that do not, cannot) and the inode of its pid namespace (the
//! shared-memory backend watches its peers' processes) — or takes the one given in
//! `FH_HOST_ID`, and sends it to rank 0 in its [`Place`] during the TCP rendezvous, together
//! with the local rank and size its launcher claimed, if any. Rank 0 sends every rank the
//! whole list, and every rank [`settle`]s the same list into the same [`Layout`]: its local
//! rank and size, its host's index, and whether the launcher's claims contradict the facts —
//! then every rank stops at start-up with the same [`Contradiction`] instead of timing out in
//! a transport chosen on a wrong picture. [`choose`] picks `auto`'s backend from the layout.
//!
//! [`settle`] and [`choose`] are pure; only [`HostId::detect`] and [`Place::of`] read the
//! system.

use std::fmt;

use fh_core::bytes::{DecodeError, Reader};

use crate::launch::{LaunchInfo, HOST_ID_VAR, MAX_NAMED_HOST_LEN};
use crate::{JobError, Topology};

/// Longest encoded host identity.
pub const MAX_HOST_ID_LEN: usize = 512;

// An `FH_HOST_ID` name's identity ([`HostId::named`]) fits in [`MAX_HOST_ID_LEN`] whole, so
// two names never collide by truncation.
const _: () = assert!(MAX_NAMED_HOST_LEN + HOST_ID_VAR.len() < MAX_HOST_ID_LEN);

/// Longest variable name (pair) sent with a claim.
const MAX_VARS_LEN: usize = 255;

/// Hosts and ranks named one by one in a message before the rest is summarised.
const LISTED: usize = 8;

/// Which host a rank runs on: equal identities share a host (and can share memory).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct HostId(String);

impl HostId {
    /// The identity named by `FH_HOST_ID` (cut to [`MAX_HOST_ID_LEN`] bytes).
    pub fn named(name: &str) -> HostId {
        HostId::from_text(format!("{HOST_ID_VAR}={name}"))
    }

    /// An identity from its text as sent on the wire (cut to [`MAX_HOST_ID_LEN`] bytes).
    pub fn from_text(text: impl Into<String>) -> HostId {
        let mut text = text.into();
        let mut end = text.len().min(MAX_HOST_ID_LEN);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        HostId(text)
    }

    /// This process's identity from facts: the host name, the boot id, `/dev/shm`'s device
    /// and inode and the pid namespace (a fact that cannot be read shows as `?`).
    pub fn detect() -> HostId {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|b| b.trim().chars().take(13).collect::<String>())
            .ok()
            .filter(|b| !b.is_empty());
        HostId::from_text(format!(
            "{} (boot {}, /dev/shm {}, pid ns {})",
            host_name().unwrap_or_else(|| "?".into()),
            boot.as_deref().unwrap_or("?"),
            file_id("/dev/shm").unwrap_or_else(|| "?".into()),
            file_id("/proc/self/ns/pid").unwrap_or_else(|| "?".into()),
        ))
    }

    /// The identity of a launch: [`LaunchInfo::host_id`] (`FH_HOST_ID`) if set, else
    /// [`HostId::detect`].
    pub fn of(info: &LaunchInfo) -> HostId {
        match &info.host_id {
            Some(name) => HostId::named(name),
            None => HostId::detect(),
        }
    }

    /// The identity's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for HostId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostId({:?})", self.0)
    }
}

impl fmt::Display for HostId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(unix)]
fn host_name() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for `buf.len()` bytes; gethostname writes at most that many.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned()).filter(|n| !n.is_empty())
}

#[cfg(not(unix))]
fn host_name() -> Option<String> {
    None
}

/// `device:inode` of a path (following links).
#[cfg(unix)]
fn file_id(path: &str) -> Option<String> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata(path)
        .ok()
        .map(|m| format!("{}:{}", m.dev(), m.ino()))
}

#[cfg(not(unix))]
fn file_id(_path: &str) -> Option<String> {
    None
}

/// A local or cross rank and size as a launcher claimed them, with the variables it set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The claimed rank (local rank, or host index).
    pub rank: usize,
    /// The claimed size (ranks on the host, or number of hosts).
    pub size: usize,
    /// The variables, `RANK_VAR/SIZE_VAR` (e.g. `FH_LOCAL_RANK/FH_LOCAL_SIZE`).
    pub vars: String,
}

impl Claim {
    fn new(rank: usize, size: usize, (r, s): (&str, &str)) -> Claim {
        let mut vars = format!("{r}/{s}");
        vars.truncate(MAX_VARS_LEN.min(vars.len()));
        Claim { rank, size, vars }
    }

    fn rank_var(&self) -> &str {
        self.vars.split_once('/').map_or(&self.vars, |(r, _)| r)
    }

    fn size_var(&self) -> &str {
        self.vars.split_once('/').map_or(&self.vars, |(_, s)| s)
    }
}

/// What a rank tells the others about where it runs, during the rendezvous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    /// Its host identity.
    pub host: HostId,
    /// The local rank and size its launcher claimed, if it claimed any.
    pub local: Option<Claim>,
    /// The host index and host count its launcher claimed, if it claimed any.
    pub cross: Option<Claim>,
    /// Free bytes in its `/dev/shm` (0 where unknown or absent).
    pub shm_free: u64,
}

impl Place {
    /// The place of the rank `info` describes: [`HostId::of`], the launcher's claims
    /// ([`LaunchInfo::local_vars`], [`LaunchInfo::cross_vars`]) and the room in `/dev/shm`.
    pub fn of(info: &LaunchInfo) -> Place {
        let shm_free = shm_free_bytes().unwrap_or(0);
        Place {
            host: HostId::of(info),
            local: info
                .local_vars
                .map(|v| Claim::new(info.local_rank, info.local_size, v)),
            cross: info
                .cross_vars
                .map(|v| Claim::new(info.cross_rank, info.cross_size, v)),
            shm_free,
        }
    }

    /// Encode: the identity (2-byte length and text), the free bytes (8), a flag byte (bit 0:
    /// a local claim follows, bit 1: a cross claim follows), and each claim as rank and size
    /// (4 bytes each) and its variables (1-byte length and text). Little endian.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let host = self.host.as_str().as_bytes();
        out.extend_from_slice(&(host.len() as u16).to_le_bytes());
        out.extend_from_slice(host);
        out.extend_from_slice(&self.shm_free.to_le_bytes());
        out.push(u8::from(self.local.is_some()) | (u8::from(self.cross.is_some()) << 1));
        for c in self.local.iter().chain(&self.cross) {
            out.extend_from_slice(&(c.rank.min(u32::MAX as usize) as u32).to_le_bytes());
            out.extend_from_slice(&(c.size.min(u32::MAX as usize) as u32).to_le_bytes());
            out.push(c.vars.len() as u8);
            out.extend_from_slice(c.vars.as_bytes());
        }
        out
    }

    /// Decode one place from the start of `buf`; returns it and the bytes it used. Every
    /// length is checked before it is used.
    pub fn decode(buf: &[u8]) -> Result<(Place, usize), DecodeError> {
        let mut r = Reader::new(buf);
        let len = usize::from(r.u16()?);
        if len > MAX_HOST_ID_LEN {
            return Err(DecodeError::Invalid(format!(
                "a host identity of {len} bytes exceeds the maximum of {MAX_HOST_ID_LEN}"
            )));
        }
        let host = HostId(r.text(len, "a host identity")?);
        let shm_free = r.u64()?;
        let flags = r.u8()?;
        if flags & !3 != 0 {
            return Err(DecodeError::Invalid(format!(
                "unknown place flags {flags:#x}"
            )));
        }
        let mut claim = |present: bool| -> Result<Option<Claim>, DecodeError> {
            if !present {
                return Ok(None);
            }
            let rank = r.u32()? as usize;
            let size = r.u32()? as usize;
            let n = r.u8()?;
            let vars = r.text(usize::from(n), "a claim's variables")?;
            if size == 0 || rank >= size {
                return Err(DecodeError::Invalid(format!(
                    "a claimed rank {rank} of {size} ({vars})"
                )));
            }
            Ok(Some(Claim { rank, size, vars }))
        };
        let local = claim(flags & 1 != 0)?;
        let cross = claim(flags & 2 != 0)?;
        Ok((
            Place {
                host,
                local,
                cross,
                shm_free,
            },
            r.pos(),
        ))
    }
}

/// Longest encoded [`Place`].
pub const MAX_PLACE_LEN: usize = 2 + MAX_HOST_ID_LEN + 8 + 1 + 2 * (8 + 1 + MAX_VARS_LEN);

/// Encode every rank's place (rank 0 sends this after the address book): a 4-byte count and
/// the places in rank order.
pub fn encode_places(places: &[Place]) -> Vec<u8> {
    let mut out = (places.len() as u32).to_le_bytes().to_vec();
    for p in places {
        out.extend_from_slice(&p.encode());
    }
    out
}

/// Longest encoded list of `size` places.
pub fn max_places_len(size: usize) -> usize {
    size.saturating_mul(MAX_PLACE_LEN).saturating_add(4)
}

/// Decode a list that must hold exactly `size` places.
pub fn decode_places(buf: &[u8], size: usize) -> Result<(Vec<Place>, usize), DecodeError> {
    let mut r = Reader::new(buf);
    let n = r.u32()? as usize;
    if n != size {
        return Err(DecodeError::Invalid(format!(
            "the host list holds {n} ranks, expected {size}"
        )));
    }
    let mut out = Vec::with_capacity(n.min(buf.len()));
    for _ in 0..n {
        out.push(r.nested(Place::decode)?);
    }
    Ok((out, r.pos()))
}

/// The directory of POSIX shared memory, where the shared-memory backend's segments live.
pub const SHM_DIR: &str = "/dev/shm";

/// Free bytes in [`SHM_DIR`], if it can be read (what a rank's [`Place`] reports, and what
/// `FH_TRANSPORT=auto` weighs before it takes shared memory).
pub fn shm_free_bytes() -> Option<u64> {
    let st = rustix::fs::statvfs(SHM_DIR).ok()?;
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Where every rank sits, settled from the facts: the global ranks of each host, by local rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    hosts: Vec<Vec<usize>>,
    /// Host index and local rank of every rank.
    of_rank: Vec<(usize, usize)>,
}

impl Layout {
    /// The layout of a single rank.
    pub fn single() -> Layout {
        Layout {
            hosts: vec![vec![0]],
            of_rank: vec![(0, 0)],
        }
    }

    /// The global ranks of each host (by host index), each list by local rank.
    pub fn hosts(&self) -> &[Vec<usize>] {
        &self.hosts
    }

    /// The topology of `rank` (which must be below the world size).
    pub fn topology(&self, rank: usize) -> Topology {
        let (host, local) = self.of_rank[rank];
        Topology {
            rank,
            size: self.of_rank.len(),
            local_rank: local,
            local_size: self.hosts[host].len(),
            cross_rank: host,
            cross_size: self.hosts.len(),
        }
    }
}

/// The launcher's claims contradict the facts: every rank stops with this (the same on every
/// rank, since every rank settles the same list).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Contradiction {
    /// The variables at fault (`RANK_VAR/SIZE_VAR`).
    pub var: String,
    /// What contradicts what, and the fix.
    pub reason: String,
}

impl From<Contradiction> for JobError {
    fn from(c: Contradiction) -> Self {
        JobError::Config {
            var: c.var,
            reason: c.reason,
        }
    }
}

/// `0-3, 6, 8-9`: ranks as ranges, at most [`LISTED`] of them.
fn ranges(ranks: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            ranks[i].to_string()
        } else {
            format!("{}-{}", ranks[i], ranks[j])
        });
        i = j + 1;
    }
    if parts.len() > LISTED {
        let more = parts.len() - LISTED;
        parts.truncate(LISTED);
        parts.push(format!("… ({more} more)"));
    }
    parts.join(", ")
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// The hosts as the facts see them, for messages.
fn describe(hosts: &[Vec<usize>], places: &[Place]) -> String {
    let mut parts: Vec<String> = hosts
        .iter()
        .take(LISTED)
        .map(|h| {
            let who = if h.len() == 1 { "rank" } else { "ranks" };
            format!("{who} {} on {:?}", ranges(h), places[h[0]].host.as_str())
        })
        .collect();
    if hosts.len() > LISTED {
        parts.push(format!(
            "and {} more",
            plural(hosts.len() - LISTED, "host", "hosts")
        ));
    }
    format!(
        "{}: {}",
        plural(hosts.len(), "host", "hosts"),
        parts.join("; ")
    )
}

fn contradiction(
    what: &Claim,
    detail: String,
    hosts: &[Vec<usize>],
    places: &[Place],
) -> Contradiction {
    let facts = if places
        .iter()
        .any(|p| p.host.as_str().starts_with(HOST_ID_VAR))
    {
        "FH_HOST_ID and the host facts (host name, boot id, /dev/shm, pid namespace)"
    } else {
        "the host facts (host name, boot id, /dev/shm, pid namespace)"
    };
    Contradiction {
        var: what.vars.clone(),
        reason: format!(
            "the launcher's {vars} contradict the hosts the ranks run on: {detail}. By {facts} \
             the job has {}. Every rank stops here rather than choose a transport on a wrong \
             picture of the hosts. Fix: if the facts are wrong, set FH_HOST_ID on every rank to \
             a name shared by exactly the ranks of one host (e.g. FH_HOST_ID=$(hostname)); if \
             the launcher is wrong, fix or unset {vars}",
            describe(hosts, places),
            vars = what.vars.replace('/', " and "),
        ),
    }
}

/// Settle every rank's place (`places[r]` is rank `r`'s) into the layout every rank agrees
/// on: ranks with equal [`HostId`]s share a host. A host's local ranks are the ones its
/// launcher claimed when every rank of the host claims one and they are distinct, else the
/// order of the global ranks; host indices are the claimed cross ranks when every rank claims
/// one consistently with the hosts, else the order of each host's lowest rank. A claimed
/// local size that is not the number of ranks of that host, two ranks of a host claiming one
/// local rank, or claimed host indices that do not match the hosts, are a [`Contradiction`].
pub fn settle(places: &[Place]) -> Result<Layout, Contradiction> {
    // Hosts in order of their lowest rank.
    let mut hosts: Vec<Vec<usize>> = Vec::new();
    let mut host_of = vec![0usize; places.len()];
    for (r, p) in places.iter().enumerate() {
        let h = match hosts.iter().position(|h| places[h[0]].host == p.host) {
            Some(h) => h,
            None => {
                hosts.push(Vec::new());
                hosts.len() - 1
            }
        };
        hosts[h].push(r);
        host_of[r] = h;
    }
    // Local sizes and local ranks.
    for (r, p) in places.iter().enumerate() {
        let Some(c) = &p.local else { continue };
        let n = hosts[host_of[r]].len();
        if c.size != n || c.rank >= c.size {
            let detail = format!(
                "rank {r} has {}={} and {}={}, but {} its host ({})",
                c.rank_var(),
                c.rank,
                c.size_var(),
                c.size,
                if n == 1 {
                    "it alone runs on".to_string()
                } else {
                    format!("{n} ranks share")
                },
                ranges(&hosts[host_of[r]])
            );
            return Err(contradiction(c, detail, &hosts, places));
        }
    }
    for host in &mut hosts {
        let claims: Option<Vec<&Claim>> = host.iter().map(|&r| places[r].local.as_ref()).collect();
        let Some(claims) = claims else { continue };
        let mut by_local: Vec<Option<usize>> = vec![None; host.len()];
        for (&r, c) in host.iter().zip(&claims) {
            // `c.size == host.len()` and `c.rank < c.size` hold here.
            if let Some(other) = by_local[c.rank] {
                let detail = format!(
                    "ranks {other} and {r} both have {}={} on one host",
                    c.rank_var(),
                    c.rank
                );
                return Err(contradiction(c, detail, std::slice::from_ref(host), places));
            }
            by_local[c.rank] = Some(r);
        }
        *host = by_local.into_iter().flatten().collect();
    }
    // Host indices.
    let cross: Option<Vec<&Claim>> = places.iter().map(|p| p.cross.as_ref()).collect();
    if let Some(cross) = cross {
        let mut order: Vec<Option<usize>> = vec![None; hosts.len()];
        for (h, host) in hosts.iter().enumerate() {
            for &r in host {
                let c = cross[r];
                let first = cross[host[0]];
                let detail = if c.size != hosts.len() || c.rank >= c.size {
                    Some(format!("rank {r} has {}={} hosts", c.size_var(), c.size))
                } else if c.rank != first.rank {
                    Some(format!(
                        "ranks {} and {r} share a host but have {}={} and {}",
                        host[0],
                        c.rank_var(),
                        first.rank,
                        c.rank
                    ))
                } else if order[c.rank].is_some_and(|o| o != h) {
                    Some(format!(
                        "ranks {} and {r} are on different hosts but both have {}={}",
                        hosts[order[c.rank].unwrap_or(0)][0],
                        c.rank_var(),
                        c.rank
                    ))
                } else {
                    None
                };
                if let Some(detail) = detail {
                    return Err(contradiction(c, detail, &hosts, places));
                }
                order[c.rank] = Some(h);
            }
        }
        // Every claimed index is below the host count and names one host: a permutation.
        hosts = order
            .into_iter()
            .flatten()
            .map(|h| std::mem::take(&mut hosts[h]))
            .collect();
    }
    let mut of_rank = vec![(0, 0); places.len()];
    for (h, host) in hosts.iter().enumerate() {
        for (l, &r) in host.iter().enumerate() {
            of_rank[r] = (h, l);
        }
    }
    Ok(Layout { hosts, of_rank })
}

/// The backend `FH_TRANSPORT=auto` takes for a settled layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// Shared memory: every rank on one host, with room in `/dev/shm` everywhere.
    Shm,
    /// Shared memory within hosts, TCP between them: several hosts, some with several ranks.
    Hier,
    /// TCP between all ranks, for the reason given.
    Tcp(String),
}

/// Choose `auto`'s backend from the layout and the places: `need(n)` is the room in
/// `/dev/shm` that shared memory among `n` ranks takes. Pure, hence the same on every rank.
pub fn choose(layout: &Layout, places: &[Place], need: impl Fn(usize) -> u64) -> Choice {
    let hosts = layout.hosts();
    if places.len() < 2 {
        return Choice::Tcp("a single rank".into());
    }
    if hosts.len() == 1 {
        let need = need(places.len());
        return match places.iter().position(|p| p.shm_free < need) {
            None => Choice::Shm,
            Some(r) => Choice::Tcp(format!(
                "rank {r} has too little room in /dev/shm for shared memory ({} bytes free, \
                 {need} wanted)",
                places[r].shm_free
            )),
        };
    }
    if hosts.iter().any(|h| h.len() > 1) {
        Choice::Hier
    } else {
        Choice::Tcp(format!(
            "{} ranks on {} hosts: no host runs several ranks",
            places.len(),
            hosts.len()
        ))
    }
}

#[cfg(test)]
mod tests;
