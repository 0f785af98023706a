//! The model's costs by hand: one collective (ring, recursive doubling), host copies
//! (packed, staged, in place), calibration and the efficiency definition.

use super::super::params::ring_allreduce_time;
use super::*;

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
    // round: 10 α; a small group runs on the negotiation thread, the agreement that every
    // rank can run it inside its allreduce; collective: 10 α + 10 KB at 1 GB/s.
    assert!(
        close(m.step_s, 10.0 * 1e-5 + 10.0 * 1e-5 + 1e4 / 1e9),
        "{m:?}"
    );
    // Without the inline path: the same (no agreement either way).
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
    let f = fasthorovod_k1();
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
    let m = simulate_step(&[50_000, 50_000], &[0.0, 0.0], 2, &l, &fasthorovod_k1(), &o);
    let packed = simulate_step(
        &[50_000, 50_000],
        &[0.0, 0.0],
        2,
        &link(1e-5, 1e9, None),
        &fasthorovod_k1(),
        &o,
    );
    assert_eq!(m, packed, "a group below the ring threshold is packed");
    let f = fasthorovod_k1();
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

#[test]
fn pipelined_local_passes_expose_one_chunk() {
    // A lone 1 MB tensor on 2 ranks at 1 GB/s copies: 2 local passes over it add 2 ms one
    // after another with the transfer; pipelined in 250 kB chunks only one chunk's passes
    // (0.5 ms) stay outside it; a group no larger than a chunk exposes all of them.
    let mut l = link(1e-5, 1e9, None);
    l.local_passes = 2.0;
    let o = Overheads {
        copy_bps: Some(1e9),
        ..NO_OVERHEAD
    };
    let f = fasthorovod_k1();
    let serial = simulate_step(&[1_000_000], &[0.0], 2, &l, &f, &o);
    assert!(
        close(serial.step_s, 1e-5 + 2e-3 + 1e-3 + 2e-5 + 1e-3),
        "{serial:?}"
    );
    l.local_chunk = Some(250_000);
    let piped = simulate_step(&[1_000_000], &[0.0], 2, &l, &f, &o);
    assert!(
        close(piped.step_s, 1e-5 + 0.5e-3 + 1e-3 + 2e-5 + 1e-3),
        "{piped:?}"
    );
    l.local_chunk = Some(4_000_000);
    let one_chunk = simulate_step(&[1_000_000], &[0.0], 2, &l, &f, &o);
    assert_eq!(one_chunk, serial);
}
