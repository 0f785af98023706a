//! Host lists: `-H host1:2,host2:2` and hostfiles (`host slots=N`, `host:N`, `# comments`).

use std::fmt;

/// One host and how many ranks it may run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    pub name: String,
    pub slots: usize,
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.name, self.slots)
    }
}

/// Parses one `host` / `host:N` item of a `-H` list (`N` defaults to 1). Also returns whether
/// the item gave its slot count explicitly. An unbracketed item with several colons is an IPv6
/// address without a slot count.
pub(crate) fn parse_host_colon(item: &str, origin: &str) -> Result<(Host, bool), String> {
    let item = item.trim();
    if item.is_empty() {
        return Err(format!("{origin}: empty host name"));
    }
    // An IPv6 literal in brackets: [::1]:4
    let (name, slots) = if let Some(rest) = item.strip_prefix('[') {
        let end = rest
            .find(']')
            .ok_or_else(|| format!("{origin}: '{item}' has '[' without a closing ']'"))?;
        let name = &rest[..end];
        let after = &rest[end + 1..];
        let slots = match after.strip_prefix(':') {
            Some(s) => Some(s),
            None if after.is_empty() => None,
            None => return Err(format!("{origin}: unexpected '{after}' after '[{name}]'")),
        };
        (name, slots)
    } else if item.matches(':').count() > 1 {
        (item, None)
    } else {
        match item.rsplit_once(':') {
            Some((name, slots)) => (name, Some(slots)),
            None => (item, None),
        }
    };
    if name.is_empty() {
        return Err(format!("{origin}: empty host name in '{item}'"));
    }
    if name.contains(char::is_whitespace) {
        return Err(format!("{origin}: host name '{name}' contains whitespace"));
    }
    let explicit = slots.is_some();
    let slots = match slots {
        None => 1,
        Some(s) => parse_slots(s, name, origin)?,
    };
    Ok((
        Host {
            name: name.to_string(),
            slots,
        },
        explicit,
    ))
}

fn parse_slots(s: &str, host: &str, origin: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err(format!("{origin}: host '{host}' has 0 slots; give at least 1")),
        Ok(n) => Ok(n),
        Err(_) => Err(format!(
            "{origin}: host '{host}' has an invalid slot count '{s}' (expected a positive integer, e.g. {host}:4)"
        )),
    }
}

/// Parses the `-H` argument: `host1:2,host2:2` (a host without `:N` has one slot).
pub fn parse_host_list(list: &str) -> Result<Vec<Host>, String> {
    let mut hosts = Vec::new();
    for item in list.split(',') {
        if item.trim().is_empty() {
            continue;
        }
        hosts.push(parse_host_colon(item, "-H")?.0);
    }
    if hosts.is_empty() {
        return Err("-H: no hosts given (expected e.g. -H host1:2,host2:2)".into());
    }
    Ok(merge(hosts))
}

/// Parses a hostfile. Each non-empty line is `host`, `host:N`, `host slots=N` or
/// `host slots=N max_slots=M` (OpenMPI style); `#` starts a comment.
pub fn parse_hostfile(text: &str, path: &str) -> Result<Vec<Host>, String> {
    let mut hosts = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let origin = format!("{path}:{}", i + 1);
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        let (mut host, had_colon_slots) = parse_host_colon(first, &origin)?;
        for word in words {
            let (key, value) = word.split_once('=').ok_or_else(|| {
                format!("{origin}: expected 'slots=N' after the host name, found '{word}'")
            })?;
            match key {
                "slots" => {
                    if had_colon_slots {
                        return Err(format!(
                            "{origin}: host '{}' gives its slots twice ('{first}' and '{word}')",
                            host.name
                        ));
                    }
                    host.slots = parse_slots(value, &host.name, &origin)?;
                }
                // Accepted for OpenMPI compatibility; fhrun places at most `slots` ranks per host.
                "max_slots" | "max-slots" => {
                    parse_slots(value, &host.name, &origin)?;
                }
                _ => {
                    return Err(format!(
                        "{origin}: unknown hostfile key '{key}' (expected slots=N)"
                    ))
                }
            }
        }
        hosts.push(host);
    }
    if hosts.is_empty() {
        return Err(format!("hostfile {path} lists no hosts"));
    }
    Ok(merge(hosts))
}

/// Merges repeated host names (their slots add up), keeping first-seen order.
fn merge(hosts: Vec<Host>) -> Vec<Host> {
    let mut out: Vec<Host> = Vec::new();
    for h in hosts {
        match out.iter_mut().find(|o| o.name == h.name) {
            Some(o) => o.slots += h.slots,
            None => out.push(h),
        }
    }
    out
}

/// Total slots of a host list.
pub fn total_slots(hosts: &[Host]) -> usize {
    hosts.iter().map(|h| h.slots).sum()
}

/// This machine's host name (empty if unknown).
pub fn this_hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: buf is valid for buf.len() bytes; gethostname NUL-terminates on success
    // (and we stop at the first NUL or the end anyway).
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// True when `name` denotes this machine.
pub fn is_local(name: &str, hostname: &str) -> bool {
    let name = name.trim();
    if is_loopback(name) {
        return true;
    }
    if hostname.is_empty() {
        return false;
    }
    if name.eq_ignore_ascii_case(hostname) {
        return true;
    }
    // Short name vs fully qualified name of this host.
    let short = |s: &str| s.split('.').next().unwrap_or("").to_ascii_lowercase();
    (name.contains('.') != hostname.contains('.')) && short(name) == short(hostname)
}

/// True for loopback names (`localhost`, `127.x.x.x`, `::1`), which other hosts cannot use to
/// reach this machine.
pub fn is_loopback(name: &str) -> bool {
    let name = name.trim();
    name.eq_ignore_ascii_case("localhost")
        || name.eq_ignore_ascii_case("localhost.localdomain")
        || name == "::1"
        || name.starts_with("127.")
}

/// The host where rank 0 runs under `mpirun --map-by slot` (the first host), as the other ranks
/// should address it: loopback when every host is this machine, else a name the other hosts can
/// resolve (this machine's host name instead of `localhost`).
pub fn rendezvous_host(hosts: &[Host], hostname: &str) -> String {
    let all_local = hosts.iter().all(|h| is_local(&h.name, hostname));
    match hosts.first() {
        None => "127.0.0.1".into(),
        Some(_) if all_local => "127.0.0.1".into(),
        Some(h) if is_loopback(&h.name) && !hostname.is_empty() => hostname.to_string(),
        Some(h) => h.name.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(name: &str, slots: usize) -> Host {
        Host {
            name: name.into(),
            slots,
        }
    }

    #[test]
    fn host_list_basic() {
        assert_eq!(
            parse_host_list("node1:2,node2:4").unwrap(),
            vec![h("node1", 2), h("node2", 4)]
        );
        assert_eq!(
            parse_host_list("a,b:3").unwrap(),
            vec![h("a", 1), h("b", 3)]
        );
        assert_eq!(parse_host_list(" a:1 , a:2 ,").unwrap(), vec![h("a", 3)]);
        assert_eq!(
            parse_host_list("[::1]:2,10.0.0.1:3").unwrap(),
            vec![h("::1", 2), h("10.0.0.1", 3)]
        );
        assert_eq!(parse_host_list("fe80::1").unwrap(), vec![h("fe80::1", 1)]);
    }

    #[test]
    fn host_list_errors() {
        let e = parse_host_list("node1:0").unwrap_err();
        assert!(e.contains("0 slots"), "{e}");
        let e = parse_host_list("node1:x").unwrap_err();
        assert!(e.contains("invalid slot count 'x'"), "{e}");
        let e = parse_host_list(":3").unwrap_err();
        assert!(e.contains("empty host name"), "{e}");
        assert!(parse_host_list(",,").is_err());
        assert!(parse_host_list("[::1:2").is_err());
    }

    #[test]
    fn hostfile_forms() {
        let text = "\
# cluster
node1 slots=4   # the big one
node2:2

  node3
node4 slots=2 max_slots=8
";
        assert_eq!(
            parse_hostfile(text, "hf").unwrap(),
            vec![h("node1", 4), h("node2", 2), h("node3", 1), h("node4", 2)]
        );
    }

    #[test]
    fn hostfile_errors_name_the_line() {
        let e = parse_hostfile("a slots=2\nb slots=zero\n", "hf").unwrap_err();
        assert!(e.starts_with("hf:2:"), "{e}");
        let e = parse_hostfile("a cores=2\n", "hf").unwrap_err();
        assert!(e.contains("unknown hostfile key 'cores'"), "{e}");
        let e = parse_hostfile("a:2 slots=3\n", "hf").unwrap_err();
        assert!(e.contains("twice"), "{e}");
        let e = parse_hostfile("a 3\n", "hf").unwrap_err();
        assert!(e.contains("slots=N"), "{e}");
        let e = parse_hostfile("# nothing\n\n", "hf").unwrap_err();
        assert!(e.contains("no hosts"), "{e}");
    }

    #[test]
    fn totals() {
        assert_eq!(total_slots(&parse_host_list("a:2,b:3").unwrap()), 5);
    }

    #[test]
    fn rendezvous_host_is_reachable_from_the_other_hosts() {
        let list = |s: &str| parse_host_list(s).unwrap();
        assert_eq!(rendezvous_host(&[], "box"), "127.0.0.1");
        assert_eq!(
            rendezvous_host(&list("localhost:2,box:2"), "box"),
            "127.0.0.1"
        );
        assert_eq!(rendezvous_host(&list("node1:2,node2:2"), "box"), "node1");
        assert_eq!(rendezvous_host(&list("localhost:2,node2:2"), "box"), "box");
        assert_eq!(rendezvous_host(&list("box:2,node2:2"), "box"), "box");
    }

    #[test]
    fn locality() {
        assert!(is_local("localhost", "box"));
        assert!(is_local("127.0.0.1", "box"));
        assert!(is_local("::1", "box"));
        assert!(is_local("box", "box"));
        assert!(is_local("BOX", "box"));
        assert!(is_local("box.example.com", "box"));
        assert!(is_local("box", "box.example.com"));
        assert!(!is_local("node7", "box"));
        assert!(!is_local("box.other.com", "box.example.com"));
        assert!(!is_local("node7", ""));
    }
}
