//! The small-allreduce workload of the riding tests (`Config::eager_bytes`), shared by the
//! in-process tests (`eager.rs`) and the TCP ones (`tcp.rs`).

use fh_scheduler::{AllreduceOptions, Engine, ReduceOp, Tensor};

use super::LIMIT;

/// Allreduces that fit the default budget together (8 + 24 + 24 + 8 + 16 = 80 bytes of room),
/// one too large to ride, and a broadcast (never rides), each step with rank- and
/// step-dependent values. Returns the number of steps whose every result was right.
pub fn steps(e: &Engine, steps: usize) -> Result<usize, String> {
    let (rank, n) = (e.rank(), e.size());
    let nf = n as f64;
    for step in 0..steps {
        let s = step as f64;
        let r = rank as f64;
        let sum = e.allreduce(
            "ride-sum",
            Tensor::from_slice(&[(r + s) as f32]),
            AllreduceOptions::with_op(ReduceOp::Sum),
        );
        let avg = e.allreduce(
            "ride-avg",
            Tensor::from_slice(&[r + s, 2.0 * r, -1.0]),
            AllreduceOptions::with_op(ReduceOp::Average)
                .prescale(2.0)
                .postscale(0.5),
        );
        let max = e.allreduce(
            "ride-max",
            Tensor::from_slice(&[rank as i32 * 3 - step as i32, 7, -(rank as i32), 0, 1]),
            AllreduceOptions::with_op(ReduceOp::Max),
        );
        let min = e.allreduce(
            "ride-min",
            Tensor::from_slice(&[(r - s) as f32, 4.0]),
            AllreduceOptions::with_op(ReduceOp::Min),
        );
        let prod = e.allreduce(
            "ride-prod",
            Tensor::from_slice(&[2i64, rank as i64 + 1]),
            AllreduceOptions::with_op(ReduceOp::Product),
        );
        let big = e.allreduce(
            "too-big-to-ride",
            Tensor::from_slice(&vec![(r + s) as f32; 2000]),
            AllreduceOptions::with_op(ReduceOp::Sum),
        );
        let bc = e.broadcast("bc-small", Tensor::from_slice(&[(r + s) as f32]), 0);
        let wait = |h: Result<fh_scheduler::Handle, fh_scheduler::SchedulerError>| {
            h.and_then(|mut h| h.wait_timeout(LIMIT))
                .map_err(|err| format!("step {step}: {err}"))
        };
        let ranks = 0..n;
        let want_sum = ranks.clone().map(|q| q as f64 + s).sum::<f64>() as f32;
        let got = wait(sum)?.to_vec::<f32>().map_err(|e| e.to_string())?;
        check(step, "sum", &got, &[want_sum])?;
        let got = wait(avg)?.to_vec::<f64>().map_err(|e| e.to_string())?;
        let total_a: f64 = ranks.clone().map(|q| 2.0 * (q as f64 + s)).sum();
        let total_b: f64 = ranks.clone().map(|q| 4.0 * q as f64).sum();
        let want = [total_a / nf * 0.5, total_b / nf * 0.5, -2.0 * nf / nf * 0.5];
        if got.len() != 3 || got.iter().zip(want).any(|(g, w)| (g - w).abs() > 1e-9) {
            return Err(format!(
                "step {step}: average gave {got:?}, expected {want:?}"
            ));
        }
        let got = wait(max)?.to_vec::<i32>().map_err(|e| e.to_string())?;
        let want = [(n as i32 - 1) * 3 - step as i32, 7, 0, 0, 1];
        check(step, "max", &got, &want)?;
        let got = wait(min)?.to_vec::<f32>().map_err(|e| e.to_string())?;
        check(step, "min", &got, &[-(s as f32), 4.0])?;
        let got = wait(prod)?.to_vec::<i64>().map_err(|e| e.to_string())?;
        let want = [1i64 << n, (1..=n as i64).product()];
        check(step, "product", &got, &want)?;
        let got = wait(big)?.to_vec::<f32>().map_err(|e| e.to_string())?;
        if got.len() != 2000 || got.iter().any(|&x| x != want_sum) {
            return Err(format!("step {step}: the large allreduce is wrong"));
        }
        let got = wait(bc)?.to_vec::<f32>().map_err(|e| e.to_string())?;
        check(step, "broadcast", &got, &[s as f32])?;
    }
    Ok(steps)
}

/// The allreduces of [`steps`] that ride once cached: every step after the first.
pub const RIDERS_PER_STEP: u64 = 5;

fn check<T: PartialEq + std::fmt::Debug>(
    step: usize,
    what: &str,
    got: &[T],
    want: &[T],
) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!(
            "step {step}: {what} gave {got:?}, expected {want:?}"
        ))
    }
}
