//! What a run records about where and when it ran: revision, host name, UTC time, and the
//! host measurements (copy rates, CPU steal, load).

/// `git describe --always --dirty`, or `unknown`.
pub fn git_revision() -> String {
    std::process::Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

pub(super) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// Seconds since the epoch → `(YYYY, MM, DD, hh, mm, ss)` in UTC.
pub fn civil_utc(secs: u64) -> (i64, u32, u32, u32, u32, u32) {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's days-to-civil algorithm.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (
        y,
        m,
        d,
        (rem / 3600) as u32,
        (rem % 3600 / 60) as u32,
        (rem % 60) as u32,
    )
}

pub(super) fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Now, `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now() -> String {
    let (y, mo, d, h, mi, s) = civil_utc(now_secs());
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
}

/// Now, `YYYYMMDD-HHMMSS` (directory names).
pub fn timestamp() -> String {
    let (y, mo, d, h, mi, s) = civil_utc(now_secs());
    format!("{y:04}{mo:02}{d:02}-{h:02}{mi:02}{s:02}")
}

/// One thread's memory copy rate on this host, GB/s: the best of five 64 MiB copies.
pub fn measure_copy_gbps() -> Option<f64> {
    let n = 64 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = std::time::Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (best > 0.0 && best.is_finite()).then(|| n as f64 / best / 1e9)
}

/// The copy rate each of `threads` threads gets while all copy at once: every thread copies
/// 64 MiB a few times after a common start; GB/s per thread, the median over threads and
/// repeats. `None` for no threads or when a thread cannot be started.
pub fn measure_shared_copy_gbps(threads: usize) -> Option<f64> {
    measure_copies(threads, None)
}

/// As [`measure_shared_copy_gbps`], for the engine's staged pattern: each thread moves 64 MiB
/// through a `stage`-byte buffer, a piece at a time (copied in, then out); GB/s of moved
/// bytes (both passes together) per thread.
pub fn measure_staged_copy_gbps(threads: usize, stage: usize) -> Option<f64> {
    measure_copies(threads, Some(stage.max(1)))
}

fn measure_copies(threads: usize, stage: Option<usize>) -> Option<f64> {
    if threads == 0 {
        return None;
    }
    let n = 64 << 20;
    let start = std::sync::Barrier::new(threads);
    let rates: Vec<f64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let start = &start;
                s.spawn(move || {
                    let src = vec![1u8; n];
                    let mut dst = vec![0u8; n];
                    let mut piece = vec![0u8; stage.unwrap_or(0).min(n)];
                    start.wait();
                    (0..5)
                        .map(|_| {
                            let t = std::time::Instant::now();
                            if piece.is_empty() {
                                dst.copy_from_slice(std::hint::black_box(&src));
                            } else {
                                for (d, s) in
                                    dst.chunks_mut(piece.len()).zip(src.chunks(piece.len()))
                                {
                                    let p = &mut piece[..s.len()];
                                    p.copy_from_slice(std::hint::black_box(s));
                                    d.copy_from_slice(std::hint::black_box(p));
                                }
                            }
                            std::hint::black_box(&mut dst);
                            n as f64 / t.elapsed().as_secs_f64().max(1e-9) / 1e9
                        })
                        .collect::<Vec<f64>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| h.join().ok())
            .flatten()
            .collect()
    });
    if rates.is_empty() {
        return None;
    }
    Some(crate::stats::Quantity::from_samples(&rates, "GB/s").median)
}

/// CPU time counters from `/proc/stat` (all CPUs): (steal, total), in ticks.
pub fn cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal [guest guest_nice: included in user]
    let total: u64 = v.iter().take(8).sum();
    Some((v.get(7).copied().unwrap_or(0), total))
}

/// Steal between two [`cpu_ticks`] samples, % of CPU time.
pub fn steal_between(a: Option<(u64, u64)>, b: Option<(u64, u64)>) -> Option<f64> {
    let ((s0, t0), (s1, t1)) = (a?, b?);
    let dt = t1.checked_sub(t0).filter(|&d| d > 0)?;
    Some(s1.saturating_sub(s0) as f64 * 100.0 / dt as f64)
}

/// The 1-minute load average (`/proc/loadavg`).
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The engine's default stage size (`FH_STAGE_BYTES`), for the staged copy-rate measurement.
pub(crate) fn stage_bytes() -> usize {
    usize::try_from(fh_scheduler::Config::default().stage_bytes).unwrap_or(usize::MAX)
}
