//! The engine API a framework adapter (fh-torch) relies on: tensors over external memory,
//! options on every collective, topology, join's last rank, and waits that keep the handle.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{configs, run_world, LIMIT};
use fh_scheduler::{CollectiveOptions, Config, ReduceOp, SchedulerError, Tensor};

/// Counts the guards dropped.
struct Guard(Arc<AtomicUsize>);

impl Drop for Guard {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn external_memory_is_reduced_in_place_and_released() {
    for (label, cfg) in configs() {
        let out = run_world(3, cfg, |e, r| {
            let dropped = Arc::new(AtomicUsize::new(0));
            let mut backing = vec![r as f32 + 1.0; 1000];
            let ptr = backing.as_mut_ptr().cast::<u8>();
            // SAFETY: `backing` is not touched until the handle has given the tensor back and
            // the tensor is dropped.
            let t = unsafe {
                Tensor::from_external(
                    fh_scheduler::DType::F32,
                    vec![10, 100],
                    ptr,
                    4000,
                    Box::new(Guard(dropped.clone())),
                )
            }
            .unwrap();
            let mut h = e
                .allreduce("ext", t, CollectiveOptions::with_op(ReduceOp::Sum))
                .unwrap();
            let back = h.wait_timeout(LIMIT).unwrap();
            assert!(back.is_external());
            assert_eq!(dropped.load(Ordering::SeqCst), 0, "released too early");
            drop(back);
            assert_eq!(dropped.load(Ordering::SeqCst), 1, "guard not released");
            // An out-of-place collective returns an owned tensor and releases the input.
            let mut input = vec![r as i32; 4];
            let d2 = Arc::new(AtomicUsize::new(0));
            let t = unsafe {
                Tensor::from_external(
                    fh_scheduler::DType::I32,
                    vec![4],
                    input.as_mut_ptr().cast(),
                    16,
                    Box::new(Guard(d2.clone())),
                )
            }
            .unwrap();
            let mut g = e.allgather("ext_g", t).unwrap();
            let gathered = g.wait_timeout(LIMIT).unwrap();
            assert!(!gathered.is_external());
            assert_eq!(d2.load(Ordering::SeqCst), 1);
            (backing, input, gathered.to_vec::<i32>().unwrap())
        });
        for (backing, input, gathered) in out {
            assert!(backing.iter().all(|&x| x == 6.0), "{label}");
            assert!(
                input.iter().all(|&x| x == input[0]),
                "{label}: input changed"
            );
            assert_eq!(gathered, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2], "{label}");
        }
    }
}

#[test]
fn reduce_scatter_with_scale_factors_leaves_the_input_alone() {
    let out = run_world(2, Config::default().channels(2), |e, _r| {
        let input = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]);
        let keep = input.clone();
        let opts = CollectiveOptions::with_op(ReduceOp::Sum)
            .prescale(2.0)
            .postscale(0.5);
        let mut h = e.reduce_scatter_with("rs", input, opts).unwrap();
        let got = h.wait_timeout(LIMIT).unwrap().to_vec::<f32>().unwrap();
        (got, keep)
    });
    assert_eq!(out[0].0, [2.0, 4.0]);
    assert_eq!(out[1].0, [6.0, 8.0]);
}

#[test]
fn options_on_every_collective_and_scales_refused_where_they_mean_nothing() {
    let out = run_world(2, Config::default(), |e, r| {
        let p = CollectiveOptions::default().priority(5);
        let mut a = e
            .allgather_with("g", Tensor::from_slice(&[r as u8]), p)
            .unwrap();
        let mut b = e
            .broadcast_with("b", Tensor::from_slice(&[r as i64]), 1, p)
            .unwrap();
        let mut c = e
            .alltoall_with("a", Tensor::from_slice(&[r as f64, 10.0]), None, p)
            .unwrap();
        let bad = e
            .allgather_with("x", Tensor::from_slice(&[1u8]), p.prescale(2.0))
            .unwrap_err();
        (
            a.wait_timeout(LIMIT).unwrap().to_vec::<u8>().unwrap(),
            b.wait_timeout(LIMIT).unwrap().to_vec::<i64>().unwrap(),
            c.wait_timeout(LIMIT).unwrap().to_vec::<f64>().unwrap(),
            bad,
        )
    });
    for (r, (g, b, a, bad)) in out.into_iter().enumerate() {
        assert_eq!(g, [0, 1]);
        assert_eq!(b, [1]);
        assert_eq!(a, if r == 0 { [0.0, 1.0] } else { [10.0, 10.0] });
        assert!(
            matches!(&bad, SchedulerError::InvalidArgument(m) if m.contains("prescale")),
            "{bad}"
        );
    }
}

#[test]
fn topology_is_reported() {
    let out = run_world(3, Config::default(), |e, _| {
        (
            e.rank(),
            e.size(),
            e.local_rank(),
            e.local_size(),
            e.cross_rank(),
            e.cross_size(),
        )
    });
    for (r, t) in out.into_iter().enumerate() {
        assert_eq!(t, (r, 3, r, 3, 0, 1));
    }
}

#[test]
fn join_returns_the_last_rank_to_join_on_every_rank() {
    for (label, cfg) in configs() {
        let out = run_world(3, cfg, |e, r| {
            if r == 1 {
                // Rank 1 works alone for a while (the others have joined), then joins last.
                // The default op averages over every rank, joined ones included (zeros, as
                // in Horovod): 2 / 3.
                let mut h = e
                    .allreduce(
                        "solo",
                        Tensor::from_slice(&[2.0f32; 3]),
                        CollectiveOptions::default(),
                    )
                    .unwrap();
                assert_eq!(
                    h.wait_timeout(LIMIT).unwrap().to_vec::<f32>().unwrap(),
                    [2.0f32 / 3.0; 3]
                );
            }
            let mut j = e.join().unwrap();
            j.wait_timeout(LIMIT).unwrap().to_vec::<i64>().unwrap()
        });
        for last in out {
            assert_eq!(last, [1], "{label}");
        }
    }
}

#[test]
fn a_timed_out_wait_keeps_the_handle() {
    let out = run_world(2, Config::default(), |e, r| {
        if r == 1 {
            std::thread::sleep(Duration::from_millis(300));
        }
        let mut h = e
            .allreduce(
                "late",
                Tensor::from_slice(&[1.0f32; 4]),
                CollectiveOptions::with_op(ReduceOp::Sum),
            )
            .unwrap();
        let first = if r == 0 {
            Some(h.wait_timeout(Duration::from_millis(10)).unwrap_err())
        } else {
            None
        };
        let v = h.wait_timeout(LIMIT).unwrap().to_vec::<f32>().unwrap();
        let again = h.wait_timeout(LIMIT).unwrap_err();
        (first, v, again)
    });
    let (first, v, again) = &out[0];
    assert!(
        matches!(first, Some(SchedulerError::WaitTimeout { .. })),
        "{first:?}"
    );
    assert_eq!(v, &[2.0; 4]);
    assert!(again.to_string().contains("already taken"), "{again}");
}

/// int16 through every collective at np 3, expected values worked out by hand: rank r holds
/// [r + 1, -1000 (r + 1), 300].
#[test]
fn int16_through_every_collective() {
    for (label, cfg) in configs() {
        let out = run_world(3, cfg, |e, r| {
            let r16 = r as i16;
            let mine = [r16 + 1, -1000 * (r16 + 1), 300];
            let mut sum = e
                .allreduce(
                    "s16",
                    Tensor::from_slice(&mine),
                    CollectiveOptions::with_op(ReduceOp::Sum),
                )
                .unwrap();
            let mut avg = e
                .allreduce(
                    "a16",
                    Tensor::from_slice(&mine),
                    CollectiveOptions::default(),
                )
                .unwrap();
            let mut max = e
                .allreduce(
                    "m16",
                    Tensor::from_slice(&mine),
                    CollectiveOptions::with_op(ReduceOp::Max),
                )
                .unwrap();
            // Rank r gathers r + 1 rows of [r, -r].
            let rows: Vec<i16> = (0..=r).flat_map(|_| [r16, -r16]).collect();
            let rows = Tensor::new(
                fh_scheduler::DType::I16,
                vec![r + 1, 2],
                rows.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            )
            .unwrap();
            let mut ag = e.allgather("g16", rows).unwrap();
            let mut bc = e
                .broadcast("b16", Tensor::from_slice(&[i16::MIN, i16::MAX, r16]), 2)
                .unwrap();
            // Rank x sends 1000 x + y to rank y.
            let send: Vec<i16> = (0..3).map(|y| 1000 * r16 + y).collect();
            let mut a2a = e.alltoall("t16", Tensor::from_slice(&send), None).unwrap();
            // Reduce-scatter of [[r + 1, -r]; 3]: every rank gets [1 + 2 + 3, -(0 + 1 + 2)].
            let rs = Tensor::new(
                fh_scheduler::DType::I16,
                vec![3, 2],
                [r16 + 1, -r16]
                    .repeat(3)
                    .iter()
                    .flat_map(|x| x.to_ne_bytes())
                    .collect(),
            )
            .unwrap();
            let mut red = e.reduce_scatter("r16", rs, ReduceOp::Sum).unwrap();
            let v = |h: &mut fh_scheduler::Handle| {
                h.wait_timeout(LIMIT).unwrap().to_vec::<i16>().unwrap()
            };
            let got = [
                v(&mut sum),
                v(&mut avg),
                v(&mut max),
                v(&mut ag),
                v(&mut bc),
                v(&mut a2a),
                v(&mut red),
            ];
            (r16, got)
        });
        for (r, got) in out {
            let want: [Vec<i16>; 7] = [
                vec![6, -6000, 900],
                vec![2, -2000, 300],
                vec![3, -1000, 300],
                vec![0, 0, 1, -1, 1, -1, 2, -2, 2, -2, 2, -2],
                vec![i16::MIN, i16::MAX, 2],
                vec![r, 1000 + r, 2000 + r],
                vec![6, -3],
            ];
            let names = [
                "sum",
                "average",
                "max",
                "allgather",
                "broadcast",
                "alltoall",
                "reducescatter",
            ];
            for ((g, w), what) in got.iter().zip(&want).zip(names) {
                assert_eq!(g, w, "{label}: rank {r} {what}");
            }
        }
    }
}
