//! A cloud's per-flow cap: what one transfer reaches over its striped connections, how
//! transfers share a link when some are held below their share, and the passes within a host.

use super::super::{fair_rates, simulate_step, Flows, Link, Overheads};
use super::{close, fasthorovod_k1, link, NO_OVERHEAD};

const FLOW: f64 = 62.5e6; // 500 Mbit/s per TCP connection
const LINK: f64 = 250e6; // 2 Gbit/s link

fn flows(streams: usize, lanes: usize) -> Flows {
    Flows {
        flow_bps: FLOW,
        streams,
        lanes,
        stripe_min: 256 << 10,
    }
}

#[test]
fn s_streams_under_a_per_flow_cap_reach_s_flows_up_to_the_link() {
    let big = 512 << 10;
    // One stream: the flow's rate, however large the frame.
    assert_eq!(flows(1, 1).transfer_cap(big, LINK), FLOW);
    // S streams: min(S × flow, link).
    for s in 1..=16 {
        let want = (s as f64 * FLOW).min(LINK);
        assert_eq!(flows(s, 1).transfer_cap(big, LINK), want, "S = {s}");
    }
    assert_eq!(flows(2, 1).transfer_cap(big, LINK), 2.0 * FLOW);
    assert_eq!(flows(8, 1).transfer_cap(big, LINK), LINK);
    // Frames below the striping threshold go on one stream.
    assert_eq!(flows(4, 1).transfer_cap((256 << 10) - 1, LINK), FLOW);
    // Lanes (hierarchical allreduce: one connection per rank of a host) multiply the flows.
    assert_eq!(flows(1, 2).transfer_cap(big, LINK), 2.0 * FLOW);
    assert_eq!(flows(4, 2).transfer_cap(big, LINK), LINK);
    assert_eq!(flows(1, 2).transfer_cap(10, LINK), 2.0 * FLOW);
}

#[test]
fn the_frames_the_transport_sends_decide_the_striping() {
    let mut l = link(0.0, LINK, None);
    assert_eq!(l.transfer_cap(64 << 20, 2), f64::INFINITY, "no cap");
    l.flows = Some(flows(4, 1));
    // A 64 MiB ring allreduce on 2 ranks sends 512 KiB pieces: striped over 4 streams.
    assert_eq!(l.transfer_cap(64 << 20, 2), LINK);
    // 400 KiB on 2 ranks: 200 KiB blocks, below the threshold: one stream.
    assert_eq!(l.transfer_cap(400 << 10, 2), FLOW);
    // Recursive doubling (below 256 KiB) sends the whole vector, below the threshold too.
    assert_eq!(l.transfer_cap(4 << 10, 2), FLOW);
    // Two lanes split the vector before the ring splits it again.
    l.flows = Some(flows(4, 2));
    assert_eq!(l.transfer_cap(2 << 20, 2), LINK);
    assert_eq!(l.transfer_cap(800 << 10, 2), 2.0 * FLOW);
    // The older per-stream cap still holds on top.
    l.stream_cap_bps = Some(100e6);
    assert_eq!(l.transfer_cap(64 << 20, 2), 100e6);
}

#[test]
fn a_capped_transfer_leaves_its_share_to_the_others() {
    // Uncapped: equal shares.
    assert_eq!(
        fair_rates(&[Some(f64::INFINITY), Some(f64::INFINITY)], 50.0),
        vec![50.0, 50.0]
    );
    // One held at 10: the other gets the other 90 (of 2 × 50), up to its own cap.
    assert_eq!(fair_rates(&[Some(10.0), Some(1e9)], 50.0), vec![10.0, 90.0]);
    assert_eq!(
        fair_rates(&[Some(10.0), Some(60.0)], 50.0),
        vec![10.0, 60.0]
    );
    // Channels not on the wire get nothing and take no share.
    assert_eq!(
        fair_rates(&[None, Some(f64::INFINITY), None], 50.0),
        vec![0.0, 50.0, 0.0]
    );
    // All capped below the share: each its cap.
    assert_eq!(fair_rates(&[Some(5.0), Some(7.0)], 50.0), vec![5.0, 7.0]);
}

#[test]
fn one_large_tensor_moves_at_s_flows_in_the_model() {
    // 64 MiB allreduced on 2 ranks (1 host each): 64 MiB on the wire per rank. One stream
    // under a 62.5 MB/s flow cap takes 4× as long as four streams, which fill the 250 MB/s
    // link; eight do no better than four.
    let f = fasthorovod_k1();
    let wire = 2.0 * (1.0 / 2.0) * (64u64 << 20) as f64;
    let step = |s: usize| {
        let l = Link {
            flows: Some(flows(s, 1)),
            ..link(0.0, LINK, None)
        };
        simulate_step(&[64 << 20], &[0.0], 2, &l, &f, &NO_OVERHEAD).step_s
    };
    assert!(close(step(1), wire / FLOW), "{}", step(1));
    assert!(close(step(2), wire / (2.0 * FLOW)), "{}", step(2));
    assert!(close(step(4), wire / LINK), "{}", step(4));
    assert!(close(step(8), step(4)));
    // Without the per-flow term the model gives the link's rate whatever S is.
    let free = simulate_step(
        &[64 << 20],
        &[0.0],
        2,
        &link(0.0, LINK, None),
        &f,
        &NO_OVERHEAD,
    );
    assert!(close(free.step_s, wire / LINK));
}

#[test]
fn passes_within_a_host_run_before_the_transfer_at_the_copy_rate() {
    // 3 passes over 1 MB at 1 GB/s: 3 ms more than the transfer alone.
    let f = fasthorovod_k1();
    let o = Overheads {
        copy_bps: Some(1e9),
        ..NO_OVERHEAD
    };
    let plain = link(0.0, 1e9, None);
    let hier = Link {
        local_passes: 3.0,
        ..plain.clone()
    };
    let a = simulate_step(&[1_000_000], &[0.0], 2, &plain, &f, &o).step_s;
    let b = simulate_step(&[1_000_000], &[0.0], 2, &hier, &f, &o).step_s;
    assert!(close(b - a, 3e-3), "{a} {b}");
    // Copies taken as free: no passes charged.
    let c = simulate_step(&[1_000_000], &[0.0], 2, &hier, &f, &NO_OVERHEAD).step_s;
    let d = simulate_step(&[1_000_000], &[0.0], 2, &plain, &f, &NO_OVERHEAD).step_s;
    assert_eq!(c, d);
}
