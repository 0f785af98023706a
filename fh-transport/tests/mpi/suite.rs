//! The MPI collective suite, run by every rank under `mpirun`.
//!
//! Shared (through `#[path]`) by `examples/mpi_suite.rs` and `tests/mpi_mpirun.rs`. Every rank
//! builds its inputs from a deterministic function of (rank, index, case), runs the collective
//! through the MPI transport, and compares the result with a sequential reference it computes
//! locally from every rank's inputs with `fh_core::kernels`. Inputs are small integers, so the
//! reductions are exact in every dtype (including f16/bf16) whatever order MPI reduces in, and
//! results can be compared bit for bit.

use std::fmt::Write as _;

use fh_core::{kernels, DType, ReduceOp};
use fh_transport::backend::mpi::{MpiComm, MpiTransport, ThreadMode};
use fh_transport::{CollectivesExt, Communicator, Transport, TransportError};

/// Every dtype.
pub const DTYPES: [DType; 10] = [
    DType::U8,
    DType::I8,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::F16,
    DType::BF16,
    DType::F32,
    DType::F64,
    DType::Bool,
];

/// Every reduction operator.
pub const OPS: [ReduceOp; 7] = [
    ReduceOp::Sum,
    ReduceOp::Average,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Product,
    ReduceOp::BitAnd,
    ReduceOp::BitOr,
];

/// Element counts: empty, one, primes, and one larger than any eager limit.
pub const LENGTHS: [usize; 8] = [0, 1, 2, 3, 7, 31, 257, 4099];

/// An unexpected error: the suite stops (the caller aborts the job).
pub type Fatal = String;

fn fatal(what: &str, e: TransportError) -> Fatal {
    format!("{what}: unexpected error: {e}")
}

/// What the suite found.
#[derive(Debug, Default)]
pub struct Report {
    /// Checks that ran.
    pub checks: usize,
    /// Descriptions of the checks that failed on this rank.
    pub failures: Vec<String>,
}

impl Report {
    fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        self.checks += 1;
        if !ok {
            self.failures.push(what());
        }
    }
}

/// The input value of element `i` on `rank` for case `salt`: a small integer, valid for `dtype`.
fn value(dtype: DType, rank: usize, i: usize, salt: usize) -> f64 {
    let h = rank * 7 + i * 3 + salt * 11;
    match dtype {
        DType::Bool => (h % 3 != 0) as u8 as f64,
        DType::U8 => (h % 4) as f64,
        DType::I8 => (h % 7) as f64 - 3.0,
        _ => (h % 9) as f64 - 4.0,
    }
}

fn encode(dtype: DType, vals: impl Iterator<Item = f64>) -> Vec<u8> {
    let mut out = Vec::new();
    for v in vals {
        match dtype {
            DType::U8 | DType::Bool => out.push(v as u8),
            DType::I8 => out.extend((v as i8).to_ne_bytes()),
            DType::I16 => out.extend((v as i16).to_ne_bytes()),
            DType::I32 => out.extend((v as i32).to_ne_bytes()),
            DType::I64 => out.extend((v as i64).to_ne_bytes()),
            DType::F16 => out.extend(half::f16::from_f64(v).to_ne_bytes()),
            DType::BF16 => out.extend(half::bf16::from_f64(v).to_ne_bytes()),
            DType::F32 => out.extend((v as f32).to_ne_bytes()),
            DType::F64 => out.extend(v.to_ne_bytes()),
        }
    }
    out
}

/// `rank`'s input of `n` elements for case `salt`.
fn input(dtype: DType, rank: usize, n: usize, salt: usize) -> Vec<u8> {
    encode(dtype, (0..n).map(|i| value(dtype, rank, i, salt)))
}

/// The reduction of every rank's input, computed sequentially in rank order.
fn reference(dtype: DType, op: ReduceOp, size: usize, n: usize, salt: usize) -> Vec<u8> {
    let mut acc = input(dtype, 0, n, salt);
    for r in 1..size {
        kernels::reduce(dtype, op.combining(), &mut acc, &input(dtype, r, n, salt))
            .expect("reference reduction");
    }
    if op == ReduceOp::Average {
        kernels::divide(dtype, &mut acc, size).expect("reference division");
    }
    acc
}

fn first_diff(a: &[u8], b: &[u8]) -> String {
    if a.len() != b.len() {
        return format!("lengths {} vs {}", a.len(), b.len());
    }
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(p) => format!(
            "first difference at byte {p}: got {} expected {}",
            a[p], b[p]
        ),
        None => "equal".into(),
    }
}

/// Deterministic payload byte `j` of a message from `from` to `to` in case `salt`.
fn byte(from: usize, to: usize, j: usize, salt: usize) -> u8 {
    ((from * 17 + to * 29 + j * 7 + salt * 13) % 253) as u8
}

fn check_allreduce(
    comm: &mut dyn Communicator,
    rep: &mut Report,
    tag: &str,
    dtypes: &[DType],
    ops: &[ReduceOp],
    lengths: &[usize],
) -> Result<(), Fatal> {
    let (rank, size) = (comm.rank(), comm.size());
    for (di, &dtype) in dtypes.iter().enumerate() {
        for (oi, &op) in ops.iter().enumerate() {
            for &n in lengths {
                let salt = di * 31 + oi * 5 + n;
                let mut buf = input(dtype, rank, n, salt);
                let res = comm.allreduce(&mut buf, dtype, op);
                if !kernels::supports(dtype, op) {
                    rep.check(
                        matches!(res, Err(TransportError::InvalidArgument(_))),
                        || {
                            format!(
                                "{tag}: allreduce {dtype} {op:?} should be refused, got {res:?}"
                            )
                        },
                    );
                    continue;
                }
                res.map_err(|e| fatal(&format!("{tag}: allreduce {dtype} {op:?} n={n}"), e))?;
                let want = reference(dtype, op, size, n, salt);
                rep.check(buf == want, || {
                    format!(
                        "{tag}: allreduce {dtype} {op:?} n={n}: {}",
                        first_diff(&buf, &want)
                    )
                });
            }
        }
    }
    Ok(())
}

fn check_reduce_scatter(
    comm: &mut dyn Communicator,
    rep: &mut Report,
    tag: &str,
    dtypes: &[DType],
    ops: &[ReduceOp],
    large: bool,
) -> Result<(), Fatal> {
    let (rank, size) = (comm.rank(), comm.size());
    let mut layouts: Vec<Vec<usize>> = vec![
        (0..size).map(|r| (r * 5 + 2) % 7).collect(),
        (0..size).map(|r| if r == 1 { 0 } else { 3 + r }).collect(),
        vec![0; size],
        vec![1; size],
        vec![13; size],
    ];
    if large {
        layouts.push((0..size).map(|r| 4099 + r).collect());
    }
    for (di, &dtype) in dtypes.iter().enumerate() {
        for (oi, &op) in ops.iter().enumerate() {
            for (li, counts) in layouts.iter().enumerate() {
                let total: usize = counts.iter().sum();
                let salt = di * 7 + oi * 3 + li;
                let send = input(dtype, rank, total, salt);
                let esz = dtype.size();
                let mut recv = vec![0xA5u8; counts[rank] * esz];
                let res = comm.reduce_scatter(&send, &mut recv, counts, dtype, op);
                if !kernels::supports(dtype, op) {
                    rep.check(
                        matches!(res, Err(TransportError::InvalidArgument(_))),
                        || {
                            format!(
                            "{tag}: reduce_scatter {dtype} {op:?} should be refused, got {res:?}"
                        )
                        },
                    );
                    continue;
                }
                res.map_err(|e| {
                    fatal(
                        &format!("{tag}: reduce_scatter {dtype} {op:?} counts={counts:?}"),
                        e,
                    )
                })?;
                let full = reference(dtype, op, size, total, salt);
                let off: usize = counts[..rank].iter().sum();
                let want = &full[off * esz..(off + counts[rank]) * esz];
                rep.check(recv == want, || {
                    format!(
                        "{tag}: reduce_scatter {dtype} {op:?} counts={counts:?}: {}",
                        first_diff(&recv, want)
                    )
                });
            }
        }
    }
    Ok(())
}

fn check_allgatherv(
    comm: &mut dyn Communicator,
    rep: &mut Report,
    tag: &str,
    large: bool,
) -> Result<(), Fatal> {
    let (rank, size) = (comm.rank(), comm.size());
    let mut layouts: Vec<Vec<usize>> = vec![
        (0..size).map(|r| (r * 7 + 3) % 11).collect(),
        (0..size).map(|r| if r == 1 { 0 } else { r + 1 }).collect(),
        vec![0; size],
        vec![1; size],
    ];
    if large {
        layouts.push((0..size).map(|r| 100_003 + r * 17).collect());
    }
    for (li, counts) in layouts.iter().enumerate() {
        let send: Vec<u8> = (0..counts[rank]).map(|j| byte(rank, 0, j, li)).collect();
        let total: usize = counts.iter().sum();
        let mut recv = vec![0xA5u8; total];
        comm.allgatherv(&send, &mut recv, counts)
            .map_err(|e| fatal(&format!("{tag}: allgatherv counts={counts:?}"), e))?;
        let want: Vec<u8> = (0..size)
            .flat_map(|r| (0..counts[r]).map(move |j| byte(r, 0, j, li)))
            .collect();
        rep.check(recv == want, || {
            format!(
                "{tag}: allgatherv counts={counts:?}: {}",
                first_diff(&recv, &want)
            )
        });
    }
    Ok(())
}

fn check_broadcast(
    comm: &mut dyn Communicator,
    rep: &mut Report,
    tag: &str,
    large: bool,
) -> Result<(), Fatal> {
    let (rank, size) = (comm.rank(), comm.size());
    let lengths: &[usize] = if large {
        &[0, 1, 13, 4099, 65_537]
    } else {
        &[0, 1, 13, 64]
    };
    for root in 0..size {
        for &n in lengths {
            let want: Vec<u8> = (0..n).map(|j| byte(root, 1, j, n)).collect();
            let mut buf = if rank == root {
                want.clone()
            } else {
                vec![0xA5; n]
            };
            comm.broadcast(&mut buf, root)
                .map_err(|e| fatal(&format!("{tag}: broadcast root={root} n={n}"), e))?;
            rep.check(buf == want, || {
                format!(
                    "{tag}: broadcast root={root} n={n}: {}",
                    first_diff(&buf, &want)
                )
            });
        }
    }
    Ok(())
}

fn check_alltoallv(
    comm: &mut dyn Communicator,
    rep: &mut Report,
    tag: &str,
    large: bool,
) -> Result<(), Fatal> {
    let (rank, size) = (comm.rank(), comm.size());
    let layouts: [&dyn Fn(usize, usize) -> usize; 4] = [
        &|r, s| (r * 3 + s * 5) % 7,
        &|r, s| if r == s { 0 } else { r + 2 * s + 1 },
        &|_, _| 0,
        &|r, s| 20_011 + r * 3 + s,
    ];
    let used = if large {
        layouts.len()
    } else {
        layouts.len() - 1
    };
    for (li, count) in layouts.iter().take(used).enumerate() {
        let send_counts: Vec<usize> = (0..size).map(|s| count(rank, s)).collect();
        let recv_counts: Vec<usize> = (0..size).map(|r| count(r, rank)).collect();
        let send: Vec<u8> = (0..size)
            .flat_map(|s| (0..count(rank, s)).map(move |j| byte(rank, s, j, li)))
            .collect();
        let want: Vec<u8> = (0..size)
            .flat_map(|r| (0..count(r, rank)).map(move |j| byte(r, rank, j, li)))
            .collect();
        let mut recv = vec![0xA5u8; want.len()];
        comm.alltoallv(&send, &send_counts, &mut recv, &recv_counts)
            .map_err(|e| fatal(&format!("{tag}: alltoallv layout {li}"), e))?;
        rep.check(recv == want, || {
            format!("{tag}: alltoallv layout {li}: {}", first_diff(&recv, &want))
        });
    }
    Ok(())
}

fn check_p2p(
    comm: &mut dyn Communicator,
    rep: &mut Report,
    tag: &str,
    large: bool,
) -> Result<(), Fatal> {
    let (rank, size) = (comm.rank(), comm.size());
    let next = (rank + 1) % size;
    let prev = (rank + size - 1) % size;
    let lengths: &[usize] = if large {
        &[0, 1, 1000, 1 << 20]
    } else {
        &[0, 1, 5, 6, 23]
    };
    for &n in lengths {
        // Blocking sends: even ranks send first, odd ranks receive first.
        let out: Vec<u8> = (0..n).map(|j| byte(rank, next, j, n)).collect();
        let want: Vec<u8> = (0..n).map(|j| byte(prev, rank, j, n)).collect();
        let mut got = vec![0xA5u8; n];
        let what = format!("{tag}: ring send/recv n={n}");
        if size == 1 {
            // A blocking send to oneself waits for a receive that never comes first.
        } else if rank % 2 == 0 {
            comm.send(next, &out).map_err(|e| fatal(&what, e))?;
            comm.recv(prev, &mut got).map_err(|e| fatal(&what, e))?;
        } else {
            comm.recv(prev, &mut got).map_err(|e| fatal(&what, e))?;
            comm.send(next, &out).map_err(|e| fatal(&what, e))?;
        }
        if size > 1 {
            rep.check(got == want, || {
                format!("{what}: {}", first_diff(&got, &want))
            });
        }

        // Everybody at once: send_recv must not deadlock, whatever the size.
        let mut got = vec![0xA5u8; n];
        let what = format!("{tag}: ring send_recv n={n}");
        comm.send_recv(next, &out, prev, &mut got)
            .map_err(|e| fatal(&what, e))?;
        rep.check(got == want, || {
            format!("{what}: {}", first_diff(&got, &want))
        });
    }

    // Exact-length receives: a message of another length is a Protocol error naming the
    // sender, and the communicator stays usable.
    if size >= 2 && rank < 2 {
        for (sent, expected) in [(10usize, 12usize), (20, 12), (0, 3), (3, 0)] {
            let what = format!("{tag}: length mismatch sent={sent} expected={expected}");
            if rank == 0 {
                comm.send(1, &vec![7u8; sent])
                    .map_err(|e| fatal(&what, e))?;
                comm.send(1, &[1, 2, 3]).map_err(|e| fatal(&what, e))?;
            } else {
                let mut buf = vec![0u8; expected];
                let res = comm.recv(0, &mut buf);
                rep.check(
                    matches!(&res, Err(TransportError::Protocol { rank: 0, detail }) if detail.contains(&format!("received {sent}"))),
                    || format!("{what}: expected a Protocol error from rank 0, got {res:?}"),
                );
                let mut next_msg = [0u8; 3];
                let res = comm.recv(0, &mut next_msg);
                rep.check(res.is_ok() && next_msg == [1, 2, 3], || {
                    format!(
                        "{what}: the next message was not received intact: {res:?} {next_msg:?}"
                    )
                });
            }
        }
    }
    let what = format!("{tag}: peer out of range");
    let res = comm.send(size, &[1]);
    rep.check(
        matches!(res, Err(TransportError::InvalidArgument(_))),
        || format!("{what}: got {res:?}"),
    );
    Ok(())
}

fn check_invalid_arguments(
    comm: &mut dyn Communicator,
    rep: &mut Report,
    tag: &str,
) -> Result<(), Fatal> {
    let size = comm.size();
    let mut recv = vec![0u8; 4];
    let res = comm.allgatherv(&[1], &mut recv, &vec![1; size + 1]);
    rep.check(
        matches!(res, Err(TransportError::InvalidArgument(_))),
        || format!("{tag}: allgatherv with {} counts: {res:?}", size + 1),
    );
    let mut b = [0u8; 2];
    let res = comm.broadcast(&mut b, size);
    rep.check(
        matches!(res, Err(TransportError::InvalidArgument(_))),
        || format!("{tag}: broadcast from root {size}: {res:?}"),
    );
    let mut odd = [0u8; 3];
    let res = comm.allreduce(&mut odd, DType::F32, ReduceOp::Sum);
    rep.check(
        matches!(res, Err(TransportError::InvalidArgument(_))),
        || format!("{tag}: allreduce of 3 bytes as f32: {res:?}"),
    );
    // Counts whose sum or byte size overflows: refused locally (the shared checks), on every
    // rank alike, before any MPI call.
    let mut huge = vec![1usize; size];
    huge[0] = usize::MAX;
    let res = comm.alltoallv(&[], &huge, &mut [], &huge);
    rep.check(
        matches!(res, Err(TransportError::InvalidArgument(_))),
        || format!("{tag}: alltoallv with overflowing counts: {res:?}"),
    );
    let res = comm.allgatherv(&[], &mut [], &huge);
    rep.check(
        matches!(res, Err(TransportError::InvalidArgument(_))),
        || format!("{tag}: allgatherv with overflowing counts: {res:?}"),
    );
    let res = comm.reduce_scatter(&[], &mut [], &huge, DType::F64, ReduceOp::Sum);
    rep.check(
        matches!(res, Err(TransportError::InvalidArgument(_))),
        || format!("{tag}: reduce_scatter with overflowing counts: {res:?}"),
    );
    Ok(())
}

fn check_ext(comm: &mut dyn Communicator, rep: &mut Report, tag: &str) -> Result<(), Fatal> {
    let (rank, size) = (comm.rank(), comm.size());
    let mut v = vec![rank as f32 + 1.0; 5];
    comm.allreduce_typed(&mut v, ReduceOp::Sum)
        .map_err(|e| fatal(&format!("{tag}: allreduce_typed"), e))?;
    let s = (size * (size + 1) / 2) as f32;
    rep.check(v == vec![s; 5], || {
        format!("{tag}: allreduce_typed got {v:?}")
    });

    let mut buf: Vec<u8> = [rank as f32 + 1.0; 3]
        .iter()
        .flat_map(|x| x.to_ne_bytes())
        .collect();
    comm.allreduce_scaled(&mut buf, DType::F32, ReduceOp::Sum, 2.0, 0.5)
        .map_err(|e| fatal(&format!("{tag}: allreduce_scaled"), e))?;
    let want: Vec<u8> = [s; 3].iter().flat_map(|x| x.to_ne_bytes()).collect();
    rep.check(buf == want, || format!("{tag}: allreduce_scaled"));

    let send = [rank as u8; 3];
    let mut all = vec![0u8; 3 * size];
    comm.allgather(&send, &mut all)
        .map_err(|e| fatal(&format!("{tag}: allgather"), e))?;
    let want: Vec<u8> = (0..size).flat_map(|r| [r as u8; 3]).collect();
    rep.check(all == want, || format!("{tag}: allgather got {all:?}"));

    let send: Vec<u8> = (0..size).map(|s| (rank * 10 + s) as u8).collect();
    let mut recv = vec![0u8; size];
    comm.alltoall(&send, &mut recv)
        .map_err(|e| fatal(&format!("{tag}: alltoall"), e))?;
    let want: Vec<u8> = (0..size).map(|r| (r * 10 + rank) as u8).collect();
    rep.check(recv == want, || format!("{tag}: alltoall got {recv:?}"));

    for _ in 0..3 {
        comm.barrier()
            .map_err(|e| fatal(&format!("{tag}: barrier"), e))?;
    }
    Ok(())
}

/// Several communicators used at once from their own threads must not see each other's data.
fn check_concurrent_channels(
    world: &mut MpiTransport,
    rep: &mut Report,
    tag: &str,
) -> Result<(), Fatal> {
    let (rank, size) = (world.rank(), world.size());
    let mut comms = Vec::new();
    for c in 0..3 {
        comms.push(
            world
                .open(&format!("concurrent-{c}"))
                .map_err(|e| fatal(&format!("{tag}: open"), e))?,
        );
    }
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(c, mut comm)| {
            std::thread::spawn(move || -> Result<usize, String> {
                let mut bad = 0;
                for it in 0..40 {
                    let n = 1 + (it * 37 + c * 1000) % 5000;
                    let mut v: Vec<i64> =
                        (0..n).map(|i| (rank * 3 + c * 7 + it + i) as i64).collect();
                    comm.allreduce_typed(&mut v, ReduceOp::Sum)
                        .map_err(|e| format!("channel {c}: {e}"))?;
                    let ok = v.iter().enumerate().all(|(i, &x)| {
                        x == (0..size)
                            .map(|r| (r * 3 + c * 7 + it + i) as i64)
                            .sum::<i64>()
                    });
                    bad += usize::from(!ok);
                    // Some point-to-point traffic on the same channel, too.
                    let out = vec![(c * 10 + it) as u8; 100 + c];
                    let mut got = vec![0u8; 100 + c];
                    comm.send_recv((rank + 1) % size, &out, (rank + size - 1) % size, &mut got)
                        .map_err(|e| format!("channel {c}: {e}"))?;
                    bad += usize::from(got != out);
                }
                Ok(bad)
            })
        })
        .collect();
    for (c, h) in handles.into_iter().enumerate() {
        let bad = h
            .join()
            .map_err(|_| format!("{tag}: channel {c} thread panicked"))?
            .map_err(|e| format!("{tag}: {e}"))?;
        rep.check(bad == 0, || {
            format!("{tag}: channel {c}: {bad} wrong results")
        });
    }
    Ok(())
}

fn check_topology(
    world: &mut MpiTransport,
    comm: &mut dyn Communicator,
    rep: &mut Report,
) -> Result<(), Fatal> {
    let t = world.topology();
    let mine: Vec<u8> = [
        t.rank,
        t.size,
        t.local_rank,
        t.local_size,
        t.cross_rank,
        t.cross_size,
    ]
    .iter()
    .flat_map(|&v| (v as u32).to_ne_bytes())
    .collect();
    let mut all = vec![0u8; mine.len() * t.size];
    comm.allgather(&mine, &mut all)
        .map_err(|e| fatal("topology allgather", e))?;
    let rows: Vec<Vec<u32>> = all
        .chunks(mine.len())
        .map(|c| {
            c.chunks(4)
                .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        })
        .collect();
    let ok = rows.iter().enumerate().all(|(r, row)| {
        row[0] as usize == r
            && row[1] as usize == t.size
            && (row[2] as usize) < row[3] as usize
            && (row[4] as usize) < row[5] as usize
            && (row[3] * row[5]) as usize == t.size
    });
    rep.check(ok && t.rank == comm.rank() && t.size == comm.size(), || {
        format!("topology inconsistent across ranks: {rows:?}")
    });
    Ok(())
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A length: mostly small, sometimes up to 100k.
fn random_len(state: &mut u64) -> usize {
    match splitmix(state) % 4 {
        0 => (splitmix(state) % 100_000) as usize,
        1 => (splitmix(state) % 2_000) as usize,
        _ => (splitmix(state) % 40) as usize,
    }
}

/// Random cases with a seed every rank shares (rank 0's, broadcast; `FH_MPI_SUITE_SEED` fixes
/// it to reproduce a failure): collective, dtype, operator, lengths and v-splits all drawn.
fn check_random(comm: &mut dyn Communicator, rep: &mut Report, tag: &str) -> Result<(), Fatal> {
    let (rank, size) = (comm.rank(), comm.size());
    let mut seed_bytes = std::env::var("FH_MPI_SUITE_SEED")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(7)
        })
        .to_ne_bytes();
    comm.broadcast(&mut seed_bytes, 0)
        .map_err(|e| fatal("random: seed broadcast", e))?;
    let seed = u64::from_ne_bytes(seed_bytes);
    if rank == 0 {
        eprintln!("mpi_suite: {tag} random cases with FH_MPI_SUITE_SEED={seed}");
    }
    let mut st = seed;
    for case in 0..150usize {
        let dtype = DTYPES[(splitmix(&mut st) % DTYPES.len() as u64) as usize];
        let op = OPS[(splitmix(&mut st) % OPS.len() as u64) as usize];
        let kind = splitmix(&mut st) % 5;
        let counts: Vec<usize> = (0..size)
            .map(|_| {
                if splitmix(&mut st) % 4 == 0 {
                    0
                } else {
                    random_len(&mut st)
                }
            })
            .collect();
        let n = random_len(&mut st);
        let root = (splitmix(&mut st) % size as u64) as usize;
        let salt = 1000 + case;
        let what = format!(
            "{tag} seed={seed} (FH_MPI_SUITE_SEED) case {case}: kind {kind} {dtype} {op:?} n={n} counts={counts:?}"
        );
        if std::env::var_os("FH_MPI_SUITE_TRACE").is_some() && rank == 0 {
            eprintln!("{what}");
        }
        if let Ok(only) = std::env::var("FH_MPI_SUITE_CASES") {
            if !only.split(',').any(|c| c.trim() == case.to_string()) {
                continue;
            }
        }
        let esz = dtype.size();
        match kind {
            0 => {
                let mut buf = input(dtype, rank, n, salt);
                let res = comm.allreduce(&mut buf, dtype, op);
                if !kernels::supports(dtype, op) {
                    rep.check(
                        matches!(res, Err(TransportError::InvalidArgument(_))),
                        || format!("{what}: should be refused, got {res:?}"),
                    );
                    continue;
                }
                res.map_err(|e| fatal(&what, e))?;
                let want = reference(dtype, op, size, n, salt);
                rep.check(buf == want, || {
                    format!("{what}: {}", first_diff(&buf, &want))
                });
            }
            1 => {
                let total: usize = counts.iter().sum();
                let send = input(dtype, rank, total, salt);
                let mut recv = vec![0xA5u8; counts[rank] * esz];
                let res = comm.reduce_scatter(&send, &mut recv, &counts, dtype, op);
                if !kernels::supports(dtype, op) {
                    rep.check(
                        matches!(res, Err(TransportError::InvalidArgument(_))),
                        || format!("{what}: should be refused, got {res:?}"),
                    );
                    continue;
                }
                res.map_err(|e| fatal(&what, e))?;
                let full = reference(dtype, op, size, total, salt);
                let off: usize = counts[..rank].iter().sum();
                let want = &full[off * esz..(off + counts[rank]) * esz];
                rep.check(recv == want, || {
                    format!("{what}: {}", first_diff(&recv, want))
                });
            }
            2 => {
                let send: Vec<u8> = (0..counts[rank]).map(|j| byte(rank, 0, j, salt)).collect();
                let mut recv = vec![0xA5u8; counts.iter().sum()];
                comm.allgatherv(&send, &mut recv, &counts)
                    .map_err(|e| fatal(&what, e))?;
                let want: Vec<u8> = (0..size)
                    .flat_map(|r| (0..counts[r]).map(move |j| byte(r, 0, j, salt)))
                    .collect();
                rep.check(recv == want, || {
                    format!("{what}: {}", first_diff(&recv, &want))
                });
            }
            3 => {
                // Counts from rank r to rank s: a function both sides can evaluate.
                let c = |r: usize, s: usize| {
                    let mut x = seed ^ ((case * 131 + r * 17 + s) as u64);
                    if splitmix(&mut x) % 3 == 0 {
                        0
                    } else {
                        random_len(&mut x) % 5_000
                    }
                };
                let send_counts: Vec<usize> = (0..size).map(|s| c(rank, s)).collect();
                let recv_counts: Vec<usize> = (0..size).map(|r| c(r, rank)).collect();
                let send: Vec<u8> = (0..size)
                    .flat_map(|s| (0..c(rank, s)).map(move |j| byte(rank, s, j, salt)))
                    .collect();
                let want: Vec<u8> = (0..size)
                    .flat_map(|r| (0..c(r, rank)).map(move |j| byte(r, rank, j, salt)))
                    .collect();
                let mut recv = vec![0xA5u8; want.len()];
                comm.alltoallv(&send, &send_counts, &mut recv, &recv_counts)
                    .map_err(|e| fatal(&what, e))?;
                rep.check(recv == want, || {
                    format!("{what}: {}", first_diff(&recv, &want))
                });
            }
            _ => {
                let want: Vec<u8> = (0..n).map(|j| byte(root, 1, j, salt)).collect();
                let mut buf = if rank == root {
                    want.clone()
                } else {
                    vec![0xA5; n]
                };
                comm.broadcast(&mut buf, root)
                    .map_err(|e| fatal(&format!("{what} root={root}"), e))?;
                rep.check(buf == want, || {
                    format!("{what} root={root}: {}", first_diff(&buf, &want))
                });
            }
        }
    }
    Ok(())
}

/// `FH_TRANSPORT=mpi` makes `fh_transport::from_env()` build the MPI world (sharing this
/// process's MPI with `world`).
fn check_from_env(world: &MpiTransport, rep: &mut Report) -> Result<(), Fatal> {
    let mut t = fh_transport::from_env().map_err(|e| fatal("from_env with FH_TRANSPORT=mpi", e))?;
    rep.check(
        t.backend() == "mpi" && t.topology() == world.topology(),
        || {
            format!(
                "from_env: backend {} topology {:?}, expected mpi {:?}",
                t.backend(),
                t.topology(),
                world.topology()
            )
        },
    );
    let mut comm = t.open("from-env").map_err(|e| fatal("from_env open", e))?;
    let mut v = [1i32; 3];
    comm.allreduce_typed(&mut v, ReduceOp::Sum)
        .map_err(|e| fatal("from_env allreduce", e))?;
    rep.check(v == [world.size() as i32; 3], || {
        format!("from_env allreduce got {v:?}")
    });
    Ok(())
}

/// Run the whole suite on this rank. `Err` is an unexpected transport error: the job should be
/// aborted (other ranks may be blocked in a collective).
pub fn run(world: &mut MpiTransport) -> Result<Report, Fatal> {
    let mut rep = Report::default();
    let mode = match world.thread_mode() {
        ThreadMode::Multiple => "multiple",
        ThreadMode::Serialized => "serialized",
    };
    let mut control = world
        .open("control")
        .map_err(|e| fatal("open control", e))?;
    let mut data = world.open("data-0").map_err(|e| fatal("open data-0", e))?;

    let verbose =
        std::env::var("FH_MPI_SUITE_VERBOSE").is_ok_and(|v| !v.is_empty()) && world.rank() == 0;
    let started = std::time::Instant::now();
    let stage = |name: &str| {
        if verbose {
            eprintln!(
                "mpi_suite: {:>8.3} s  {name}",
                started.elapsed().as_secs_f64()
            );
        }
    };
    check_topology(world, control.as_mut(), &mut rep)?;
    if std::env::var("FH_TRANSPORT").is_ok_and(|v| v.trim() == "mpi") {
        stage("from_env");
        check_from_env(world, &mut rep)?;
    }
    let tag = format!("[{mode}]");
    stage("allreduce");
    check_allreduce(data.as_mut(), &mut rep, &tag, &DTYPES, &OPS, &LENGTHS)?;
    check_allreduce(
        data.as_mut(),
        &mut rep,
        &format!("{tag} large"),
        &[DType::F32, DType::BF16, DType::I8],
        &[ReduceOp::Sum, ReduceOp::Max],
        &[65_537, 1_000_003],
    )?;
    stage("reduce_scatter");
    check_reduce_scatter(data.as_mut(), &mut rep, &tag, &DTYPES, &OPS, true)?;
    stage("allgatherv");
    check_allgatherv(data.as_mut(), &mut rep, &tag, true)?;
    stage("broadcast");
    check_broadcast(data.as_mut(), &mut rep, &tag, true)?;
    stage("alltoallv");
    check_alltoallv(data.as_mut(), &mut rep, &tag, true)?;
    stage("p2p");
    check_p2p(data.as_mut(), &mut rep, &tag, true)?;
    check_invalid_arguments(data.as_mut(), &mut rep, &tag)?;
    stage("extension methods");
    check_ext(control.as_mut(), &mut rep, &tag)?;
    stage("random cases");
    check_random(data.as_mut(), &mut rep, &tag)?;

    // A subset without rank 0 (a process set): collective over the world to open, then only
    // its members talk, numbered 0..n; rank 0 holds its ends idle.
    if world.size() >= 2 {
        stage("subset");
        let members: Vec<usize> = (1..world.size()).collect();
        let labels = ["subset-control".to_string(), "subset-data".to_string()];
        let mut sub = fh_transport::compose::subset::open_subset(world, &members, &labels)
            .map_err(|e| fatal("open subset", e))?;
        rep.check(sub.is_member() == (world.rank() != 0), || {
            "subset membership".to_string()
        });
        if sub.is_member() {
            let mut c = sub.open("subset").map_err(|e| fatal("subset open", e))?;
            let tag = format!("[{mode} subset]");
            rep.check(
                c.size() == members.len() && c.rank() + 1 == world.rank(),
                || format!("{tag}: rank {} of {}", c.rank(), c.size()),
            );
            check_allreduce(
                c.as_mut(),
                &mut rep,
                &tag,
                &[DType::F32, DType::I64],
                &[ReduceOp::Sum, ReduceOp::Max],
                &[0, 1, 33, 10_000],
            )?;
            check_allgatherv(c.as_mut(), &mut rep, &tag, false)?;
            check_broadcast(c.as_mut(), &mut rep, &tag, false)?;
            check_alltoallv(c.as_mut(), &mut rep, &tag, false)?;
            c.barrier().map_err(|e| fatal("subset barrier", e))?;
        }
        drop(sub);
        control
            .barrier()
            .map_err(|e| fatal("barrier after the subset", e))?;
    }

    // Small per-call limits: MPI messages are split, and the v-collectives whose totals exceed
    // the limit go through the generic algorithms over MPI point-to-point.
    stage("chunked");
    let mut chunked: MpiComm = world
        .open_mpi("chunked")
        .map_err(|e| fatal("open chunked", e))?;
    chunked.set_max_count(5);
    let tag = format!("[{mode} chunked]");
    check_allreduce(
        &mut chunked,
        &mut rep,
        &tag,
        &[DType::F32, DType::F16, DType::I64, DType::Bool],
        &[
            ReduceOp::Sum,
            ReduceOp::Average,
            ReduceOp::Max,
            ReduceOp::BitOr,
        ],
        &[0, 1, 5, 7, 31],
    )?;
    check_reduce_scatter(
        &mut chunked,
        &mut rep,
        &tag,
        &[DType::F32, DType::BF16],
        &[ReduceOp::Sum],
        false,
    )?;
    check_allgatherv(&mut chunked, &mut rep, &tag, false)?;
    check_broadcast(&mut chunked, &mut rep, &tag, false)?;
    check_alltoallv(&mut chunked, &mut rep, &tag, false)?;
    check_p2p(&mut chunked, &mut rep, &tag, false)?;
    chunked.set_max_count(3_000);
    check_random(&mut chunked, &mut rep, &format!("[{mode} chunked 3000]"))?;

    stage("concurrent channels");
    check_concurrent_channels(world, &mut rep, &format!("[{mode} concurrent]"))?;
    stage("done");

    // Everybody learns how many checks failed anywhere.
    let mut failed = [rep.failures.len() as i64];
    control
        .allreduce_typed(&mut failed, ReduceOp::Sum)
        .map_err(|e| fatal("final failure count", e))?;
    if failed[0] > 0 && rep.failures.is_empty() {
        rep.failures
            .push(format!("{} check(s) failed on other ranks", failed[0]));
    }
    Ok(rep)
}

/// One line summarising `rep` for this rank.
pub fn summary(world: &MpiTransport, rep: &Report) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        "mpi_suite rank {}/{} ({:?}): {} checks, {} failed",
        world.rank(),
        world.size(),
        world.thread_mode(),
        rep.checks,
        rep.failures.len()
    );
    for f in rep.failures.iter().take(20) {
        let _ = write!(s, "\n  FAILED {f}");
    }
    s
}
