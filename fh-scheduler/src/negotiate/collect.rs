//! Variable-length byte lists between ranks, over the control communicator.

use fh_transport::{CollectivesExt, Communicator};

use crate::SchedulerError;

/// Most bytes a control-plane message may announce (a sanity bound on lengths from peers).
pub(crate) const MAX_CONTROL_BYTES: usize = 1 << 30;

/// The sum of message lengths announced by peers, refused when absurd.
pub(crate) fn checked_total(counts: &[usize]) -> Result<usize, SchedulerError> {
    counts
        .iter()
        .try_fold(0usize, |a, &c| a.checked_add(c))
        .filter(|&t| t <= MAX_CONTROL_BYTES)
        .ok_or_else(|| SchedulerError::Transport {
            lost_rank: None,
            message: format!("a peer announced control messages of {counts:?} bytes; refusing"),
            source: None,
        })
}

fn len_of(b: [u8; 8]) -> usize {
    usize::try_from(u64::from_le_bytes(b)).unwrap_or(usize::MAX)
}

/// Every rank's `mine`, in rank order (an allgather of lengths, then of the bytes).
pub(crate) fn allgather_blobs(
    comm: &mut dyn Communicator,
    mine: &[u8],
) -> Result<Vec<Vec<u8>>, SchedulerError> {
    let size = comm.size();
    let mut lens = vec![0u8; 8 * size];
    comm.allgather(&(mine.len() as u64).to_le_bytes(), &mut lens)?;
    let counts: Vec<usize> = lens
        .chunks_exact(8)
        .map(|c| {
            let mut a = [0u8; 8];
            a.copy_from_slice(c);
            len_of(a)
        })
        .collect();
    let mut all = vec![0u8; checked_total(&counts)?];
    comm.allgatherv(mine, &mut all, &counts)?;
    let mut out = Vec::with_capacity(size);
    let mut off = 0;
    for n in counts {
        out.push(all[off..off + n].to_vec());
        off += n;
    }
    Ok(out)
}

/// Gather every rank's `mine` to rank 0: rank 0 gets them in rank order, the others `None`.
/// Each rank sends a length and then (when not empty) its bytes, point to point: O(N) bytes
/// in all, where an allgather would move O(N²).
pub(crate) fn gather_to_root(
    comm: &mut dyn Communicator,
    mine: &[u8],
) -> Result<Option<Vec<Vec<u8>>>, SchedulerError> {
    if comm.rank() != 0 {
        comm.send(0, &(mine.len() as u64).to_le_bytes())?;
        if !mine.is_empty() {
            comm.send(0, mine)?;
        }
        return Ok(None);
    }
    let size = comm.size();
    let mut lists = Vec::with_capacity(size);
    lists.push(mine.to_vec());
    let mut total = mine.len();
    for r in 1..size {
        let mut len = [0u8; 8];
        comm.recv(r, &mut len)?;
        let n = len_of(len);
        total = checked_total(&[total, n])?;
        let mut b = vec![0u8; n];
        if n > 0 {
            comm.recv(r, &mut b)?;
        }
        lists.push(b);
    }
    Ok(Some(lists))
}

/// Broadcast rank 0's `bytes` (of a length only rank 0 knows) to every rank.
pub(crate) fn broadcast_blob(
    comm: &mut dyn Communicator,
    mut bytes: Vec<u8>,
) -> Result<Vec<u8>, SchedulerError> {
    let mut len = (bytes.len() as u64).to_le_bytes();
    comm.broadcast(&mut len, 0)?;
    let n = checked_total(&[len_of(len)])?;
    bytes.resize(n, 0);
    if n > 0 {
        comm.broadcast(&mut bytes, 0)?;
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fh_transport::local::LocalWorld;
    use fh_transport::Transport;

    fn on_ranks<T: Send + 'static>(
        n: usize,
        f: impl Fn(&mut dyn Communicator) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<T> {
        let threads: Vec<_> = LocalWorld::with_timeout(n, std::time::Duration::from_secs(10))
            .into_iter()
            .map(|mut t| {
                let f = f.clone();
                std::thread::spawn(move || {
                    let mut c = t.open("test").unwrap();
                    f(c.as_mut())
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    #[test]
    fn gather_allgather_and_broadcast_blobs() {
        for n in [1, 2, 5] {
            let out = on_ranks(n, |c| {
                let mine = vec![c.rank() as u8; c.rank()];
                let g = gather_to_root(c, &mine).unwrap();
                let a = allgather_blobs(c, &mine).unwrap();
                let root = if c.rank() == 0 { vec![7; 3] } else { vec![] };
                let b = broadcast_blob(c, root).unwrap();
                (g, a, b)
            });
            let want: Vec<Vec<u8>> = (0..n).map(|r| vec![r as u8; r]).collect();
            for (r, (g, a, b)) in out.into_iter().enumerate() {
                assert_eq!(g, (r == 0).then(|| want.clone()));
                assert_eq!(a, want);
                assert_eq!(b, [7, 7, 7]);
            }
        }
    }

    #[test]
    fn absurd_lengths_are_refused_before_allocating() {
        assert!(checked_total(&[1, 2]).is_ok());
        assert!(checked_total(&[usize::MAX, 1]).is_err());
        assert!(checked_total(&[MAX_CONTROL_BYTES, 1]).is_err());
        // A peer announcing an absurd length: rank 0 refuses it.
        let out = on_ranks(2, |c| {
            if c.rank() == 1 {
                c.send(0, &u64::MAX.to_le_bytes()).unwrap();
                None
            } else {
                Some(gather_to_root(c, &[]).unwrap_err().to_string())
            }
        });
        assert!(out[0].as_ref().unwrap().contains("refusing"), "{out:?}");
    }
}
