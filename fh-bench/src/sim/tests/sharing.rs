//! Transfers in flight at once: the link shared between channels, the measured concurrency
//! factor (by count and size, at the size of the allreduces a group runs) and a shared host.

use super::*;

#[test]
fn channels_share_bandwidth_and_overlap_latency() {
    // Two 1 MB tensors ready at 0, 2 ranks: one round of α = 10 µs, then per tensor a ring
    // (the transport's pick from 256 KiB up): 2α = 20 µs and 1 MB at 1 GB/s. K=1:
    // 10 + 1020 + 1020 µs. K=2: both latencies together, then 2 MB at 1 GB/s shared:
    // 10 + 20 µs + 2 ms.
    let l = link(1e-5, 1e9, None);
    let sizes = [1_000_000, 1_000_000];
    let mut s1 = Schedule::fasthorovod(1);
    s1.fusion_bytes = 1; // no fusion: one collective per tensor
    let mut s2 = s1.clone();
    s2.channels = 2;
    let m1 = simulate_step(&sizes, &[0.0, 0.0], 2, &l, &s1, &NO_OVERHEAD);
    let m2 = simulate_step(&sizes, &[0.0, 0.0], 2, &l, &s2, &NO_OVERHEAD);
    assert!(close(m1.step_s, 1e-5 + 2.0 * (2e-5 + 1e-3)), "{m1:?}");
    assert!(close(m2.step_s, 1e-5 + 2e-5 + 2e-3), "{m2:?}");
    // A stream cap of half the link: one channel reaches only 0.5 GB/s; two fill the link.
    let capped = link(1e-5, 1e9, Some(0.5e9));
    let m1 = simulate_step(&sizes, &[0.0, 0.0], 2, &capped, &s1, &NO_OVERHEAD);
    let m2 = simulate_step(&sizes, &[0.0, 0.0], 2, &capped, &s2, &NO_OVERHEAD);
    assert!(close(m1.step_s, 1e-5 + 2.0 * (2e-5 + 2e-3)), "{m1:?}");
    assert!(close(m2.step_s, 1e-5 + 2e-5 + 2e-3), "{m2:?}");
}

#[test]
fn concurrent_transfers_move_the_measured_share_of_the_link() {
    // As above, K=2, but two transfers at once move only 0.5 of what one moves alone: 2 MB at
    // 0.5 GB/s together, 4 ms after both latencies. K=1 never has two in flight: unchanged.
    let mut l = link(1e-5, 1e9, None);
    l.concurrency = at_size(1_000_000, &[(2, 0.5), (4, 0.25)]);
    let sizes = [1_000_000, 1_000_000];
    let mut s1 = Schedule::fasthorovod(1);
    s1.fusion_bytes = 1;
    let mut s2 = s1.clone();
    s2.channels = 2;
    let m1 = simulate_step(&sizes, &[0.0, 0.0], 2, &l, &s1, &NO_OVERHEAD);
    let m2 = simulate_step(&sizes, &[0.0, 0.0], 2, &l, &s2, &NO_OVERHEAD);
    assert!(close(m1.step_s, 1e-5 + 2.0 * (2e-5 + 1e-3)), "{m1:?}");
    assert!(close(m2.step_s, 1e-5 + 2e-5 + 4e-3), "{m2:?}");
}

/// Four 2 MiB tensors ready at once, fused into two 4 MiB groups on two channels
/// (`fasthorovod` K=2, every group on its channel), and overheads under which the groups are
/// staged (a staged copy rate given, copies free).
fn two_fused_groups() -> ([usize; 4], Schedule, Overheads) {
    let mut s = Schedule::fasthorovod(2);
    s.inline_bytes = 0;
    s.fusion_bytes = 4 << 20;
    let staged = Overheads {
        staged_copy_bps: Some(1e9),
        ..NO_OVERHEAD
    };
    ([2 << 20; 4], s, staged)
}

#[test]
fn staged_groups_share_the_link_at_their_pieces_factor() {
    // Two transfers at once move 0.5 of one alone at 1 MiB pieces, without loss at 4 MiB. Two
    // fused 4 MiB groups on two channels: staged (one host, the engine runs them as 1 MiB
    // pieces) they share the link at the 1 MiB factor and take twice as long on the wire as
    // whole (no staged rate given: the groups run whole).
    let mut l = link(1e-5, 1e9, None);
    l.concurrency = at_size(1 << 20, &[(2, 0.5)]);
    l.concurrency.extend(at_size(4 << 20, &[(2, 1.0)]));
    let (sizes, s, staged) = two_fused_groups();
    let whole = simulate_step(&sizes, &[0.0; 4], 2, &l, &s, &NO_OVERHEAD);
    let pieces = simulate_step(&sizes, &[0.0; 4], 2, &l, &s, &staged);
    let wire = 2.0 * (4 << 20) as f64 / 1e9; // both groups, 2(p-1)/p = 1 on 2 ranks
    assert!(close(whole.step_s, 1e-5 + 2e-5 + wire), "{whole:?}");
    assert!(close(pieces.step_s, 1e-5 + 2e-5 + 2.0 * wire), "{pieces:?}");
    // Over a scatter-gather transport the same groups are reduced in place, whole: the factor
    // at their own size, although the host would stage them.
    let tcp = Link {
        vectored_io: true,
        ..l.clone()
    };
    let in_place = simulate_step(&sizes, &[0.0; 4], 2, &tcp, &s, &staged);
    assert!(close(in_place.step_s, whole.step_s), "{in_place:?}");
}

#[test]
fn staged_groups_on_a_host_bound_link_share_at_their_measured_factor() {
    // As above: plain 1 MiB allreduces two at once move 0.5 of one alone, but two staged
    // groups (copies and hand-offs between pieces included) were measured at 0.25. On a link
    // whose transfers are the host's own copies the staged groups go by 0.25: four times the
    // wire time of one group alone; elsewhere (TCP) the staged measurement is not used.
    let mut l = link(1e-5, 1e9, None);
    l.concurrency = at_size(1 << 20, &[(2, 0.5)]);
    l.concurrency.extend(at_size(4 << 20, &[(2, 1.0)]));
    l.staged_concurrency = at_size(16 << 20, &[(2, 0.25), (4, 0.2)]);
    let (sizes, s, staged) = two_fused_groups();
    let wire = 2.0 * (4 << 20) as f64 / 1e9;
    let network = simulate_step(&sizes, &[0.0; 4], 2, &l, &s, &staged);
    assert!(
        close(network.step_s, 1e-5 + 2e-5 + 2.0 * wire),
        "{network:?}"
    );
    let host = Link {
        host_bound: true,
        ..l.clone()
    };
    let on_host = simulate_step(&sizes, &[0.0; 4], 2, &host, &s, &staged);
    assert!(
        close(on_host.step_s, 1e-5 + 2e-5 + 4.0 * wire),
        "{on_host:?}"
    );
    // Groups that are not staged (whole, 4 MiB) keep the plain factor at their size.
    let whole = simulate_step(&sizes, &[0.0; 4], 2, &host, &s, &NO_OVERHEAD);
    assert!(close(whole.step_s, 1e-5 + 2e-5 + wire), "{whole:?}");
}

#[test]
fn staged_factor_interpolates_between_measured_counts() {
    let mut l = link(1e-5, 1e9, None);
    assert_eq!(l.staged_factor(4), None, "not measured");
    l.staged_concurrency = at_size(16 << 20, &[(2, 0.9), (4, 0.7)]);
    assert_eq!(l.staged_factor(1), Some(1.0));
    assert!(close(l.staged_factor(2).unwrap(), 0.9));
    assert!(close(l.staged_factor(3).unwrap(), 0.8));
    assert!(close(l.staged_factor(8).unwrap(), 0.7));
}

#[test]
fn aggregate_factor_interpolates_between_measured_counts() {
    let mut l = link(1e-5, 1e9, None);
    assert_eq!(
        l.aggregate_factor(8, 1 << 20),
        1.0,
        "unmeasured: shared without loss"
    );
    l.concurrency = at_size(1 << 20, &[(2, 0.8), (4, 0.6)]);
    for bytes in [1, 1 << 20, 1 << 30] {
        assert_eq!(l.aggregate_factor(0, bytes), 1.0);
        assert_eq!(l.aggregate_factor(1, bytes), 1.0);
        assert!(
            close(l.aggregate_factor(2, bytes), 0.8),
            "one size: every size"
        );
        assert!(close(l.aggregate_factor(3, bytes), 0.7));
        assert!(close(l.aggregate_factor(4, bytes), 0.6));
        assert!(
            close(l.aggregate_factor(16, bytes), 0.6),
            "beyond the last: the last"
        );
    }
    // Measured from 4 only: linear from (1, 1).
    l.concurrency = at_size(1 << 20, &[(4, 0.4)]);
    assert!(close(l.aggregate_factor(2, 1 << 20), 0.8));
    assert!(close(l.aggregate_factor(3, 1 << 20), 0.6));
}

#[test]
fn aggregate_factor_interpolates_in_log_size_between_measured_sizes() {
    let mut l = link(1e-5, 1e9, None);
    l.concurrency = at_size(1 << 20, &[(2, 0.9), (4, 0.5)]);
    l.concurrency
        .extend(at_size(16 << 20, &[(2, 1.1), (4, 1.3)]));
    // Halfway in log size between 1 MiB and 16 MiB: 4 MiB.
    assert!(close(l.aggregate_factor(4, 4 << 20), 0.9));
    assert!(close(l.aggregate_factor(2, 4 << 20), 1.0));
    assert!(close(l.aggregate_factor(3, 4 << 20), 0.95));
    // At and beyond the measured sizes: the nearest one's.
    assert!(close(l.aggregate_factor(4, 1 << 20), 0.5));
    assert!(close(l.aggregate_factor(4, 1000), 0.5));
    assert!(close(l.aggregate_factor(4, 16 << 20), 1.3));
    assert!(close(l.aggregate_factor(4, 1 << 30), 1.3));
    assert_eq!(l.aggregate_factor(1, 4 << 20), 1.0);
}

#[test]
fn on_a_shared_host_copies_share_it_and_on_a_host_bound_link_with_transfers() {
    // Two tensors of 2 MB (A) and 1 MB (B) ready at once on 2 ranks, K = 2, one each, no
    // latency; each is scaled in one pass at 1 GB/s (A 2 ms, B 1 ms) and then moves 2 MB
    // (A) or 1 MB (B) of ring traffic at 1 GB/s.
    let mut l = link(0.0, 1e9, None);
    let mut s = Schedule::fasthorovod(2);
    s.fusion_bytes = 1;
    s.inline_bytes = 0;
    let own = Overheads {
        copy_bps: Some(1e9),
        ..NO_OVERHEAD
    };
    let sizes = [2_000_000, 1_000_000];
    let step = |l: &Link, o: &Overheads| simulate_step(&sizes, &[0.0, 0.0], 2, l, &s, o).step_s;
    // Each channel copies on a core of its own: B copies to 1 ms and sends alone to 2 ms; A
    // copies to 2 ms and sends alone to 4 ms.
    assert!(close(step(&l, &own), 4e-3), "{}", step(&l, &own));
    // The copies share the rank's copy rate: both at half speed to 2 ms (B done, A half); A
    // copies alone to 3 ms while B sends alone to 3 ms; A sends to 5 ms.
    let shared = Overheads {
        shared_host: true,
        ..own.clone()
    };
    assert!(close(step(&l, &shared), 5e-3), "{}", step(&l, &shared));
    // And where the transfers are the host's own copies, B's transfer and A's last copy share
    // it too: both at half speed from 2 ms to 4 ms; A sends alone to 6 ms.
    l.host_bound = true;
    assert!(close(step(&l, &shared), 6e-3), "{}", step(&l, &shared));
    // A host-bound link alone changes nothing: the projections keep a core per channel.
    assert!(close(step(&l, &own), 4e-3), "{}", step(&l, &own));
}
