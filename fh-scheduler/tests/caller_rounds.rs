//! A caller blocked on its own undispatched operation runs the negotiation round on its thread
//! while the negotiation thread idles (`Config::caller_rounds`): the same results as with every
//! round on the negotiation thread, whichever wait is used; a submission nobody waits for still
//! runs while callers run the rounds; a short bounded wait never runs one. A rank lost while a
//! caller runs the round: `errors.rs` (`a_lost_rank_fails_pending_handles_naming_it` waits with
//! a bound long enough to run it).

mod common;

use std::time::{Duration, Instant};

use common::{run_world, LIMIT};
use fh_scheduler::{AllreduceOptions, Config, Engine, ReduceOp, Tensor};

fn sum() -> AllreduceOptions {
    AllreduceOptions::with_op(ReduceOp::Sum)
}

/// `steps` allreduces of one name, each submitted a moment (200 µs, a step's compute) after the
/// last completed, waited for with `Handle::wait` and `Handle::wait_timeout` in turn; the sums
/// they gave. (Submitted at once instead, the next allreduce can reach a negotiation thread
/// before it idles, on every rank and every step: it then runs every round itself and no
/// caller gets to — 1 in about 100 runs of the first test here.)
fn back_to_back(e: &Engine, r: usize, steps: usize) -> Vec<f64> {
    (0..steps)
        .map(|s| {
            std::thread::sleep(Duration::from_micros(200));
            let x = Tensor::from_slice(&[r as f64 + s as f64, 1.0]);
            let h = e.allreduce("metric", x, sum()).unwrap();
            let t = if s % 2 == 0 {
                h.wait().unwrap()
            } else {
                let mut h = h;
                h.wait_timeout(LIMIT).unwrap()
            };
            t.to_vec::<f64>().unwrap()[0]
        })
        .collect()
}

#[test]
fn waiting_callers_run_the_rounds_with_the_results_of_the_negotiation_thread() {
    const STEPS: usize = 60;
    for n in 2..=4 {
        for on in [true, false] {
            let cfg = Config::default().caller_rounds(on);
            let out = run_world(n, cfg, |e, r| (back_to_back(e, r, STEPS), e.stats()));
            let ranks: f64 = (0..n).map(|r| r as f64).sum();
            let want: Vec<f64> = (0..STEPS).map(|s| ranks + (n * s) as f64).collect();
            for (rank, (got, stats)) in out.iter().enumerate() {
                assert_eq!(got, &want, "caller rounds {on}, {n} ranks, rank {rank}");
                if on {
                    assert!(
                        stats.caller_rounds <= stats.rounds,
                        "{n} ranks, rank {rank}: {stats:?}"
                    );
                } else {
                    assert_eq!(stats.caller_rounds, 0, "{n} ranks, rank {rank}: {stats:?}");
                }
            }
            if on {
                // The negotiation threads idle between the allreduces: callers ran rounds. Not
                // necessarily on every rank: a negotiation thread that holds announced work
                // sits in rounds until every rank has it, and where the callers' timing keeps
                // a rank's thread there, its callers never find it idle (rank 1 in 4 of 12
                // in-process runs here; the results are the same either way).
                let helped: u64 = out.iter().map(|(_, s)| s.caller_rounds).sum();
                assert!(
                    helped > 0,
                    "caller rounds on, {n} ranks: no caller ran a round"
                );
            }
        }
    }
}

/// After a run of synchronous allreduces (callers run the rounds, and the negotiation thread
/// no longer wakes for each submission), a submission that nobody waits for, only polls,
/// still completes: the negotiation thread looks for it on its own.
#[test]
fn a_submission_nobody_waits_for_runs_while_callers_run_the_rounds() {
    let out = run_world(3, Config::default(), |e, r| {
        back_to_back(e, r, 20);
        let helped = e.stats().caller_rounds;
        std::thread::sleep(Duration::from_millis(3 * r as u64));
        let mut h = e
            .allreduce("polled", Tensor::from_slice(&[1.0f32 + r as f32]), sum())
            .unwrap();
        let start = Instant::now();
        while !h.poll() {
            assert!(
                start.elapsed() < LIMIT,
                "rank {r}: 'polled' never completed"
            );
            std::thread::sleep(Duration::from_micros(100));
        }
        let got = h.try_take().unwrap().unwrap().to_vec::<f32>().unwrap();
        (got, helped, e.stats().caller_rounds)
    });
    for (rank, (got, helped, after)) in out.iter().enumerate() {
        assert_eq!(got, &[6.0], "rank {rank}");
        assert_eq!(after, helped, "rank {rank}: a poll ran a round");
    }
    // Callers ran rounds (on some rank at least; see above), so some negotiation thread was
    // no longer woken by submissions when 'polled' came, and found it on its own.
    assert!(
        out.iter().any(|(_, helped, _)| *helped > 0),
        "no caller ran a round"
    );
}

/// A bounded wait shorter than 100 ms never runs a round (the round ends when every rank has
/// entered it, which such a wait should not sit through).
#[test]
fn a_short_bounded_wait_leaves_the_rounds_to_the_negotiation_thread() {
    let out = run_world(3, Config::default(), |e, r| {
        let got: Vec<f32> = (0..20)
            .map(|s| {
                let x = Tensor::from_slice(&[(r + s) as f32]);
                let mut h = e.allreduce("short", x, sum()).unwrap();
                let start = Instant::now();
                loop {
                    match h.wait_timeout(Duration::from_millis(20)) {
                        Ok(t) => break t.to_vec::<f32>().unwrap()[0],
                        Err(fh_scheduler::SchedulerError::WaitTimeout { .. }) => {
                            assert!(start.elapsed() < LIMIT, "rank {r}: step {s} hangs");
                        }
                        Err(e) => panic!("rank {r}: {e}"),
                    }
                }
            })
            .collect();
        (got, e.stats().caller_rounds)
    });
    for (rank, (got, helped)) in out.iter().enumerate() {
        let want: Vec<f32> = (0..20).map(|s| (3 + 3 * s) as f32).collect();
        assert_eq!(got, &want, "rank {rank}");
        assert_eq!(*helped, 0, "rank {rank}");
    }
}

/// On an idle engine (no caller ran a round) the negotiation thread sleeps parked until its
/// heartbeat; a submission that nobody waits for wakes it at once, not at the heartbeat.
#[test]
fn a_submission_wakes_the_parked_negotiation_thread_at_once() {
    const HEARTBEAT: Duration = Duration::from_secs(30);
    let cfg = Config::default().idle_heartbeat(HEARTBEAT);
    let out = run_world(3, cfg, |e, r| {
        // Long enough for every negotiation thread to have parked.
        std::thread::sleep(Duration::from_millis(200));
        let start = Instant::now();
        let mut h = e
            .allreduce("unwaited", Tensor::from_slice(&[1.0f32 + r as f32]), sum())
            .unwrap();
        while !h.poll() {
            assert!(
                start.elapsed() < HEARTBEAT / 3,
                "rank {r}: 'unwaited' was not negotiated before the heartbeat"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let got = h.try_take().unwrap().unwrap().to_vec::<f32>().unwrap();
        (got, start.elapsed(), e.stats().caller_rounds)
    });
    for (rank, (got, took, helped)) in out.iter().enumerate() {
        assert_eq!(got, &[6.0], "rank {rank}");
        assert_eq!(*helped, 0, "rank {rank}: a poll ran a round");
        assert!(*took < HEARTBEAT / 3, "rank {rank}: took {took:?}");
    }
}
