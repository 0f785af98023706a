//! An emulated cluster on one machine: N hosts, each a Linux network namespace, for the
//! multi-host checks (`cargo xtask multihost`, a stage of `cargo xtask test`), the bench across
//! hosts (`cargo xtask bench --emulate`) and by hand (`cargo xtask cluster -- COMMAND`).
//!
//! Each host gets
//! - its own network namespace `<id>-h<i>` with one interface, `eth0`, addressed
//!   `10.77.0.<i+1>/24`, the far end of a veth pair whose near end (`<id>h<i>`) is enslaved to a bridge (`<id>b`) in
//!   the root namespace. The bridge has no address: the hosts reach each other and nothing else,
//!   and only addresses inside the namespaces made here are used;
//! - its own UTS name (`h<i>`), its own `/dev/shm` (a fresh tmpfs) and an `/etc/hosts` naming
//!   every host of the cluster (`h<i>` resolves to its address there), through a mount and UTS
//!   namespace held open by a *holder* process (`sleep`) that every process of the host joins
//!   with `nsenter`, so that the ranks of one host share memory and those of two hosts cannot,
//!   exactly as FastHorovod's host detection expects (`fh_job::hosts`);
//! - when a rate is given, a `tc tbf` qdisc at that rate on both ends of its link (each direction
//!   of the host's link is limited), and with a per-flow cap an `htb` leaf per TCP connection
//!   under the host's egress `tbf` ([`Shaping`], in `shaping.rs`); with a round-trip time, a
//!   thread of this process in the host's namespace holding each packet it receives for half
//!   of it (`delay.rs`).
//!
//! Names carry the pid of the process that made them and a per-process counter (`fhc<pid><x>`),
//! so concurrent runs never clash. Teardown is certain: before anything is made, a *guardian*
//! process (its own process group, so a Ctrl-C on the terminal does not reach it) waits for
//! end-of-file on a pipe that only this process holds; when the pipe closes — [`Cluster::down`],
//! `Drop` on a failed test's unwind, or this process dying of anything, SIGKILL included — the
//! guardian kills every process in the hosts' namespaces, deletes the namespaces, the bridge and
//! the links, and removes the cluster's directory. A run that finds namespaces of a dead process
//! (both it and its guardian killed) removes them too.
//!
//! Ranks start with the launcher's variables ([`Cluster::launch`]) or through a launcher run on
//! a host ([`Cluster::command`]) that reaches the others with the cluster's rsh agent
//! ([`Cluster::rsh_agent`]: `agent HOST COMMAND...` enters that host's namespaces).
//! [`Cluster::set_link`] cuts a host off; [`Cluster::link_rate`] measures one or several
//! parallel TCP streams (`probe.rs`).
//!
//! [`unavailable`] says why a machine cannot run it (not root, no `ip`/`tc`/`nsenter`/`unshare`,
//! network namespaces not permitted); callers skip and say so.

use std::ffi::OsStr;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

mod delay;
pub(crate) mod probe;
mod shaping;

pub(crate) use probe::{link_bound_rate, link_probe, show_rates, STREAMS};
pub(crate) use shaping::Shaping;

/// Prefix of everything a cluster makes (namespaces, links, directories).
const PREFIX: &str = "fhc";

/// Clusters made by this process so far (one letter of the id each).
static MADE: AtomicUsize = AtomicUsize::new(0);

/// The port rank 0 listens on for the rendezvous (each host has its own port space).
pub(crate) const RENDEZVOUS_PORT: u16 = 29400;

/// Why this machine cannot run an emulated cluster, or `None` when it can.
pub(crate) fn unavailable() -> Option<String> {
    let ok = |prog: &str, args: &[&str]| {
        Command::new(prog)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
    {
        return Some("not root (network namespaces need root; CI runs as root)".into());
    }
    for (prog, args, pkg) in [
        ("ip", &["-V"][..], "iproute2"),
        ("tc", &["-V"][..], "iproute2"),
        ("nsenter", &["--version"][..], "util-linux"),
        ("unshare", &["--version"][..], "util-linux"),
    ] {
        if !ok(prog, args) {
            return Some(format!(
                "no `{prog}` on PATH (install Debian's {pkg}: `apt-get install {pkg}`)"
            ));
        }
    }
    let probe = format!(
        "{PREFIX}{}probe{}",
        std::process::id(),
        MADE.fetch_add(1, Ordering::SeqCst)
    );
    if !ok("ip", &["netns", "add", &probe]) {
        return Some(format!(
            "`ip netns add {probe}` failed: this machine (or container) does not permit network \
             namespaces"
        ));
    }
    let _ = ok("ip", &["netns", "del", &probe]);
    None
}

/// `cargo xtask cluster [--hosts N] [--link RATE [--flow RATE]] [--rtt TIME] -- COMMAND
/// [ARGS]`: runs COMMAND on host h0 of an emulated cluster of N hosts (default 2) whose links
/// run at the `--link` rate (a `tc` rate such as `1gbit`; default unshaped), each TCP
/// connection capped at the `--flow` rate when given, the round-trip time between hosts
/// raised by `--rtt` (such as `1ms`) ([`Shaping`]), with `FH_RSH_AGENT` and
/// `OMPI_MCA_plm_rsh_agent` naming the cluster's rsh agent (so `fhrun -H h0:2,h1:2 ...` and
/// `mpirun -H h0,h1 ...` reach the other hosts); first measures and prints the rate of 1 and 8
/// parallel TCP streams h0 → h1; tears the cluster down when COMMAND ends (or this process
/// dies); exits with COMMAND's status.
pub(crate) fn task(args: &[String]) -> std::process::ExitCode {
    use std::process::ExitCode;
    const USAGE: &str = "usage: cargo xtask cluster [--hosts N] [--link RATE [--flow RATE]] \
                         [--rtt TIME] -- COMMAND [ARGS]";
    let mut hosts = 2usize;
    let (mut link, mut flow, mut rtt): (Option<String>, Option<String>, Option<String>) =
        (None, None, None);
    let mut it = args.iter();
    let mut command: Vec<String> = Vec::new();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--hosts" => match it.next().and_then(|v| v.parse().ok()) {
                Some(n) => hosts = n,
                None => {
                    eprintln!("--hosts wants a number of hosts\n{USAGE}");
                    return ExitCode::from(2);
                }
            },
            "--link" | "--flow" | "--rtt" => match it.next() {
                Some(v) if a == "--link" => link = Some(v.clone()),
                Some(v) if a == "--flow" => flow = Some(v.clone()),
                Some(v) => rtt = Some(v.clone()),
                None => {
                    eprintln!("{a} wants a value such as 1gbit or 1ms\n{USAGE}");
                    return ExitCode::from(2);
                }
            },
            "--" => {
                command = it.cloned().collect();
                break;
            }
            other => {
                eprintln!("unexpected argument `{other}`\n{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    if command.is_empty() {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    }
    let shaping = match Shaping::new(link.as_deref(), flow.as_deref())
        .and_then(|s| s.with_rtt(rtt.as_deref()))
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!("xtask cluster: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let c = match Cluster::up(hosts, &shaping) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("xtask cluster: {e}");
            return ExitCode::FAILURE;
        }
    };
    let agent = match c.rsh_agent() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("xtask cluster: {e}");
            return ExitCode::FAILURE;
        }
    };
    let names: Vec<String> = c
        .hosts
        .iter()
        .map(|h| format!("{} ({})", h.name, h.addr))
        .collect();
    let measured = if hosts >= 2 {
        match c.link_rates(0, 1, 2.0, &STREAMS, &|c: &mut Command, a: &[&str]| {
            c.arg("__link-probe").args(a);
        }) {
            Ok(r) => format!("; TCP h0 -> h1 measured: {}", show_rates(&r)),
            Err(e) => format!("; the link probe failed: {e}"),
        }
    } else {
        String::new()
    };
    eprintln!(
        "xtask cluster: hosts {}, {}{measured}; running on h0 with FH_RSH_AGENT={}",
        names.join(", "),
        shaping.describe(),
        agent.display()
    );
    let status = c
        .command(0, &command[0])
        .args(&command[1..])
        .env("FH_RSH_AGENT", &agent)
        .env("OMPI_MCA_plm_rsh_agent", &agent)
        .status();
    let down = c.down();
    if let Err(e) = down {
        eprintln!("xtask cluster: {e}");
    }
    match status {
        Ok(s) => ExitCode::from(s.code().and_then(|c| u8::try_from(c).ok()).unwrap_or(1)),
        Err(e) => {
            eprintln!("xtask cluster: cannot run {}: {e}", command[0]);
            ExitCode::FAILURE
        }
    }
}

/// One emulated host.
pub(crate) struct Host {
    /// Its UTS host name, `h<i>` (what `hostname` says inside it; a name for `-H` lists).
    pub name: String,
    /// Its address on the cluster's network.
    pub addr: String,
    /// The near end of its link, in the root namespace (set down to cut the host off).
    link: String,
    /// The process holding its mount and UTS namespaces.
    holder: Child,
}

/// An emulated cluster; torn down by [`Cluster::down`] or on drop (see the module docs).
pub(crate) struct Cluster {
    id: String,
    dir: PathBuf,
    hosts: Vec<Host>,
    /// The guardian and the write end of its pipe (dropping it starts the teardown).
    guardian: Option<(Child, ChildStdin)>,
    /// The threads adding the round-trip time (none without one).
    delayer: delay::Delayer,
}

/// A command's failure, as text for the operator.
fn sh(cmd: &mut Command) -> Result<(), String> {
    let shown = format!("{cmd:?}");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {shown}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{shown} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    sh(Command::new("ip").args(args))
}

/// Whether process `pid` exists.
fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Removes what dead runs left: namespaces, links and directories named `fhc<pid>...` whose
/// process is gone (a run killed together with its guardian).
fn remove_orphans(base: &Path) {
    let dead = |name: &str| -> bool {
        let Some(rest) = name.strip_prefix(PREFIX) else {
            return false;
        };
        let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
        digits
            .parse::<u32>()
            .is_ok_and(|pid| pid != std::process::id() && !alive(pid))
    };
    if let Ok(out) = Command::new("ip").args(["netns", "list"]).output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let ns = line.split_whitespace().next().unwrap_or("");
            if dead(ns) {
                kill_namespace(ns);
                let _ = ip(&["netns", "del", ns]);
            }
        }
    }
    if let Ok(out) = Command::new("ip").args(["-o", "link", "show"]).output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let name = line.split(':').nth(1).unwrap_or("").trim();
            let name = name.split('@').next().unwrap_or("");
            if dead(name) {
                let _ = ip(&["link", "del", name]);
            }
        }
    }
    if let Ok(entries) = fs::read_dir(base) {
        for e in entries.flatten() {
            if dead(&e.file_name().to_string_lossy()) {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
}

/// SIGKILLs every process in network namespace `ns`.
fn kill_namespace(ns: &str) {
    if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            let _ = Command::new("kill").args(["-KILL", pid]).status();
        }
    }
}

impl Cluster {
    /// Brings up `hosts` hosts (1 to 200) whose links are shaped as `shaping` says (rate and
    /// per-flow cap, [`Shaping`]). Everything made so far is removed again on an error.
    pub(crate) fn up(hosts: usize, shaping: &Shaping) -> Result<Cluster, String> {
        if !(1..=200).contains(&hosts) {
            return Err(format!(
                "an emulated cluster has 1 to 200 hosts, not {hosts}"
            ));
        }
        if let Some(why) = unavailable() {
            return Err(format!("cannot emulate a cluster here: {why}"));
        }
        let base = std::env::temp_dir().join("fh-cluster");
        remove_orphans(&base);
        let n = MADE.fetch_add(1, Ordering::SeqCst);
        let id = format!(
            "{PREFIX}{}{}",
            std::process::id(),
            char::from(b'a' + (n % 26) as u8)
        );
        let dir = base.join(&id);
        fs::create_dir_all(dir.join("hosts"))
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let bridge = format!("{id}b");
        let netns: Vec<String> = (0..hosts).map(|i| format!("{id}-h{i}")).collect();
        let links: Vec<String> = (0..hosts).map(|i| format!("{id}h{i}")).collect();

        // The guardian first, so that a failure below leaves nothing behind either.
        let mut script = String::from("cat >/dev/null\n");
        for ns in &netns {
            script += &format!(
                "for p in $(ip netns pids {ns} 2>/dev/null); do kill -KILL $p 2>/dev/null; done\n"
            );
        }
        script += "sleep 0.2\n";
        for ns in &netns {
            script += &format!("ip netns del {ns} 2>/dev/null\n");
        }
        for l in &links {
            script += &format!("ip link del {l} 2>/dev/null\n");
        }
        script += &format!(
            "ip link del {bridge} 2>/dev/null\nrm -rf '{}'\n",
            dir.display()
        );
        let mut guardian = {
            use std::os::unix::process::CommandExt;
            Command::new("sh")
                .args(["-c", &script])
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .process_group(0)
                .spawn()
                .map_err(|e| format!("cannot start the cluster's guardian (sh): {e}"))?
        };
        let pipe = guardian.stdin.take().expect("stdin is piped");
        let mut cluster = Cluster {
            id,
            dir,
            hosts: Vec::new(),
            guardian: Some((guardian, pipe)),
            delayer: delay::Delayer::default(),
        };
        cluster.build(&bridge, &netns, &links, shaping)?;
        Ok(cluster)
    }

    fn build(
        &mut self,
        bridge: &str,
        netns: &[String],
        links: &[String],
        shaping: &Shaping,
    ) -> Result<(), String> {
        // The cluster's /etc/hosts, mounted over the real one inside every host: the hosts'
        // names resolve to their addresses there, and nothing changes outside.
        let mut names = String::from("127.0.0.1 localhost\n::1 localhost\n");
        for i in 0..netns.len() {
            names += &format!("10.77.0.{} h{i}\n", i + 1);
        }
        let etc_hosts = self.dir.join("etc-hosts");
        fs::write(&etc_hosts, names)
            .map_err(|e| format!("cannot write {}: {e}", etc_hosts.display()))?;
        ip(&["link", "add", bridge, "type", "bridge"])?;
        ip(&["link", "set", bridge, "up"])?;
        for (i, (ns, link)) in netns.iter().zip(links).enumerate() {
            let inner = format!("{}i{i}", self.id);
            let addr = format!("10.77.0.{}", i + 1);
            ip(&["netns", "add", ns])?;
            ip(&["link", "add", link, "type", "veth", "peer", "name", &inner])?;
            ip(&["link", "set", &inner, "netns", ns])?;
            ip(&["link", "set", link, "master", bridge, "up"])?;
            ip(&["-n", ns, "link", "set", &inner, "name", "eth0"])?;
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            shaping.apply(None, link)?;
            if let Some(rtt) = shaping.rtt {
                // Half the round trip on the way in to each host.
                self.delayer.add(ns, rtt / 2)?;
            }
            shaping.apply(Some(ns), "eth0")?;
            let name = format!("h{i}");
            // The holder: a mount namespace with a fresh /dev/shm and a UTS namespace named
            // `name`, inside the host's network namespace; it prints `ready` once set up.
            let mut holder = Command::new("ip")
                .args(["netns", "exec", ns, "unshare", "--mount", "--uts"])
                .args(["--propagation", "private", "sh", "-c"])
                .arg(format!(
                    "mount -t tmpfs -o mode=1777 fh-shm /dev/shm && \
                     mount --bind '{}' /etc/hosts && hostname {name} && \
                     echo ready && exec sleep 1000000",
                    etc_hosts.display()
                ))
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| format!("cannot start host {name}'s holder: {e}"))?;
            let mut line = String::new();
            let mut out = std::io::BufReader::new(holder.stdout.take().expect("piped"));
            let _ = std::io::BufRead::read_line(&mut out, &mut line);
            if line.trim() != "ready" {
                let _ = holder.kill();
                let _ = holder.wait();
                let mut err = String::new();
                if let Some(mut e) = holder.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut err);
                }
                return Err(format!(
                    "host {name}: cannot set up its mount and UTS namespaces: {}",
                    err.trim()
                ));
            }
            fs::write(self.dir.join("hosts").join(&name), holder.id().to_string())
                .map_err(|e| format!("cannot record host {name}: {e}"))?;
            self.hosts.push(Host {
                name,
                addr,
                link: link.clone(),
                holder,
            });
        }
        Ok(())
    }

    /// The cluster's directory (its scratch space; removed at teardown).
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// A command that runs `program` on host `host` (in its network, mount and UTS namespaces,
    /// in the current directory, with this process's environment).
    pub(crate) fn command(&self, host: usize, program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new("nsenter");
        c.arg("-t")
            .arg(self.hosts[host].holder.id().to_string())
            .args(["-n", "-m", "-u"]);
        if let Ok(cwd) = std::env::current_dir() {
            c.arg(format!("--wd={}", cwd.display()));
        }
        c.arg("--").arg(program);
        c
    }

    /// Writes the cluster's rsh agent (an `ssh` stand-in: `agent HOST COMMAND...` runs the
    /// command through `sh -c` on the emulated host named HOST, by UTS name or address) and
    /// returns its path. For `mpirun --mca plm_rsh_agent` and `fhrun --rsh-agent`.
    pub(crate) fn rsh_agent(&self) -> Result<PathBuf, String> {
        let path = self.dir.join("rsh-agent");
        let hosts = self.dir.join("hosts");
        let mut map = String::new();
        for h in &self.hosts {
            map += &format!("    {}|{}) name={} ;;\n", h.name, h.addr, h.name);
        }
        let text = format!(
            "#!/bin/sh\n\
             # rsh agent of an emulated FastHorovod cluster: agent [-x] HOST COMMAND...\n\
             while [ $# -gt 0 ]; do case \"$1\" in -*) shift ;; *) break ;; esac; done\n\
             host=\"${{1:?usage: rsh-agent HOST COMMAND...}}\"; shift\n\
             host=\"${{host#*@}}\"\n\
             case \"$host\" in\n{map}    *) echo \"rsh-agent: no emulated host $host\" >&2; exit 255 ;;\n\
             esac\n\
             pid=$(cat '{}'/\"$name\") || exit 255\n\
             exec nsenter -t \"$pid\" -n -m -u --wd=\"$PWD\" -- sh -c \"$*\"\n",
            hosts.display()
        );
        let mut f =
            fs::File::create(&path).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        f.write_all(text.as_bytes())
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        drop(f);
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("cannot make {} executable: {e}", path.display()))?;
        Ok(path)
    }

    /// The processes running on host `host` (in its network namespace), but its holder.
    pub(crate) fn processes(&self, host: usize) -> Vec<u32> {
        let holder = self.hosts[host].holder.id();
        Command::new("ip")
            .args(["netns", "pids", &format!("{}-h{host}", self.id)])
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .split_whitespace()
                    .filter_map(|p| p.parse().ok())
                    .filter(|&p| p != holder)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Shapes both directions of host `host`'s link to `rate` (a `tc` rate), its queue bounded
    /// by `latency` (a `tc` time): a low rate with a long queue is a delay spike. The cluster
    /// must have been brought up with a rate (its links have a `tbf` qdisc to change).
    pub(crate) fn shape(&self, host: usize, rate: &str, latency: &str) -> Result<(), String> {
        let tbf = [
            "root", "tbf", "rate", rate, "burst", "1mb", "latency", latency,
        ];
        let ns = format!("{}-h{host}", self.id);
        sh(Command::new("tc")
            .args(["qdisc", "change", "dev", &self.hosts[host].link])
            .args(tbf))?;
        sh(Command::new("tc")
            .args(["-n", &ns, "qdisc", "change", "dev", "eth0"])
            .args(tbf))
    }

    /// The network namespace of host `host`.
    pub(crate) fn netns(&self, host: usize) -> String {
        format!("{}-h{host}", self.id)
    }

    /// The near end (in the root namespace) of host `host`'s link.
    pub(crate) fn link(&self, host: usize) -> String {
        self.hosts[host].link.clone()
    }

    /// Loads the nftables `rules` (`nft -f` syntax) in host `host`'s network namespace, or
    /// with `rules` empty removes the table `fhchaos` from it.
    pub(crate) fn nft(&self, host: usize, rules: &str) -> Result<(), String> {
        if rules.is_empty() {
            let _ = self
                .command(host, "nft")
                .args(["delete", "table", "inet", "fhchaos"])
                .stderr(Stdio::null())
                .status();
            return Ok(());
        }
        let mut c = self
            .command(host, "nft")
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run nft (install Debian's nftables): {e}"))?;
        if let Some(mut i) = c.stdin.take() {
            i.write_all(rules.as_bytes())
                .map_err(|e| format!("nft: {e}"))?;
        }
        let out = c.wait_with_output().map_err(|e| format!("nft: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "nft on h{host} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// Cuts host `host` off the network (`up == false`) or reconnects it.
    pub(crate) fn set_link(&self, host: usize, up: bool) -> Result<(), String> {
        let l = &self.hosts[host].link;
        ip(&["link", "set", l, if up { "up" } else { "down" }])
    }

    /// Starts a job of `per_host[h]` ranks on host `h` (ranks numbered host by host), each
    /// running `program args` with the launcher's variables as fhrun writes them
    /// ([`fh_job::LaunchInfo::to_vars`]: `FH_RANK`, `FH_SIZE`, `FH_LOCAL_*`, `FH_CROSS_*`,
    /// `FH_RENDEZVOUS_ADDR` on host 0, a fresh `FH_JOB_TOKEN`, `timeout` as
    /// `FH_TIMEOUT_SECONDS`), then `env`; each rank's stdout and stderr go to a file under the cluster's directory.
    pub(crate) fn launch(
        &self,
        per_host: &[usize],
        program: &Path,
        args: &[&str],
        timeout: Duration,
        env: &[(&str, &str)],
    ) -> Result<Job, String> {
        if per_host.len() > self.hosts.len() || per_host.contains(&0) {
            return Err(format!(
                "layout {per_host:?} does not fit {} hosts with at least one rank each",
                self.hosts.len()
            ));
        }
        let size: usize = per_host.iter().sum();
        let token = fresh_token()?;
        let n = MADE.fetch_add(1, Ordering::SeqCst);
        let logs = self.dir.join(format!("job{n}"));
        fs::create_dir_all(&logs).map_err(|e| format!("cannot create {}: {e}", logs.display()))?;
        let mut ranks = Vec::new();
        let mut rank = 0;
        for (h, &m) in per_host.iter().enumerate() {
            for local in 0..m {
                let log = logs.join(format!("rank{rank}.log"));
                let file = fs::File::create(&log)
                    .map_err(|e| format!("cannot create {}: {e}", log.display()))?;
                let err = file
                    .try_clone()
                    .map_err(|e| format!("cannot create {}: {e}", log.display()))?;
                let place = fh_job::Topology {
                    rank,
                    size,
                    local_rank: local,
                    local_size: m,
                    cross_rank: h,
                    cross_size: per_host.len(),
                };
                let mut launch = fh_job::LaunchInfo::for_rank(
                    place,
                    format!("{}:{RENDEZVOUS_PORT}", self.hosts[0].addr),
                    fh_job::JobToken::new(token.clone()),
                );
                launch.timeout = timeout;
                let mut c = self.command(h, program);
                c.args(args)
                    .envs(launch.to_vars())
                    .envs(env.iter().copied())
                    .stdin(Stdio::null())
                    .stdout(file)
                    .stderr(err);
                let child = c
                    .spawn()
                    .map_err(|e| format!("cannot start rank {rank} on h{h}: {e}"))?;
                ranks.push((child, log));
                rank += 1;
            }
        }
        Ok(Job { ranks })
    }

    /// Tears the cluster down now and waits (bounded) until it is gone.
    pub(crate) fn down(mut self) -> Result<(), String> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<(), String> {
        // The delaying threads first: they live in the hosts' namespaces.
        drop(std::mem::take(&mut self.delayer));
        let Some((mut guardian, pipe)) = self.guardian.take() else {
            return Ok(());
        };
        drop(pipe);
        let start = Instant::now();
        let status = loop {
            match guardian.try_wait() {
                Ok(Some(s)) => break Some(s),
                Ok(None) if start.elapsed() < Duration::from_secs(30) => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => break None,
            }
        };
        for h in &mut self.hosts {
            let _ = h.holder.kill();
            let _ = h.holder.wait();
        }
        match status {
            Some(_) => Ok(()),
            None => Err(format!(
                "the teardown of cluster {} did not finish within 30 s",
                self.id
            )),
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            eprintln!("cluster: {e}");
        }
    }
}

/// 32 random bytes from the kernel, as 64 hex digits.
fn fresh_token() -> Result<String, String> {
    let mut buf = [0u8; 32];
    fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut buf))
        .map_err(|e| format!("cannot read /dev/urandom for a job token: {e}"))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// A rank's end: its exit status (`None`: killed by the harness at the deadline), output, and
/// when its exit was seen, counted from the call to [`Job::wait`] (to 20 ms).
pub(crate) struct RankEnd {
    pub status: Option<ExitStatus>,
    pub output: String,
    pub after: Duration,
}

/// The ranks of a job started by [`Cluster::launch`]. Dropping it kills what still runs.
pub(crate) struct Job {
    ranks: Vec<(Child, PathBuf)>,
}

impl Job {
    /// SIGKILLs rank `rank`.
    pub(crate) fn kill(&mut self, rank: usize) {
        let _ = self.ranks[rank].0.kill();
    }

    /// What rank `rank` has written so far (stdout and stderr).
    pub(crate) fn output(&self, rank: usize) -> String {
        fs::read_to_string(&self.ranks[rank].1).unwrap_or_default()
    }

    /// Waits until every rank's output contains `text`, at most `limit`; `false` when some rank
    /// did not write it in time (or exited).
    pub(crate) fn wait_for_all(&mut self, text: &str, limit: Duration) -> bool {
        let start = Instant::now();
        loop {
            if (0..self.ranks.len()).all(|r| self.output(r).contains(text)) {
                return true;
            }
            let exited = self
                .ranks
                .iter_mut()
                .any(|(c, _)| matches!(c.try_wait(), Ok(Some(_))));
            if exited || start.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for every rank, at most `limit` in all; ranks still running then are killed (their
    /// status is `None`).
    pub(crate) fn wait(mut self, limit: Duration) -> Vec<RankEnd> {
        let start = Instant::now();
        let mut ends: Vec<Option<(Option<ExitStatus>, Duration)>> = vec![None; self.ranks.len()];
        while ends.iter().any(Option::is_none) {
            for (i, (child, _)) in self.ranks.iter_mut().enumerate() {
                if ends[i].is_none() {
                    if let Ok(Some(s)) = child.try_wait() {
                        ends[i] = Some((Some(s), start.elapsed()));
                    }
                }
            }
            if start.elapsed() > limit {
                for (i, (child, _)) in self.ranks.iter_mut().enumerate() {
                    if ends[i].is_none() {
                        let _ = child.kill();
                        let _ = child.wait();
                        ends[i] = Some((None, start.elapsed()));
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let ranks = std::mem::take(&mut self.ranks);
        ranks
            .into_iter()
            .zip(ends)
            .map(|((_, log), end)| {
                let (status, after) = end.unwrap_or((None, start.elapsed()));
                RankEnd {
                    status,
                    output: fs::read_to_string(&log).unwrap_or_default(),
                    after,
                }
            })
            .collect()
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for (child, _) in &mut self.ranks {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[cfg(test)]
mod tests;
