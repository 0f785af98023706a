use super::params::ring_allreduce_time;
use super::*;
use fh_core::fusion::Group;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1e-6)
}

fn link(alpha: f64, bw: f64, cap: Option<f64>) -> Link {
    Link {
        name: "test".into(),
        alpha_s: alpha,
        bandwidth_bps: bw,
        stream_cap_bps: cap,
        concurrency: Vec::new(),
        host_bound: false,
        wire: fh_scheduler::Wire::Network,
        vectored_io: false,
    }
}

const NO_OVERHEAD: Overheads = Overheads {
    round_s: 0.0,
    per_collective_s: 0.0,
    copy_bps: None,
    staged_copy_bps: None,
    shared_host: false,
};

/// `(streams, factor)` points measured at one size.
fn at_size(bytes: usize, pts: &[(usize, f64)]) -> Vec<Concurrency> {
    pts.iter()
        .map(|&(streams, factor)| Concurrency {
            bytes,
            streams,
            factor,
        })
        .collect()
}

#[test]
fn ring_allreduce_by_hand() {
    // 2·3·10 µs + 1.5 · 1 MB · 1 ns = 60 µs + 1.5 ms.
    assert!(close(ring_allreduce_time(1e6, 4, 1e-5, 1e-9), 1.56e-3));
    assert!(close(ring_allreduce_time(1e6, 2, 1e-5, 1e-9), 2e-5 + 1e-3));
    assert_eq!(ring_allreduce_time(1e9, 1, 1.0, 1.0), 0.0);
    // 1024 ranks: 2·1023·5 µs + 2·1023/1024 · 100 MB / 50 GB/s.
    let t = ring_allreduce_time(100e6, 1024, 5e-6, 1.0 / 50e9);
    assert!(close(
        t,
        2.0 * 1023.0 * 5e-6 + 2.0 * 1023.0 / 1024.0 * 100e6 / 50e9
    ));
}

#[test]
fn one_tensor_fasthorovod_by_hand() {
    // Ready at 10 ms; round = 30 µs + log2(4)·10 µs = 50 µs; collective = 20 µs + 60 µs
    // + 1.5 ms → step = 10 ms + 50 µs + 1.58 ms.
    let l = link(1e-5, 1e9, None);
    let o = Overheads::default();
    let m = simulate_step(&[1_000_000], &[0.010], 4, &l, &Schedule::fasthorovod(1), &o);
    assert!(close(m.step_s, 0.010 + 50e-6 + 20e-6 + 1.56e-3), "{m:?}");
    assert_eq!((m.rounds, m.collectives), (1, 1));
}

#[test]
fn horovod_waits_for_its_cycle_and_its_own_execution() {
    let mut l = link(1e-5, 1e9, None);
    let coll = 1.56e-3;
    // Loops tick at 0, 1 ms, 2 ms, ... while idle: the tensor ready at 0.5 ms is negotiated
    // at 1 ms (round: log2(4)·α = 20 µs, then the one-byte can-run agreement, 20 µs), then
    // reduced.
    let h = Schedule::horovod();
    let m = simulate_step(&[1_000_000], &[0.0005], 4, &l, &h, &NO_OVERHEAD);
    assert!(close(m.step_s, 0.001 + 4e-5 + coll), "{m:?}");
    // At 1.0 ms exactly it goes at once.
    let m = simulate_step(&[1_000_000], &[0.001], 4, &l, &h, &NO_OVERHEAD);
    assert!(close(m.step_s, 0.001 + 4e-5 + coll), "{m:?}");
    // Two tensors: the second becomes ready while the first executes; it waits for the
    // loop to finish (execution) and for the next cycle tick 1 ms after the first start.
    let m = simulate_step(
        &[1_000_000, 1_000_000],
        &[0.0, 0.0002],
        4,
        &l,
        &h,
        &NO_OVERHEAD,
    );
    let first_end = 4e-5 + coll; // 1.6 ms > 1 ms cycle: the next loop starts at once
    assert!(close(m.step_s, first_end + 4e-5 + coll), "{m:?}");
    assert_eq!(m.rounds, 2);
    // With fasthorovod K=1 without back-pressure, the second round overlaps the first
    // collective; with it (the preset), the round waits for the channel to drain.
    let two = |s: &Schedule| {
        simulate_step(
            &[1_000_000, 1_000_000],
            &[0.0, 0.0002],
            4,
            &l,
            s,
            &NO_OVERHEAD,
        )
    };
    let off = two(&Schedule::fasthorovod(1).without_back_pressure());
    assert!(close(off.step_s, 2e-5 + coll + coll), "{off:?}");
    let on = two(&Schedule::fasthorovod(1).with_back_pressure());
    assert!(close(on.step_s, 2e-5 + coll + 2e-5 + coll), "{on:?}");
    // As shipped (auto), back-pressure is on over a network link, off over one host's memory
    // below 64 ranks: the engine's own rule.
    assert_eq!(two(&Schedule::fasthorovod(1)), on);
    l.wire = fh_scheduler::Wire::Memory;
    let shipped = simulate_step(
        &[1_000_000, 1_000_000],
        &[0.0, 0.0002],
        4,
        &l,
        &Schedule::fasthorovod(1),
        &NO_OVERHEAD,
    );
    assert_eq!(shipped, off);
}

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

#[test]
fn staged_groups_share_the_link_at_their_pieces_factor() {
    // Two transfers at once move 0.5 of one alone at 1 MiB pieces, without loss at 4 MiB. Two
    // fused 4 MiB groups on two channels: staged (one host, the engine runs them as 1 MiB
    // pieces) they share the link at the 1 MiB factor and take twice as long on the wire as
    // whole (no staged rate given: the groups run whole).
    let mut l = link(1e-5, 1e9, None);
    l.concurrency = at_size(1 << 20, &[(2, 0.5)]);
    l.concurrency.extend(at_size(4 << 20, &[(2, 1.0)]));
    let sizes = [2 << 20, 2 << 20, 2 << 20, 2 << 20];
    let mut s = Schedule::fasthorovod(2);
    s.inline_bytes = 0;
    s.fusion_bytes = 4 << 20;
    let staged = Overheads {
        staged_copy_bps: Some(1e9),
        ..NO_OVERHEAD
    };
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

#[test]
fn the_model_uses_the_transports_algorithm_choice() {
    // 200 KiB on 8 ranks: recursive doubling (below the ring threshold): 3 α + 3 × 200 KiB.
    // 256 KiB: ring: 14 α + 2·7/8 × 256 KiB.
    let l = link(1e-5, 1e9, None);
    let f = Schedule::fasthorovod(1);
    let small = 200 << 10;
    let m = simulate_step(&[small], &[0.0], 8, &l, &f, &NO_OVERHEAD);
    assert!(
        close(m.step_s, 3e-5 + 3e-5 + 3.0 * small as f64 / 1e9),
        "{m:?}"
    );
    let big = 256 << 10;
    let m = simulate_step(&[big], &[0.0], 8, &l, &f, &NO_OVERHEAD);
    assert!(
        close(m.step_s, 3e-5 + 14e-5 + 1.75 * big as f64 / 1e9),
        "{m:?}"
    );
    // A world that is not a power of two folds in and out: two more steps.
    let m = simulate_step(&[small], &[0.0], 6, &l, &f, &NO_OVERHEAD);
    assert!(
        close(m.step_s, 3e-5 + 4e-5 + 4.0 * small as f64 / 1e9),
        "{m:?}"
    );
}

#[test]
fn small_messages_use_recursive_doubling_at_scale() {
    // 1 KB on 1024 ranks: ring latency 2·1023·α ≫ recursive doubling 10·(α + 1 KB·β).
    let l = link(1e-5, 1e9, None);
    let m = simulate_step(
        &[1000],
        &[0.0],
        1024,
        &l,
        &Schedule::fasthorovod(1),
        &NO_OVERHEAD,
    );
    // round: 10 α; a small group runs on the negotiation thread after a one-byte
    // agreement (10 α); collective: 10 α + 10 KB at 1 GB/s.
    assert!(
        close(
            m.step_s,
            10.0 * 1e-5 + 10.0 * 1e-5 + 10.0 * 1e-5 + 1e4 / 1e9
        ),
        "{m:?}"
    );
    // Without the inline path, no agreement.
    let mut s = Schedule::fasthorovod(1);
    s.inline_bytes = 0;
    let m = simulate_step(&[1000], &[0.0], 1024, &l, &s, &NO_OVERHEAD);
    assert!(
        close(m.step_s, 10.0 * 1e-5 + 10.0 * 1e-5 + 1e4 / 1e9),
        "{m:?}"
    );
}

#[test]
fn host_copies_cost_packed_groups_two_passes_and_single_tensors_one() {
    // 1 GB/s copies: a fused group of two 500 kB tensors is packed, then unpacked and
    // scaled in one pass (2 passes of 1 MB: 2 ms) around its ring on 2 ranks (2α + 1 MB at
    // 1 GB/s); a single 1 MB tensor is reduced in place and only scaled (1 ms).
    let l = link(1e-5, 1e9, None);
    let o = Overheads {
        copy_bps: Some(1e9),
        ..NO_OVERHEAD
    };
    assert!(close(o.copy_s(1_000_000, 2, false), 2e-3));
    assert!(close(o.copy_s(1_000_000, 1, false), 1e-3));
    assert_eq!(NO_OVERHEAD.copy_s(1_000_000, 2, false), 0.0);
    let mut f = Schedule::fasthorovod(1);
    f.inline_bytes = 0;
    let m = simulate_step(&[500_000, 500_000], &[0.0, 0.0], 2, &l, &f, &o);
    assert!(close(m.step_s, 1e-5 + 2e-3 + 2e-5 + 1e-3), "{m:?}");
    let m = simulate_step(&[1_000_000], &[0.0], 2, &l, &f, &o);
    assert!(close(m.step_s, 1e-5 + 1e-3 + 2e-5 + 1e-3), "{m:?}");
    // On one host the engine stages fused groups: both passes at the staged rate (4 GB/s,
    // 0.25 ms), a lone tensor as before; `horovod` packs whole groups at the plain rate.
    let staged = Overheads {
        staged_copy_bps: Some(4e9),
        ..o.clone()
    };
    assert!(close(staged.copy_s(1_000_000, 2, true), 0.25e-3));
    assert!(close(staged.copy_s(1_000_000, 1, true), 1e-3));
    assert!(close(staged.copy_s(1_000_000, 2, false), 2e-3));
    let m = simulate_step(&[500_000, 500_000], &[0.0, 0.0], 2, &l, &f, &staged);
    assert!(close(m.step_s, 1e-5 + 0.25e-3 + 2e-5 + 1e-3), "{m:?}");
    let mut h = Schedule::horovod();
    h.cycle_s = 1e-9;
    let whole = simulate_step(&[500_000, 500_000], &[0.0, 0.0], 2, &l, &h, &o);
    let still = simulate_step(&[500_000, 500_000], &[0.0, 0.0], 2, &l, &h, &staged);
    assert_eq!(whole, still, "horovod never stages");
}

fn f0() -> Schedule {
    let mut f = Schedule::fasthorovod(1);
    f.inline_bytes = 0;
    f
}

#[test]
fn over_scatter_gather_io_fused_groups_cost_only_the_finishing_pass() {
    // Over a TCP-like link `fasthorovod` reduces a fused group in place: the ring finishes
    // this rank's block only (1 MB on 2 ranks: 0.5 MB at 1 GB/s, 0.5 ms) instead of packing
    // and unpacking it (2 ms); a group below the ring threshold is still packed; `horovod`
    // packs as Horovod does.
    let l = Link {
        vectored_io: true,
        ..link(1e-5, 1e9, None)
    };
    let o = Overheads {
        copy_bps: Some(1e9),
        ..NO_OVERHEAD
    };
    assert!(close(o.in_place_copy_s(1_000_000, 2).unwrap(), 0.5e-3));
    assert_eq!(o.in_place_copy_s(100_000, 2), None);
    assert_eq!(NO_OVERHEAD.in_place_copy_s(1_000_000, 2), Some(0.0));
    let m = simulate_step(&[50_000, 50_000], &[0.0, 0.0], 2, &l, &f0(), &o);
    let packed = simulate_step(
        &[50_000, 50_000],
        &[0.0, 0.0],
        2,
        &link(1e-5, 1e9, None),
        &f0(),
        &o,
    );
    assert_eq!(m, packed, "a group below the ring threshold is packed");
    let mut f = Schedule::fasthorovod(1);
    f.inline_bytes = 0;
    let m = simulate_step(&[500_000, 500_000], &[0.0, 0.0], 2, &l, &f, &o);
    assert!(close(m.step_s, 1e-5 + 0.5e-3 + 2e-5 + 1e-3), "{m:?}");
    // A lone tensor on the ring is finished on the own block too (it was one whole pass).
    let m = simulate_step(&[1_000_000], &[0.0], 2, &l, &f, &o);
    assert!(close(m.step_s, 1e-5 + 0.5e-3 + 2e-5 + 1e-3), "{m:?}");
    let mut h = Schedule::horovod();
    h.cycle_s = 1e-9;
    let packed = simulate_step(
        &[500_000, 500_000],
        &[0.0, 0.0],
        2,
        &link(1e-5, 1e9, None),
        &h,
        &o,
    );
    let still = simulate_step(&[500_000, 500_000], &[0.0, 0.0], 2, &l, &h, &o);
    assert_eq!(packed, still, "horovod packs whatever the transport");
}

#[test]
fn a_group_run_on_the_negotiation_thread_holds_the_next_round() {
    // Two 1 KB tensors on 2 ranks, the second ready 1 µs after the first: the first round's
    // single small group runs inline (agreement α, then α + 1 KB), and the second round
    // starts only when it is done. Round = α each.
    let l = link(1e-5, 1e9, None);
    let s = Schedule::fasthorovod(2);
    let m = simulate_step(&[1000, 1000], &[0.0, 1e-6], 2, &l, &s, &NO_OVERHEAD);
    let one = 1e-5 + 1e-5 + (1e-5 + 1e3 / 1e9);
    assert!(close(m.step_s, 2.0 * one), "{m:?}");
    assert_eq!((m.rounds, m.collectives), (2, 2));
}

#[test]
fn back_pressure_fuses_what_becomes_ready_meanwhile() {
    // K=1: the first tensor (5 MB) runs for ~5 ms; the 3 tensors ready meanwhile wait for
    // the busy channel and are negotiated in one round: 2 collectives in all, not 4.
    let l = link(1e-5, 1e9, None);
    let sizes = [5_000_000, 1000, 1000, 1000];
    let ready = [0.0, 1e-4, 2e-4, 3e-4];
    let bp = Schedule::fasthorovod(1).with_back_pressure();
    let m = simulate_step(&sizes, &ready, 2, &l, &bp, &NO_OVERHEAD);
    assert_eq!((m.rounds, m.collectives), (2, 2), "{m:?}");
    // Without back-pressure every small tensor gets its own round and collective.
    let off = Schedule::fasthorovod(1).without_back_pressure();
    let m = simulate_step(&sizes, &ready, 2, &l, &off, &NO_OVERHEAD);
    assert_eq!(m.collectives, 4, "{m:?}");
    // K=2: the second channel is idle, so nothing is deferred.
    let mut two = Schedule::fasthorovod(2).with_back_pressure();
    two.fusion_bytes = 1;
    let m = simulate_step(&sizes, &ready, 2, &l, &two, &NO_OVERHEAD);
    assert_eq!(m.rounds, 4, "{m:?}");
}

#[test]
fn fusion_and_partition_through_the_engines_planner() {
    let bytes = |g: Vec<Group>| g.iter().map(Group::bytes).collect::<Vec<_>>();
    let f = Schedule::fasthorovod(4);
    // 40 MiB splits into 4 chunks of 10 MiB (16 MiB partitions would give 3; a multiple
    // of K), each its own group; small tensors around it fuse with each other.
    let mut p = ModelPlanner::new(&f);
    let g = p.round(&[1 << 20, 40 << 20, 1 << 20, 2 << 20], 0);
    assert_eq!(
        bytes(g.clone()),
        [1 << 20, 10 << 20, 10 << 20, 10 << 20, 10 << 20, 3 << 20]
    );
    // Every channel carries a chunk of the large tensor.
    let mut chans: Vec<usize> = g[1..5].iter().map(|g| g.channel).collect();
    chans.sort();
    assert_eq!(chans, [0, 1, 2, 3]);
    // 100 MiB: ceil(100/16) = 7 chunks, rounded up to 8.
    let g = ModelPlanner::new(&f).round(&[100 << 20], 0);
    assert_eq!(g.len(), 8);
    assert_eq!(g.iter().map(Group::bytes).sum::<u64>(), 100 << 20);
    let h = Schedule::horovod();
    assert_eq!(
        bytes(ModelPlanner::new(&h).round(&[40 << 20, 1 << 20], 0)),
        [41 << 20]
    );
    assert_eq!(
        bytes(ModelPlanner::new(&h).round(&[40 << 20; 4], 0)),
        [120 << 20, 40 << 20]
    );
}

/// The model and the engine form the same groups on the same channels for the same
/// arrival sequence: the engine's rounds (as it logged them) replayed through the model's
/// planner give the engine's groups, parts and channels, load carried across rounds.
#[test]
fn model_and_engine_plan_the_same_groups_and_channels() {
    use fh_scheduler::{AllreduceOptions, Engine, Tensor};
    use fh_transport::local::LocalWorld;
    use std::collections::HashMap;
    use std::time::Duration;

    let mut sched = Schedule::fasthorovod(4);
    sched.fusion_bytes = 16 << 10;
    sched.partition_bytes = 4 << 10;
    // Batches of f32 gradients (element counts); each batch is submitted at once and
    // waited for before the next.
    let batches: Vec<Vec<usize>> = vec![
        vec![10, 3000, 7, 500, 500],
        vec![1],
        vec![2500, 2500, 9, 4000, 1, 1, 1],
        vec![64; 12],
        vec![5000, 3, 1000],
    ];
    let cfg = sched.config().record_groups(true);
    let threads: Vec<_> = LocalWorld::with_timeout(2, Duration::from_secs(30))
        .into_iter()
        .map(|t| {
            let (cfg, batches) = (cfg.clone(), batches.clone());
            std::thread::spawn(move || {
                let e = Engine::start(Box::new(t), cfg).unwrap();
                for (b, batch) in batches.iter().enumerate() {
                    let hs: Vec<_> = batch
                        .iter()
                        .enumerate()
                        .map(|(i, &n)| {
                            e.allreduce(
                                &format!("b{b}.t{i}"),
                                Tensor::from_slice(&vec![1.0f32; n]),
                                AllreduceOptions::default(),
                            )
                            .unwrap()
                        })
                        .collect();
                    for mut h in hs {
                        h.wait_timeout(Duration::from_secs(30)).unwrap();
                    }
                }
                let log = e.group_log();
                e.shutdown().unwrap();
                log
            })
        })
        .collect();
    let logs: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(logs[0], logs[1]);
    let log = &logs[0];
    let size: HashMap<String, u64> = batches
        .iter()
        .enumerate()
        .flat_map(|(b, batch)| {
            batch
                .iter()
                .enumerate()
                .map(move |(i, &n)| (format!("b{b}.t{i}"), n as u64 * 4))
        })
        .collect();
    // The engine's rounds: tensors in planner-input order (first appearance), by round.
    // The engine's rounds: tensors in planner-input order (first appearance), by round, with
    // the channels that round agreed were idle.
    let mut rounds: Vec<(u64, u64, Vec<String>)> = Vec::new();
    for g in log {
        if rounds.last().map(|r| r.0) != Some(g.round) {
            rounds.push((g.round, g.idle_channels, Vec::new()));
        }
        let names = &mut rounds.last_mut().unwrap().2;
        for (name, _, _) in &g.parts {
            if !names.contains(name) {
                names.push(name.clone());
            }
        }
    }
    let mut model = ModelPlanner::new(&sched);
    let mut planned = Vec::new();
    for (round, idle, names) in &rounds {
        let sizes: Vec<u64> = names.iter().map(|n| size[n]).collect();
        for g in model.round(&sizes, *idle) {
            planned.push(fh_scheduler::GroupRecord {
                round: *round,
                idle_channels: *idle,
                channel: g.channel,
                parts: g
                    .parts
                    .iter()
                    .map(|p| (names[p.item].clone(), p.offset, p.len))
                    .collect(),
            });
        }
    }
    assert_eq!(&planned, log);
    // The sequence exercised chunking and several channels.
    assert!(log.iter().any(|g| g.parts[0].1 > 0));
    assert!(log.iter().any(|g| g.channel == 3));
}

#[test]
fn calibration_recovers_alpha_and_beta() {
    let (alpha, beta, p) = (20e-6, 1.0 / 2e9, 4usize);
    let points: Vec<(f64, f64)> = [1e3, 1e5, 1e6, 1e7, 6e7]
        .iter()
        .map(|&m| (m, ring_allreduce_time(m, p, alpha, beta)))
        .collect();
    let l = calibrate_link("loopback", p, &points).unwrap();
    assert!(close(l.alpha_s, alpha), "{l:?}");
    assert!(close(l.bandwidth_bps, 2e9), "{l:?}");
    assert!(calibrate_link("x", p, &points[..1]).is_none());
    // Noisy large sizes must not swamp α: 10 % error on the largest point only.
    let mut noisy = points.clone();
    noisy[4].1 *= 1.1;
    let l = calibrate_link("loopback", p, &noisy).unwrap();
    assert!((l.alpha_s - alpha).abs() < 0.1 * alpha, "{l:?}");
}

#[test]
fn efficiency_definition() {
    assert_eq!(efficiency(0.1, 0.1), 1.0);
    assert!(close(efficiency(0.1, 0.2), 0.15 / 0.25));
}
