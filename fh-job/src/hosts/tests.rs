use proptest::prelude::*;

use super::*;

fn place(host: &str) -> Place {
    Place {
        host: HostId::named(host),
        local: None,
        cross: None,
        shm_free: 1 << 40,
    }
}

fn claimed(host: &str, local: (usize, usize)) -> Place {
    Place {
        local: Some(Claim::new(
            local.0,
            local.1,
            ("FH_LOCAL_RANK", "FH_LOCAL_SIZE"),
        )),
        ..place(host)
    }
}

fn topo(layout: &Layout, r: usize) -> (usize, usize, usize, usize) {
    let t = layout.topology(r);
    (t.local_rank, t.local_size, t.cross_rank, t.cross_size)
}

#[test]
fn place_round_trip_and_truncation() {
    let mut p = claimed("node-1", (1, 4));
    p.cross = Some(Claim::new(0, 2, ("FH_CROSS_RANK", "FH_CROSS_SIZE")));
    let bytes = p.encode();
    assert!(bytes.len() <= MAX_PLACE_LEN);
    assert_eq!(Place::decode(&bytes), Ok((p.clone(), bytes.len())));
    for cut in 0..bytes.len() {
        assert!(
            matches!(Place::decode(&bytes[..cut]), Err(DecodeError::NeedMore(n)) if n > cut),
            "cut at {cut}"
        );
    }
    let list = encode_places(&[p.clone(), place("b")]);
    let (back, used) = decode_places(&list, 2).unwrap();
    assert_eq!((back[0].clone(), used), (p, list.len()));
    assert!(decode_places(&list, 3).is_err());
    // A list cut anywhere asks for more, counted from the list's start.
    for cut in 0..list.len() {
        assert!(
            matches!(decode_places(&list[..cut], 2), Err(DecodeError::NeedMore(n)) if n > cut),
            "list cut at {cut}"
        );
    }
    let mut bad = place("x").encode();
    *bad.last_mut().unwrap() = 4;
    assert!(matches!(Place::decode(&bad), Err(DecodeError::Invalid(_))));
}

#[test]
fn detected_identity_is_stable_and_override_wins() {
    assert_eq!(HostId::detect(), HostId::detect());
    let mut info = LaunchInfo::single();
    assert_eq!(HostId::of(&info), HostId::detect());
    info.host_id = Some("rack7-node3".into());
    assert_eq!(HostId::of(&info).as_str(), "FH_HOST_ID=rack7-node3");
    assert_eq!(Place::of(&info).local, None);
}

#[test]
fn hosts_come_from_identities_alone() {
    let places: Vec<Place> = ["a", "b", "a", "b"].iter().map(|h| place(h)).collect();
    let l = settle(&places).unwrap();
    assert_eq!(l.hosts(), &[vec![0, 2], vec![1, 3]]);
    assert_eq!(topo(&l, 0), (0, 2, 0, 2));
    assert_eq!(topo(&l, 1), (0, 2, 1, 2));
    assert_eq!(topo(&l, 2), (1, 2, 0, 2));
    assert_eq!(topo(&l, 3), (1, 2, 1, 2));
    assert_eq!(choose(&l, &places, |_| 1), Choice::Hier);
    let one: Vec<Place> = (0..3).map(|_| place("a")).collect();
    let l = settle(&one).unwrap();
    assert_eq!(topo(&l, 2), (2, 3, 0, 1));
    assert_eq!(choose(&l, &one, |_| 1), Choice::Shm);
    assert!(matches!(choose(&l, &one, |_| u64::MAX), Choice::Tcp(why) if why.contains("/dev/shm")));
    let spread: Vec<Place> = ["a", "b", "c"].iter().map(|h| place(h)).collect();
    let l = settle(&spread).unwrap();
    assert!(matches!(choose(&l, &spread, |_| 1), Choice::Tcp(why) if why.contains("no host")));
}

#[test]
fn consistent_claims_are_kept() {
    // The launcher numbers host a's ranks backwards: a permutation is fine.
    let places = vec![
        claimed("a", (1, 2)),
        claimed("a", (0, 2)),
        claimed("b", (0, 1)),
    ];
    let l = settle(&places).unwrap();
    assert_eq!(l.hosts(), &[vec![1, 0], vec![2]]);
    assert_eq!(topo(&l, 0), (1, 2, 0, 2));
    // Claimed host indices reorder the hosts.
    let mut places = places;
    for (p, h) in places.iter_mut().zip([1, 1, 0]) {
        p.cross = Some(Claim::new(h, 2, ("GROUP_RANK", "GROUP_WORLD_SIZE")));
    }
    let l = settle(&places).unwrap();
    assert_eq!(l.hosts(), &[vec![2], vec![1, 0]]);
    assert_eq!(topo(&l, 2), (0, 1, 0, 2));
}

#[test]
fn a_local_size_against_the_facts_is_a_contradiction() {
    // Four ranks on two hosts, the launcher says one host of four.
    let places: Vec<Place> = ["a", "a", "b", "b"]
        .iter()
        .enumerate()
        .map(|(r, h)| claimed(h, (r, 4)))
        .collect();
    let c = settle(&places).unwrap_err();
    assert_eq!(c.var, "FH_LOCAL_RANK/FH_LOCAL_SIZE");
    for part in [
        "rank 0 has FH_LOCAL_RANK=0 and FH_LOCAL_SIZE=4, but 2 ranks share its host (0-1)",
        "2 hosts: ranks 0-1 on \"FH_HOST_ID=a\"; ranks 2-3 on \"FH_HOST_ID=b\"",
        "set FH_HOST_ID",
        "FH_LOCAL_RANK and FH_LOCAL_SIZE",
    ] {
        assert!(c.reason.contains(part), "{part:?} not in {}", c.reason);
    }
    let err = JobError::from(c.clone());
    assert!(matches!(err, JobError::Config { .. }));
}

#[test]
fn other_contradictions() {
    let dup = vec![claimed("a", (0, 2)), claimed("a", (0, 2))];
    let c = settle(&dup).unwrap_err();
    assert!(
        c.reason.contains("ranks 0 and 1 both have FH_LOCAL_RANK=0"),
        "{}",
        c.reason
    );
    let cross = |h: usize, n: usize| Some(Claim::new(h, n, ("FH_CROSS_RANK", "FH_CROSS_SIZE")));
    let mut p = vec![place("a"), place("b")];
    p[0].cross = cross(0, 1);
    p[1].cross = cross(0, 1);
    let c = settle(&p).unwrap_err();
    assert_eq!(c.var, "FH_CROSS_RANK/FH_CROSS_SIZE");
    assert!(
        c.reason.contains("rank 0 has FH_CROSS_SIZE=1 hosts"),
        "{}",
        c.reason
    );
    p[0].cross = cross(1, 2);
    p[1].cross = cross(1, 2);
    let c = settle(&p).unwrap_err();
    assert!(
        c.reason
            .contains("on different hosts but both have FH_CROSS_RANK=1"),
        "{}",
        c.reason
    );
    let mut same = vec![place("a"), place("a")];
    same[0].cross = cross(0, 2);
    same[1].cross = cross(1, 2);
    assert!(settle(&same).is_err());
}

#[test]
fn ranges_are_short() {
    assert_eq!(ranges(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
    let many: Vec<usize> = (0..40).step_by(2).collect();
    assert!(ranges(&many).ends_with("… (12 more)"));
}

/// A world: the host index of every rank.
fn world() -> impl Strategy<Value = Vec<usize>> {
    (1usize..5).prop_flat_map(|hosts| proptest::collection::vec(0..hosts, 1..24))
}

proptest! {
    #[test]
    fn settle_matches_the_truth(hosts in world(), claim in any::<bool>(), bump in any::<prop::sample::Index>()) {
        let count = |h: usize| hosts.iter().filter(|&&x| x == h).count();
        let places: Vec<Place> = hosts
            .iter()
            .enumerate()
            .map(|(r, &h)| {
                let local = hosts[..r].iter().filter(|&&x| x == h).count();
                let name = format!("h{h}");
                if claim { claimed(&name, (local, count(h))) } else { place(&name) }
            })
            .collect();
        let l = settle(&places).unwrap();
        let mut seen = std::collections::HashSet::new();
        for (r, &h) in hosts.iter().enumerate() {
            let t = l.topology(r);
            prop_assert_eq!(t.local_size, count(h));
            prop_assert!(t.local_rank < t.local_size);
            prop_assert!(seen.insert((t.cross_rank, t.local_rank)));
            prop_assert_eq!(l.hosts()[t.cross_rank][t.local_rank], r);
            for (q, &g) in hosts.iter().enumerate() {
                prop_assert_eq!(l.topology(q).cross_rank == t.cross_rank, g == h);
            }
        }
        // A wrong claimed size anywhere stops every rank.
        let mut wrong = places;
        let r = bump.index(wrong.len());
        let n = count(hosts[r]);
        wrong[r].local = Some(Claim::new(0, n + 1, ("SLURM_LOCALID", "SLURM_TASKS_PER_NODE")));
        let c = settle(&wrong).unwrap_err();
        prop_assert_eq!(c.var, "SLURM_LOCALID/SLURM_TASKS_PER_NODE");
    }

    #[test]
    fn place_decoders_are_total(bytes in proptest::collection::vec(any::<u8>(), 0..700), size in 1usize..4) {
        match Place::decode(&bytes) {
            Ok((_, used)) => prop_assert!(used <= bytes.len()),
            Err(DecodeError::NeedMore(n)) => prop_assert!(n > bytes.len() && n <= MAX_PLACE_LEN),
            Err(_) => {}
        }
        match decode_places(&bytes, size) {
            Ok((p, used)) => prop_assert!(p.len() == size && used <= bytes.len()),
            Err(DecodeError::NeedMore(n)) => prop_assert!(n > bytes.len() && n <= max_places_len(size)),
            Err(_) => {}
        }
    }
}
