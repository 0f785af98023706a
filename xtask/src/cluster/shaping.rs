//! How an emulated cluster's links are shaped: the link's rate, and optionally a cap on every
//! TCP connection (a cloud's per-flow limit), set up with what this kernel has (`tbf`, `htb`,
//! nftables; it has neither `sch_fq` nor `sch_netem`).
//!
//! Each host's link is a `tbf` at the link rate on both ends (the host's egress, `eth0` in its
//! namespace, and its ingress, the near end in the root namespace). With a per-flow cap, the
//! egress `tbf` gets a child `htb` whose [`FLOW_CLASSES`] leaf classes each run at rate = ceil =
//! the cap, and an nftables table `fhflow` in the host's namespace gives each new connection a
//! leaf of its own: a conntrack mark drawn round-robin (`numgen inc`), mapped on every packet
//! into the packet's priority, which `htb` reads as its class (the mark is drawn at the first
//! packet the host sends on the connection, whichever end opened it). Every flow leaves some host
//! through that host's `eth0`, so each direction of every connection is capped once; the
//! ingress `tbf` only bounds the host's aggregate. Two concurrent connections share a leaf only
//! after [`FLOW_CLASSES`] more have been opened in between.
//!
//! A round-trip time is added by holding every packet a host receives on `eth0` for half of it
//! ([`super::delay`]: an iptables `NFQUEUE` rule in the host's namespace, as the kernel has
//! neither `netem` nor nftables' `queue`).

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Leaf classes of the per-flow `htb` (connections per host before two share a cap).
pub(crate) const FLOW_CLASSES: u32 = 64;

/// The `htb` class that takes what nftables did not classify (ARP, say): one more flow.
const DEFAULT_CLASS: u32 = 0xffff;

/// The shaping of every host's link: its rate, and a cap per TCP connection. Rates are kept
/// in bits per second (parsed from `tc`'s notation by [`parse_rate`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Shaping {
    /// The link's rate (`None`: unshaped).
    pub link: Option<u64>,
    /// The cap on each TCP connection (needs `link`).
    pub flow: Option<u64>,
    /// The round-trip time added between hosts (`None`: none).
    pub rtt: Option<Duration>,
}

impl Shaping {
    /// Links at `rate` (a `tc` rate such as `1gbit`), no per-flow cap.
    pub(crate) fn link(rate: &str) -> Result<Shaping, String> {
        Shaping::new(Some(rate), None)
    }

    /// The same with a round-trip time `rtt` (a time such as `1ms` or `500us`; `None`: none)
    /// added between hosts.
    pub(crate) fn with_rtt(mut self, rtt: Option<&str>) -> Result<Shaping, String> {
        self.rtt = rtt.map(parse_time).transpose()?;
        Ok(self)
    }

    /// Links at `link` with each connection capped at `flow` (`tc` rates; `None`: none).
    pub(crate) fn new(link: Option<&str>, flow: Option<&str>) -> Result<Shaping, String> {
        let link = link.map(parse_rate).transpose()?;
        let flow = flow.map(parse_rate).transpose()?;
        match (link, flow) {
            (None, Some(_)) => Err(
                "a per-flow cap (--flow) needs a link rate (--link), e.g. --link 2gbit --flow 500mbit"
                    .into(),
            ),
            (Some(l), Some(f)) if f > l => Err(format!(
                "the per-flow cap ({}) exceeds the link rate ({}): give a smaller --flow",
                show_rate(f),
                show_rate(l)
            )),
            _ => Ok(Shaping {
                link,
                flow,
                rtt: None,
            }),
        }
    }

    /// What it is, for reports: `2 Gbit/s links, 500 Mbit/s per flow`, or `unshaped links`.
    pub(crate) fn describe(&self) -> String {
        let rtt = match self.rtt {
            Some(t) => format!(", round trip +{} ms (NFQUEUE)", t.as_secs_f64() * 1e3),
            None => String::new(),
        };
        let rates = match (self.link, self.flow) {
            (None, _) => "unshaped links".into(),
            (Some(l), None) => format!("{} links (tc tbf)", show_rate(l)),
            (Some(l), Some(f)) => format!(
                "{} links, {} per TCP connection (tc tbf + htb, nftables)",
                show_rate(l),
                show_rate(f)
            ),
        };
        rates + &rtt
    }

    /// The `tc` commands (arguments after `tc`, without `-n NS`) that shape a link end
    /// `dev`; `egress` is the host's own end (`eth0`), which gets the per-flow cap.
    pub(crate) fn tc_commands(&self, dev: &str, egress: bool) -> Vec<Vec<String>> {
        let Some(link) = self.link else {
            return Vec::new();
        };
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<String>>();
        let link = format!("{link}bit");
        // burst: a few milliseconds at 10 Gbit/s, so that one timer tick never starves the
        // link; latency bounds the queue.
        let mut out = vec![s(&[
            "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", &link, "burst",
            "1mb", "latency", "50ms",
        ])];
        if let (Some(flow), true) = (self.flow, egress) {
            let flow = format!("{flow}bit");
            out.push(s(&[
                "qdisc",
                "add",
                "dev",
                dev,
                "parent",
                "1:1",
                "handle",
                "2:",
                "htb",
                "default",
                &format!("{DEFAULT_CLASS:x}"),
            ]));
            for class in (1..=FLOW_CLASSES).chain([DEFAULT_CLASS]) {
                // quantum: a full-size frame's worth at least (htb's default, rate / 10,
                // is over its limit at these rates).
                out.push(s(&[
                    "class",
                    "add",
                    "dev",
                    dev,
                    "parent",
                    "2:",
                    "classid",
                    &format!("2:{class:x}"),
                    "htb",
                    "rate",
                    &flow,
                    "ceil",
                    &flow,
                    "quantum",
                    "60000",
                ]));
            }
        }
        out
    }

    /// The nftables rules (`nft -f` syntax) for a host's namespace (table `fhcloud`), or
    /// `None` without a per-flow cap: each connection gets a conntrack mark 1..=[`FLOW_CLASSES`] in turn at the
    /// first packet the host sends on it (a SYN for connections it makes, a SYN-ACK for those
    /// it accepts: both directions of every connection are capped), and every packet the
    /// priority `2:<mark>` (the `htb` leaf of that connection).
    pub(crate) fn nft_rules(&self) -> Option<String> {
        self.flow?;
        let map: Vec<String> = (1..=FLOW_CLASSES)
            .map(|k| format!("{k} : 2:{k:x}"))
            .collect();
        Some(format!(
            "table inet fhcloud {{\n  chain out {{\n    type filter hook output priority 0; \
             policy accept;\n    ct mark 0 ct mark set numgen inc mod {FLOW_CLASSES} offset 1\n    \
             meta priority set ct mark map {{ {} }}\n  }}\n}}\n",
            map.join(", ")
        ))
    }

    /// Shapes host link end `dev` (in network namespace `ns`, or the root namespace), and with
    /// a per-flow cap on the egress end loads the nftables rules in `ns`.
    pub(crate) fn apply(&self, ns: Option<&str>, dev: &str) -> Result<(), String> {
        let egress = ns.is_some();
        for args in self.tc_commands(dev, egress) {
            let mut c = Command::new("tc");
            if let Some(ns) = ns {
                c.args(["-n", ns]);
            }
            super::sh(c.args(&args))?;
        }
        if let (Some(ns), Some(_)) = (ns, self.rtt) {
            // This kernel's nftables has no `queue` expression; iptables' NFQUEUE target
            // (through nftables' xtables compatibility) does the same. `--queue-bypass`:
            // packets pass when nothing holds the queue.
            let queue = super::delay::QUEUE.to_string();
            super::sh(Command::new("ip").args(["netns", "exec", ns]).args([
                "iptables",
                "-w",
                "-A",
                "INPUT",
                "-i",
                "eth0",
                "-j",
                "NFQUEUE",
                "--queue-num",
                &queue,
                "--queue-bypass",
            ]))
            .map_err(|e| {
                format!(
                    "{e} (the round-trip time needs iptables' NFQUEUE target: apt-get install \
                     iptables)"
                )
            })?;
        }
        if let (Some(ns), Some(rules)) = (ns, self.nft_rules()) {
            let mut c = Command::new("ip")
                .args(["netns", "exec", ns, "nft", "-f", "-"])
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| format!("cannot run nft (install Debian's nftables): {e}"))?;
            if let Some(mut i) = c.stdin.take() {
                i.write_all(rules.as_bytes())
                    .map_err(|e| format!("nft: {e}"))?;
            }
            let out = c.wait_with_output().map_err(|e| format!("nft: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "the per-flow rules (nft in {ns}) failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
        }
        Ok(())
    }
}

impl super::Cluster {
    /// The bytes host `host` has sent through each per-flow `htb` leaf (`2:1` to
    /// `2:`[`FLOW_CLASSES`], in that order; each carries the connections mapped to it), read
    /// from `tc -s class show`; empty without a per-flow cap.
    pub(crate) fn flow_bytes(&self, host: usize) -> Result<Vec<u64>, String> {
        let out = Command::new("tc")
            .args([
                "-n",
                &self.netns(host),
                "-s",
                "class",
                "show",
                "dev",
                "eth0",
            ])
            .output()
            .map_err(|e| format!("cannot run tc: {e}"))?;
        Ok(leaf_bytes(&String::from_utf8_lossy(&out.stdout)))
    }
}

/// The `Sent N bytes` of each leaf `2:1`..=`2:`[`FLOW_CLASSES`] in `tc -s class show` output.
fn leaf_bytes(text: &str) -> Vec<u64> {
    let mut bytes = Vec::new();
    let mut class: Option<usize> = None;
    for line in text.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            ["class", "htb", id, ..] => {
                class = id
                    .strip_prefix("2:")
                    .and_then(|m| usize::from_str_radix(m, 16).ok())
                    .filter(|&m| (1..=FLOW_CLASSES as usize).contains(&m));
            }
            ["Sent", n, "bytes", ..] => {
                if let (Some(m), Ok(n)) = (class.take(), n.parse::<u64>()) {
                    if bytes.len() < m {
                        bytes.resize(m, 0);
                    }
                    bytes[m - 1] = n;
                }
            }
            _ => {}
        }
    }
    bytes
}

/// A `tc` rate in bits per second: a number and a unit, `bit`, `kbit`, `mbit`, `gbit`, `tbit`
/// (bits per second, powers of 1000) or `bps`, `kbps`, `mbps`, `gbps`, `tbps` (bytes per
/// second), as `tc` reads them.
pub(crate) fn parse_rate(text: &str) -> Result<u64, String> {
    let t = text.trim().to_ascii_lowercase();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bits_per: f64 = match unit {
        "bit" => 1.0,
        "kbit" => 1e3,
        "mbit" => 1e6,
        "gbit" => 1e9,
        "tbit" => 1e12,
        "bps" => 8.0,
        "kbps" => 8e3,
        "mbps" => 8e6,
        "gbps" => 8e9,
        "tbps" => 8e12,
        _ => {
            return Err(format!(
                "`{text}` is not a rate: give a number and a unit, e.g. 500mbit or 2gbit \
                 (bit, kbit, mbit, gbit; bps, kbps, ... for bytes per second)"
            ))
        }
    };
    match num.parse::<f64>() {
        Ok(n) if n > 0.0 && (n * bits_per) >= 8e3 && (n * bits_per) < 1e13 => {
            Ok((n * bits_per).round() as u64)
        }
        _ => Err(format!(
            "`{text}` is not a rate between 8kbit and 10tbit, e.g. 500mbit or 2gbit"
        )),
    }
}

/// A time such as `1ms`, `500us` or `0.25s` (the units `us`, `ms`, `s`).
pub(crate) fn parse_time(text: &str) -> Result<Duration, String> {
    let t = text.trim().to_ascii_lowercase();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale = match unit {
        "us" => 1e-6,
        "ms" => 1e-3,
        "s" => 1.0,
        _ => return Err(format!("`{text}` is not a time: give e.g. 1ms or 500us")),
    };
    match num.parse::<f64>() {
        Ok(n) if n > 0.0 && n * scale <= 10.0 => Ok(Duration::from_secs_f64(n * scale)),
        _ => Err(format!(
            "`{text}` is not a round-trip time between 0 and 10 s, e.g. 1ms"
        )),
    }
}

/// A rate for people: `500 Mbit/s`, `2 Gbit/s`, `1.5 Gbit/s`.
pub(crate) fn show_rate(bits: u64) -> String {
    let b = bits as f64;
    let (v, unit) = if b >= 1e9 {
        (b / 1e9, "Gbit/s")
    } else if b >= 1e6 {
        (b / 1e6, "Mbit/s")
    } else {
        (b / 1e3, "kbit/s")
    };
    let v = format!("{v:.3}");
    let v = v.trim_end_matches('0').trim_end_matches('.');
    format!("{v} {unit}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_read_as_tc_reads_them() {
        assert_eq!(parse_rate("500mbit"), Ok(500_000_000));
        assert_eq!(parse_rate("2gbit"), Ok(2_000_000_000));
        assert_eq!(parse_rate("1.5Gbit"), Ok(1_500_000_000));
        assert_eq!(parse_rate("100mbps"), Ok(800_000_000));
        for bad in ["2g", "fast", "mbit", "0mbit", "-1gbit", "1bit"] {
            assert!(parse_rate(bad).is_err(), "{bad}");
        }
        assert_eq!(show_rate(500_000_000), "500 Mbit/s");
        assert_eq!(show_rate(1_500_000_000), "1.5 Gbit/s");
    }

    #[test]
    fn a_flow_cap_needs_a_link_below_it() {
        assert!(Shaping::new(None, Some("1gbit"))
            .unwrap_err()
            .contains("needs a link rate"));
        assert!(Shaping::new(Some("1gbit"), Some("2gbit"))
            .unwrap_err()
            .contains("exceeds the link rate"));
        let s = Shaping::new(Some("2gbit"), Some("500mbit")).unwrap();
        assert_eq!(
            s.describe(),
            "2 Gbit/s links, 500 Mbit/s per TCP connection (tc tbf + htb, nftables)"
        );
    }

    #[test]
    fn leaf_counters_are_read_by_class() {
        let text = "class tbf 1:1 parent 1: leaf 2: \n\n\
                    class htb 2:a root prio 0 rate 500Mbit ceil 500Mbit\n \
                    Sent 1200 bytes 3 pkt (dropped 0, overlimits 0 requeues 0) \n\n\
                    class htb 2:ffff root prio 0 rate 500Mbit\n Sent 99 bytes 1 pkt\n\
                    class htb 2:2 root prio 0 rate 500Mbit\n Sent 7 bytes 1 pkt\n";
        let mut want = vec![0u64; 10];
        want[1] = 7;
        want[9] = 1200;
        assert_eq!(leaf_bytes(text), want);
    }

    #[test]
    fn only_the_egress_end_gets_a_leaf_per_flow() {
        let s = Shaping::new(Some("2gbit"), Some("500mbit")).unwrap();
        let egress = s.tc_commands("eth0", true);
        // The tbf, the htb, its leaves and the default class.
        assert_eq!(egress.len(), 2 + FLOW_CLASSES as usize + 1);
        assert!(egress[0].join(" ").contains("tbf rate 2000000000bit"));
        assert!(egress[1]
            .join(" ")
            .contains("parent 1:1 handle 2: htb default ffff"));
        assert!(egress[2]
            .join(" ")
            .contains("classid 2:1 htb rate 500000000bit ceil 500000000bit"));
        assert_eq!(s.tc_commands("veth", false).len(), 1);
        let rules = s.nft_rules().unwrap();
        assert!(rules.contains("numgen inc mod 64 offset 1"), "{rules}");

        assert!(rules.contains("64 : 2:40 }"), "{rules}");
        let plain = Shaping::link("1gbit").unwrap();
        assert!(plain.nft_rules().is_none());
        let slow = plain.clone().with_rtt(Some("1ms")).unwrap();
        assert_eq!(slow.rtt, Some(Duration::from_millis(1)));
        assert!(slow.nft_rules().is_none());
        assert_eq!(parse_time("500us"), Ok(Duration::from_micros(500)));
        assert!(parse_time("1 hour").is_err());
        assert!(parse_time("0ms").is_err());
        assert_eq!(plain.tc_commands("eth0", true).len(), 1);
        assert!(Shaping::default().tc_commands("eth0", true).is_empty());
    }
}
