use std::time::Duration;

use super::{HeartbeatSettings, JobToken, LaunchInfo, Topology};

proptest::proptest! {
    /// What the writer writes, the reader reads back: any fhrun launch, with all its host
    /// claims, the local one only or none (a bare launch), with any timeout, heartbeat
    /// settings, host id and wildcard permission.
    #[test]
    fn the_writer_and_the_reader_agree(
        hosts in 1usize..5,
        per_host in 1usize..5,
        pick in 0usize..1000,
        claims in 0u8..3,
        port in 1024u16..65535,
        timeout_ms in 1000u64..100_000,
        beats in proptest::option::of((40u64..500, 3u64..40)),
        host_id in proptest::option::of("[a-z][a-z0-9-]{0,20}"),
        wildcard: bool,
    ) {
        let size = hosts * per_host;
        let rank = pick % size;
        let t = Topology {
            rank,
            size,
            local_rank: rank % per_host,
            local_size: per_host,
            cross_rank: rank / per_host,
            cross_size: hosts,
        };
        let addr = if wildcard { "0.0.0.0" } else { "127.0.0.1" };
        let rendezvous = format!("{addr}:{port}");
        let token = JobToken::new("0123456789abcdef0123456789abcdef");
        let mut info = match claims {
            // Every claim, as fhrun gives it.
            0 => LaunchInfo::for_rank(t, rendezvous, token),
            // The local claim only: the hosts are the reader's consecutive blocks.
            1 => LaunchInfo {
                cross_vars: None,
                ..LaunchInfo::for_rank(t, rendezvous, token)
            },
            // None: the rank and the size only.
            _ => LaunchInfo {
                rendezvous: (size > 1).then_some(rendezvous),
                token: Some(token),
                ..LaunchInfo::bare(rank, size)
            },
        };
        info.timeout = Duration::from_millis(timeout_ms);
        info.liveness = beats.map(|(interval, times)| HeartbeatSettings {
            interval: Duration::from_millis(interval),
            silence: Duration::from_millis(interval * times),
        });
        info.host_id = host_id;
        info.allow_wildcard = wildcard;
        let vars: std::collections::HashMap<&str, String> = info.to_vars().into_iter().collect();
        let back = LaunchInfo::from_vars(|n| vars.get(n).cloned()).unwrap();
        proptest::prop_assert_eq!(back, info);
    }
}
