//! The collectives sweep: timing each collective over a range of sizes, and the nccl-tests
//! definitions of algorithm and bus bandwidth.
//!
//! Sizes follow nccl-tests: the *size* of a case is the bytes of the whole buffer a rank holds —
//! the allreduce buffer, the allgather output, the reduce-scatter input, the alltoall send
//! buffer, the broadcast buffer. Algorithm bandwidth = size / time; bus bandwidth = algorithm
//! bandwidth × a factor that makes the figure comparable with the link's peak whatever the
//! collective and the rank count ([`Collective::bus_factor`]).

use std::fmt;
use std::str::FromStr;
use std::time::Instant;

use fh_core::{DType, ReduceOp};
use fh_transport::{CollectivesExt, Communicator};
use serde::{Deserialize, Serialize};

/// A collective operation of the sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Collective {
    /// Sum allreduce of f32.
    Allreduce,
    /// Allgather of equal blocks.
    Allgather,
    /// Broadcast from rank 0.
    Broadcast,
    /// Alltoall of equal blocks.
    Alltoall,
    /// Sum reduce-scatter of f32, equal blocks.
    ReduceScatter,
}

impl Collective {
    /// Every collective, in report order.
    pub const ALL: [Collective; 5] = [
        Collective::Allreduce,
        Collective::Allgather,
        Collective::Broadcast,
        Collective::Alltoall,
        Collective::ReduceScatter,
    ];

    /// Name as in reports and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Collective::Allreduce => "allreduce",
            Collective::Allgather => "allgather",
            Collective::Broadcast => "broadcast",
            Collective::Alltoall => "alltoall",
            Collective::ReduceScatter => "reduce-scatter",
        }
    }

    /// nccl-tests' bus-bandwidth factor for `n` ranks: allreduce 2(n−1)/n; allgather,
    /// reduce-scatter and alltoall (n−1)/n; broadcast 1. For one rank, 0 for all but broadcast
    /// (nothing crosses a link).
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n.max(1) as f64;
        match self {
            Collective::Allreduce => 2.0 * (n - 1.0) / n,
            Collective::Allgather | Collective::ReduceScatter | Collective::Alltoall => {
                (n - 1.0) / n
            }
            Collective::Broadcast => 1.0,
        }
    }

    /// The size in bytes actually used for a requested size on `n` ranks: f32 collectives use
    /// whole elements, blocked ones a multiple of the block count (at least one element per
    /// rank).
    pub fn effective_bytes(self, requested: usize, n: usize) -> usize {
        let n = n.max(1);
        match self {
            Collective::Allreduce => (requested / 4).max(1) * 4,
            Collective::Broadcast => requested.max(1),
            Collective::Allgather | Collective::Alltoall => (requested / n).max(1) * n,
            Collective::ReduceScatter => (requested / (4 * n)).max(1) * 4 * n,
        }
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Collective {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Collective::ALL
            .into_iter()
            .find(|c| c.name() == s || (s == "reducescatter" && *c == Collective::ReduceScatter))
            .ok_or_else(|| {
                format!(
                    "unknown collective '{s}' (use {})",
                    Collective::ALL.map(|c| c.name()).join(", ")
                )
            })
    }
}

/// Algorithm bandwidth in GB/s (10⁹ bytes per second), as nccl-tests: size / time.
pub fn algbw_gbps(bytes: usize, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

/// Bus bandwidth in GB/s: algorithm bandwidth × [`Collective::bus_factor`].
pub fn busbw_gbps(c: Collective, bytes: usize, seconds: f64, n: usize) -> f64 {
    algbw_gbps(bytes, seconds) * c.bus_factor(n)
}

/// One case of the sweep, as sent to every rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Case {
    /// The collective.
    pub collective: Collective,
    /// Requested size in bytes (see [`Collective::effective_bytes`]).
    pub bytes: usize,
}

/// What a rank measured for one case.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CaseTimes {
    /// The case.
    pub case: Case,
    /// The size actually used, in bytes.
    pub bytes: usize,
    /// Seconds of each timed repeat on this rank (barrier, then the collective).
    pub seconds: Vec<f64>,
}

/// Runs the cases on `comm`: for each, `warmup` untimed runs (the first one's result is checked
/// against the expected value), then `repeats` timed runs, each after a barrier.
pub fn run_cases(
    comm: &mut dyn Communicator,
    cases: &[Case],
    warmup: usize,
    repeats: usize,
    mut on_case: impl FnMut(&CaseTimes),
) -> Result<Vec<CaseTimes>, String> {
    let mut out = Vec::with_capacity(cases.len());
    for case in cases {
        let t = run_case(comm, case, warmup, repeats)?;
        on_case(&t);
        out.push(t);
    }
    Ok(out)
}

fn run_case(
    comm: &mut dyn Communicator,
    case: &Case,
    warmup: usize,
    repeats: usize,
) -> Result<CaseTimes, String> {
    let n = comm.size();
    let rank = comm.rank();
    let bytes = case.collective.effective_bytes(case.bytes, n);
    let ctx = |e: fh_transport::TransportError| {
        format!("{} of {bytes} B on rank {rank}: {e}", case.collective)
    };
    // Buffers: f32 ones for the reductions (so the checked result is exact), rank bytes else.
    let ones = |len: usize| -> Vec<u8> {
        [1.0f32]
            .repeat(len / 4)
            .iter()
            .flat_map(|x| x.to_ne_bytes())
            .collect()
    };
    let (mut send, mut recv): (Vec<u8>, Vec<u8>) = match case.collective {
        Collective::Allreduce => (ones(bytes), Vec::new()),
        Collective::Broadcast => (vec![if rank == 0 { 7 } else { 0 }; bytes], Vec::new()),
        Collective::Allgather => (vec![rank as u8; bytes / n], vec![0; bytes]),
        Collective::Alltoall => (vec![rank as u8; bytes], vec![0; bytes]),
        Collective::ReduceScatter => (ones(bytes), vec![0; bytes / n]),
    };
    let counts = vec![bytes / (4 * n); n];
    let once = |comm: &mut dyn Communicator,
                send: &mut Vec<u8>,
                recv: &mut Vec<u8>|
     -> Result<(), String> {
        match case.collective {
            Collective::Allreduce => comm.allreduce(send, DType::F32, ReduceOp::Sum),
            Collective::Broadcast => comm.broadcast(send, 0),
            Collective::Allgather => comm.allgather(send, recv),
            Collective::Alltoall => comm.alltoall(send, recv),
            Collective::ReduceScatter => {
                comm.reduce_scatter(send, recv, &counts, DType::F32, ReduceOp::Sum)
            }
        }
        .map_err(ctx)
    };
    for i in 0..warmup.max(1) {
        once(&mut *comm, &mut send, &mut recv)?;
        if i == 0 {
            check(case.collective, &send, &recv, n, rank).map_err(|e| {
                format!(
                    "{} of {bytes} B on rank {rank}: wrong result: {e}",
                    case.collective
                )
            })?;
        }
    }
    let mut seconds = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        comm.barrier().map_err(ctx)?;
        let t = Instant::now();
        once(&mut *comm, &mut send, &mut recv)?;
        seconds.push(t.elapsed().as_secs_f64());
    }
    Ok(CaseTimes {
        case: case.clone(),
        bytes,
        seconds,
    })
}

/// What a rank measured for `streams` allreduces of the same size running at once, each on its
/// own communicator (as the engine's K data channels do).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamTimes {
    /// Allreduces in flight at once.
    pub streams: usize,
    /// Bytes of each one.
    pub bytes: usize,
    /// Each allreduce ran as the engine runs a staged fused group: through a piece of this
    /// many bytes at a time, packed into it, reduced and unpacked with the average; `None`:
    /// one plain allreduce of the whole buffer.
    #[serde(default)]
    pub stage: Option<usize>,
    /// Seconds of each timed repeat on this rank: from a barrier until the last of the
    /// `streams` allreduces has finished.
    pub seconds: Vec<f64>,
}

/// One allreduce of `buf` (f32) as the engine runs a staged fused group on one host: a
/// `piece`-byte window at a time is packed into `stage`, summed across the ranks and unpacked
/// into `buf` with the average's division (fh-core's `copy_divide_and_scale`, the kernel the
/// engine unpacks with). Every element ends as the average.
pub fn staged_allreduce(
    comm: &mut dyn Communicator,
    buf: &mut [u8],
    stage: &mut [u8],
    piece: usize,
) -> fh_transport::Result<()> {
    if stage.len() < 4 {
        return Err(fh_transport::TransportError::InvalidArgument(format!(
            "a staged allreduce needs a stage buffer of at least one f32; it has {} bytes",
            stage.len()
        )));
    }
    let piece = piece.clamp(4, stage.len()) / 4 * 4;
    let n = comm.size();
    for window in buf.chunks_mut(piece) {
        let st = &mut stage[..window.len()];
        st.copy_from_slice(window);
        comm.allreduce(st, DType::F32, ReduceOp::Sum)?;
        fh_core::kernels::copy_divide_and_scale(DType::F32, st, window, n, 1.0)
            .map_err(|e| fh_transport::TransportError::InvalidArgument(e.to_string()))?;
    }
    Ok(())
}

/// Runs `streams[i]` f32 sum allreduces of `bytes` at once, one thread each on its own
/// communicator of `comms` (at least the largest count): `warmup` untimed runs per count
/// (the first one's results checked), then `repeats` timed runs of every count, interleaved.
/// With `stage`, each one is an average run as a staged fused group ([`staged_allreduce`]).
pub fn run_streams(
    comms: &mut [Box<dyn Communicator>],
    bytes: usize,
    streams: &[usize],
    stage: Option<usize>,
    warmup: usize,
    repeats: usize,
) -> Result<Vec<StreamTimes>, String> {
    let most = streams.iter().copied().max().unwrap_or(0);
    if most == 0 || comms.len() < most {
        return Err(format!(
            "{most} concurrent allreduces need as many communicators; {} were opened",
            comms.len()
        ));
    }
    let n = comms[0].size();
    let rank = comms[0].rank();
    let len = (bytes / 4).max(1);
    let mut bufs: Vec<Vec<u8>> = (0..most).map(|_| Vec::new()).collect();
    let mut stages: Vec<Vec<u8>> = (0..most)
        .map(|_| vec![0u8; stage.map_or(0, |p| p.clamp(4, len * 4))])
        .collect();
    // Each buffer starts as ones (outside the timed part); staged, as rank + 1, so that the
    // average, (n + 1) / 2, differs from what a rank started with unless every piece came back.
    let start = match stage {
        Some(_) => (rank + 1) as f32,
        None => 1.0,
    };
    let fill = |bufs: &mut [Vec<u8>], k: usize| {
        for b in bufs.iter_mut().take(k) {
            b.clear();
            b.extend((0..len).flat_map(|_| start.to_ne_bytes()));
        }
    };
    // One run of `k` allreduces at once.
    let once = |comms: &mut [Box<dyn Communicator>],
                bufs: &mut [Vec<u8>],
                stages: &mut [Vec<u8>],
                k: usize| {
        std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .iter_mut()
                .zip(bufs.iter_mut())
                .zip(stages.iter_mut())
                .take(k)
                .map(|((c, b), st)| {
                    s.spawn(move || match stage {
                        Some(piece) => staged_allreduce(c.as_mut(), b, st, piece),
                        None => c.allreduce(b, DType::F32, ReduceOp::Sum),
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .try_for_each(|(i, h)| match h.join() {
                    Ok(r) => r.map_err(|e| {
                        format!("allreduce {i} of {k} concurrent ones on rank {rank}: {e}")
                    }),
                    Err(_) => Err(format!(
                        "allreduce {i} of {k} concurrent ones on rank {rank} panicked"
                    )),
                })
        })
    };
    let counts: Vec<usize> = streams.iter().copied().filter(|&k| k > 0).collect();
    for &k in &counts {
        for i in 0..warmup.max(1) {
            fill(&mut bufs, k);
            once(comms, &mut bufs, &mut stages, k)?;
            if i == 0 {
                for b in bufs.iter().take(k) {
                    let checked = match stage {
                        Some(_) => check_average(b, (n + 1) as f32 / 2.0),
                        None => check(Collective::Allreduce, b, &[], n, rank),
                    };
                    checked.map_err(|e| {
                        format!("{k} concurrent allreduces on rank {rank}: wrong result: {e}")
                    })?;
                }
            }
        }
    }
    // The counts interleaved, round-robin over the repeats: a slow spell of a shared host
    // hits every count, not the one measured during it.
    let mut out: Vec<StreamTimes> = counts
        .iter()
        .map(|&k| StreamTimes {
            streams: k,
            bytes: len * 4,
            stage,
            seconds: Vec::with_capacity(repeats),
        })
        .collect();
    for _ in 0..repeats {
        for st in out.iter_mut() {
            let k = st.streams;
            fill(&mut bufs, k);
            comms[0]
                .barrier()
                .map_err(|e| format!("barrier on rank {rank}: {e}"))?;
            let t = Instant::now();
            once(comms, &mut bufs, &mut stages, k)?;
            st.seconds.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(out)
}

fn f32_at(buf: &[u8], i: usize) -> f32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&buf[i * 4..i * 4 + 4]);
    f32::from_ne_bytes(b)
}

/// Checks that every element of `buf` (f32) is `want`.
fn check_average(buf: &[u8], want: f32) -> Result<(), String> {
    match (0..buf.len() / 4).find(|&i| f32_at(buf, i) != want) {
        Some(i) => Err(format!(
            "element {i} is {} instead of {want}",
            f32_at(buf, i)
        )),
        None => Ok(()),
    }
}

/// Checks the result of the first run of a case (first and last elements).
fn check(c: Collective, send: &[u8], recv: &[u8], n: usize, _rank: usize) -> Result<(), String> {
    let want_n = n as f32;
    match c {
        Collective::Allreduce => {
            let last = send.len() / 4 - 1;
            for i in [0, last] {
                if f32_at(send, i) != want_n {
                    return Err(format!(
                        "element {i} is {} instead of {want_n}",
                        f32_at(send, i)
                    ));
                }
            }
        }
        Collective::ReduceScatter => {
            if !recv.is_empty() {
                let last = recv.len() / 4 - 1;
                for i in [0, last] {
                    if f32_at(recv, i) != want_n {
                        return Err(format!(
                            "element {i} is {} instead of {want_n}",
                            f32_at(recv, i)
                        ));
                    }
                }
            }
        }
        Collective::Broadcast => {
            if send.first() != Some(&7) || send.last() != Some(&7) {
                return Err("the buffer does not hold the root's bytes".into());
            }
        }
        Collective::Allgather | Collective::Alltoall => {
            let block = recv.len() / n;
            for r in 0..n {
                if block > 0
                    && (recv[r * block] != r as u8 || recv[r * block + block - 1] != r as u8)
                {
                    return Err(format!("block {r} does not hold rank {r}'s bytes"));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_factors_follow_nccl_tests() {
        assert_eq!(Collective::Allreduce.bus_factor(4), 1.5);
        assert_eq!(Collective::Allreduce.bus_factor(2), 1.0);
        assert_eq!(Collective::Allgather.bus_factor(4), 0.75);
        assert_eq!(Collective::ReduceScatter.bus_factor(8), 0.875);
        assert_eq!(Collective::Alltoall.bus_factor(2), 0.5);
        assert_eq!(Collective::Broadcast.bus_factor(16), 1.0);
        assert_eq!(Collective::Allreduce.bus_factor(1), 0.0);
    }

    #[test]
    fn bandwidths_by_hand() {
        // 64 MiB in 50 ms: 1.342 GB/s algorithm bandwidth; ×1.5 on 4 ranks for allreduce.
        let b = 64 << 20;
        assert!((algbw_gbps(b, 0.05) - 1.34217728).abs() < 1e-9);
        assert!((busbw_gbps(Collective::Allreduce, b, 0.05, 4) - 2.01326592).abs() < 1e-9);
        assert!((busbw_gbps(Collective::Allgather, b, 0.05, 4) - 1.00663296).abs() < 1e-9);
        assert_eq!(
            busbw_gbps(Collective::Broadcast, 1_000_000_000, 2.0, 3),
            0.5
        );
    }

    #[test]
    fn effective_sizes() {
        assert_eq!(Collective::Allreduce.effective_bytes(8, 4), 8);
        assert_eq!(Collective::Allreduce.effective_bytes(2, 4), 4);
        assert_eq!(Collective::Allgather.effective_bytes(10, 4), 8);
        assert_eq!(Collective::Alltoall.effective_bytes(2, 4), 4);
        assert_eq!(Collective::ReduceScatter.effective_bytes(8, 4), 16);
        assert_eq!(
            Collective::ReduceScatter.effective_bytes(1 << 20, 4),
            1 << 20
        );
        assert_eq!(
            "reduce-scatter".parse::<Collective>(),
            Ok(Collective::ReduceScatter)
        );
        assert!("gather"
            .parse::<Collective>()
            .unwrap_err()
            .contains("allgather"));
    }

    #[test]
    fn concurrent_allreduces_run_and_check_on_the_local_backend() {
        use fh_transport::{backend::local::LocalWorld, Transport};
        let handles: Vec<_> = LocalWorld::new(3)
            .into_iter()
            .map(|mut t| {
                std::thread::spawn(move || {
                    let mut comms: Vec<_> =
                        (0..3).map(|i| t.open(&format!("s{i}")).unwrap()).collect();
                    // Too few communicators for four at once: an error, not a hang.
                    let err = run_streams(&mut comms, 4000, &[4], None, 1, 1).unwrap_err();
                    assert!(err.contains("4 concurrent allreduces"), "{err}");
                    let plain = run_streams(&mut comms, 4000, &[1, 3], None, 1, 2).unwrap();
                    // Staged through 1 KiB pieces: 4000 bytes in four pieces, the last short;
                    // the first run's average is checked inside.
                    let staged = run_streams(&mut comms, 4000, &[1, 3], Some(1024), 1, 2).unwrap();
                    (plain, staged)
                })
            })
            .collect();
        for h in handles {
            let (plain, staged) = h.join().unwrap();
            for (out, stage) in [(plain, None), (staged, Some(1024))] {
                assert_eq!(out.len(), 2);
                assert_eq!((out[0].streams, out[1].streams), (1, 3));
                assert!(out
                    .iter()
                    .all(|s| s.seconds.len() == 2 && s.bytes == 4000 && s.stage == stage));
            }
        }
    }

    #[test]
    fn a_staged_allreduce_without_room_for_one_element_is_an_error() {
        use fh_transport::{backend::local::LocalWorld, Transport};
        let mut t = LocalWorld::new(1).pop().unwrap();
        let mut comm = t.open("staged").unwrap();
        let mut buf = 2.0f32.to_ne_bytes().repeat(3);
        let err = staged_allreduce(comm.as_mut(), &mut buf, &mut [0u8; 3], 1 << 20).unwrap_err();
        assert!(err.to_string().contains("3 bytes"), "{err}");
        // One rank: the average is the value itself, piece by piece.
        staged_allreduce(comm.as_mut(), &mut buf, &mut [0u8; 4], 1 << 20).unwrap();
        assert_eq!(buf, 2.0f32.to_ne_bytes().repeat(3));
    }

    #[test]
    fn every_collective_runs_and_checks_on_the_local_backend() {
        use fh_transport::{backend::local::LocalWorld, Transport};
        let cases: Vec<Case> = Collective::ALL
            .iter()
            .flat_map(|&c| {
                [8, 1000].map(|bytes| Case {
                    collective: c,
                    bytes,
                })
            })
            .collect();
        let handles: Vec<_> = LocalWorld::new(3)
            .into_iter()
            .map(|mut t| {
                let cases = cases.clone();
                std::thread::spawn(move || {
                    let mut comm = t.open("bench").unwrap();
                    run_cases(comm.as_mut(), &cases, 1, 2, |_| {}).unwrap()
                })
            })
            .collect();
        for h in handles {
            let res = h.join().unwrap();
            assert_eq!(res.len(), 10);
            assert!(res.iter().all(|r| r.seconds.len() == 2));
            assert_eq!(res[1].bytes, 1000);
            assert_eq!(res[9].bytes, 996); // 1000 B → 83 f32 per rank on 3 ranks
        }
    }
}
