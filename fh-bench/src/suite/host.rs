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

/// One thread's copy rate on this host, GB/s per pass: the engine's packing and unpacking of
/// fused groups ([`fusion_round_trip`] through a 64 MiB fusion buffer), alone on the host; the
/// best of four passes over two buffers' worth of gradients.
pub fn measure_copy_gbps() -> Option<f64> {
    let rates = copy_rates(1, FUSION_BUFFER);
    let best = rates.into_iter().fold(0.0f64, f64::max);
    (best > 0.0 && best.is_finite()).then_some(2.0 * best)
}

/// The copy rate each of `threads` threads gets while all pack and unpack fused groups at once,
/// as the engine does ([`fusion_round_trip`] with a 64 MiB fusion buffer): GB/s per pass (bytes
/// moved ÷ time, counting packing and unpacking as one pass each) per thread, the median over
/// threads and repeats. `None` for no threads or when a thread cannot be started.
pub fn measure_shared_copy_gbps(threads: usize) -> Option<f64> {
    median(copy_rates(threads, FUSION_BUFFER)).map(|r| 2.0 * r)
}

/// As [`measure_shared_copy_gbps`], for the engine's staged pattern: the groups go through a
/// `stage`-byte piece of the fusion buffer, packed and unpacked a piece at a time; GB/s of
/// moved bytes (both passes together) per thread.
pub fn measure_staged_copy_gbps(threads: usize, stage: usize) -> Option<f64> {
    median(copy_rates(threads, stage.max(1)))
}

/// The fusion buffer of the copy-rate measurements (the `fasthorovod` preset's fusion
/// threshold).
const FUSION_BUFFER: usize = 64 << 20;

/// Gradient sizes the copy-rate measurements cycle through: a BERT-base attention matrix, a
/// feed-forward matrix and a bias (f32), so that copies run at the sizes the engine packs,
/// not as one long copy (which the C library moves differently).
const TENSOR_SIZES: [usize; 3] = [768 * 768 * 4, 768 * 3072 * 4, 768 * 4];

/// Tensors of [`TENSOR_SIZES`] (cycled) holding at least `total` bytes of f32 ones.
fn gradient_set(total: usize) -> Vec<Vec<u8>> {
    let mut v = Vec::new();
    let mut held = 0;
    for &n in TENSOR_SIZES.iter().cycle() {
        if held >= total {
            break;
        }
        v.push(1.0f32.to_ne_bytes().repeat(n / 4));
        held += n;
    }
    v
}

/// One pass of the engine's copies over `tensors`: their bytes, in order, go through `piece`
/// bytes of `buf` at a time: packed (plain copies, as the engine packs a fused group) and
/// unpacked into the tensors with the average over 4 ranks applied (fh-core's
/// `copy_divide_and_scale`, the kernel the engine unpacks with). Returns the bytes moved
/// (each byte packed once and unpacked once).
pub(crate) fn fusion_round_trip(tensors: &mut [Vec<u8>], buf: &mut [u8], piece: usize) -> usize {
    let piece = piece.clamp(4, buf.len()) / 4 * 4;
    let buf = &mut buf[..piece];
    let total: usize = tensors.iter().map(Vec::len).sum();
    let mut at = 0;
    while at < total {
        let end = (at + piece).min(total);
        // The tensors' byte ranges that [at, end) covers: (tensor, from, to, offset in buf).
        let mut parts = Vec::new();
        let mut base = 0;
        for (i, t) in tensors.iter().enumerate() {
            let (lo, hi) = (at.max(base), end.min(base + t.len()));
            if lo < hi {
                parts.push((i, lo - base, hi - base, lo - at));
            }
            base += t.len();
            if base >= end {
                break;
            }
        }
        for &(i, from, to, off) in &parts {
            buf[off..off + to - from].copy_from_slice(std::hint::black_box(&tensors[i][from..to]));
        }
        for &(i, from, to, off) in &parts {
            let _ = fh_core::kernels::copy_divide_and_scale(
                fh_core::DType::F32,
                &buf[off..off + to - from],
                &mut tensors[i][from..to],
                4,
                4.0,
            );
        }
        std::hint::black_box(&mut tensors[0]);
        at = end;
    }
    total
}

/// The median of `rates`; `None` when there are none.
fn median(rates: Vec<f64>) -> Option<f64> {
    (!rates.is_empty()).then(|| crate::stats::Quantity::from_samples(&rates, "GB/s").median)
}

/// `threads` threads at once, each running [`fusion_round_trip`] over two fusion buffers' worth
/// of gradients through `piece` bytes four times after a common start (and once before it, to
/// touch the memory); GB/s of moved bytes of every thread and pass. Empty for no threads or
/// when no thread could be started.
fn copy_rates(threads: usize, piece: usize) -> Vec<f64> {
    let start = std::sync::Barrier::new(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let start = &start;
                s.spawn(move || {
                    let mut tensors = gradient_set(2 * FUSION_BUFFER);
                    let mut buf = vec![0u8; FUSION_BUFFER];
                    fusion_round_trip(&mut tensors, &mut buf, piece);
                    start.wait();
                    (0..4)
                        .map(|_| {
                            let t = std::time::Instant::now();
                            let n = fusion_round_trip(&mut tensors, &mut buf, piece);
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
    })
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
