//! Device-side timings of the GPU path (feature `cuda`), measured with CUDA events on the
//! channel stream: the device's own copy bandwidth (a plain device-to-device copy), fusion
//! buffer copy-in (pack) and copy-out (unpack) of many tensors, the scaling kernel, and NCCL
//! allreduce at world size 1, as bandwidth and as a share of the device copy bandwidth.
//!
//! `cargo run --release -p fh-transport --features cuda --example cuda_fusion_bw -- [MiB] [tensors]`
//! (default 256 MiB in 64 tensors). Prints `skipped: ...` and exits 0 without a GPU.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, DevicePtr};
use fh_core::{DType, ReduceOp};
use fh_transport::backend::cuda::{
    self, CudaStream, CudaWorld, DeviceBytes, DeviceBytesMut, Staging,
};
use fh_transport::backend::local::LocalWorld;
use fh_transport::{Topology, Transport};

const REPS: usize = 10;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(256);
    let tensors: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(64);
    let p = cuda::probe();
    if !p.driver || p.devices == 0 {
        println!("skipped: no CUDA driver or no GPU on this machine ({p:?})");
        return Ok(());
    }
    let staging = if p.nccl.is_ok() {
        Staging::Auto
    } else {
        println!(
            "NCCL not found ({:?}); measuring copies and kernels only",
            p.nccl
        );
        Staging::Always
    };
    let mut host = LocalWorld::new(1).into_iter().next().ok_or("no rank")?;
    let ctl = host.open("control")?;
    let mut world = CudaWorld::new(Topology::single_host(0, 1), staging)?;
    let ctx = world.context().clone();
    println!(
        "device 0: {} ({} MiB), NCCL {:?}, mode {}",
        ctx.name()?,
        ctx.total_mem()? >> 20,
        p.nccl,
        world.mode()
    );
    let mut ch = world.open(ctl, "bench")?;
    let s = ch.stream().clone();

    let bytes = mib << 20;
    // Tensor sizes: uneven (1..=2 parts), 4-byte aligned, summing to `bytes`.
    let mut sizes: Vec<usize> = (0..tensors).map(|i| 2 + i % 3).collect();
    let parts: usize = sizes.iter().sum();
    for sz in &mut sizes {
        *sz = bytes / parts * *sz / 4 * 4;
    }
    let used: usize = sizes.iter().sum();
    if let Some(last) = sizes.last_mut() {
        *last += bytes - used;
    }
    let bufs: Vec<CudaSlice<u8>> = sizes
        .iter()
        .map(|&n| s.alloc_zeros::<u8>(n))
        .collect::<Result<_, _>>()?;
    let ptr = |b: &CudaSlice<u8>| b.device_ptr(&s).0;

    // Device copy bandwidth: one device-to-device copy of `bytes`.
    let a = s.alloc_zeros::<u8>(bytes)?;
    let b = s.alloc_zeros::<u8>(bytes)?;
    let copy = time(&s, || {
        // SAFETY: both buffers live until the stream is synchronized in `time`.
        let (dst, src) = unsafe {
            (
                DeviceBytesMut::from_raw(ptr(&b), bytes),
                DeviceBytes::from_raw(ptr(&a), bytes),
            )
        };
        ch.copy(dst, src).map_err(Into::into)
    })?;
    let views = || -> Vec<DeviceBytes<'static>> {
        // SAFETY: as above.
        bufs.iter()
            .map(|x| unsafe { DeviceBytes::from_raw(ptr(x), x.len()) })
            .collect()
    };
    let views_mut = || -> Vec<DeviceBytesMut<'static>> {
        // SAFETY: as above.
        bufs.iter()
            .map(|x| unsafe { DeviceBytesMut::from_raw(ptr(x), x.len()) })
            .collect()
    };
    ch.pack(&views())?; // grow the fusion buffer outside the timing
    let pack = time(&s, || ch.pack(&views()).map(|_| ()).map_err(Into::into))?;
    let unpack = time(&s, || ch.unpack(&mut views_mut()).map_err(Into::into))?;
    let scale = time(&s, || {
        // SAFETY: as above.
        let v = unsafe { DeviceBytesMut::from_raw(ptr(&a), bytes) };
        ch.scale(v, DType::F32, 0.5).map_err(Into::into)
    })?;
    let mut rows = vec![
        ("device copy (d2d)", copy, 2.0),
        ("fusion copy-in (pack)", pack, 2.0),
        ("fusion copy-out (unpack)", unpack, 2.0),
        ("scale kernel f32", scale, 2.0),
    ];
    if ch.mode() == cuda::DeviceMode::Nccl {
        let ar = time(&s, || {
            // SAFETY: as above.
            let v = unsafe { DeviceBytesMut::from_raw(ptr(&a), bytes) };
            ch.comm()
                .allreduce(v, DType::F32, ReduceOp::Sum)
                .map_err(Into::into)
        })?;
        rows.push(("NCCL allreduce, 1 rank", ar, 2.0));
        let fused = time(&s, || {
            ch.allreduce_fused(&mut views_mut(), DType::F32, ReduceOp::Average, 1.0, 0.5)
                .map_err(Into::into)
        })?;
        rows.push(("fused allreduce (pack+reduce+scale+unpack)", fused, 2.0));
    }
    println!(
        "\n{mib} MiB in {tensors} tensors, median of {REPS} runs, bandwidth = (read + write) / time"
    );
    println!(
        "{:<44} {:>10} {:>10} {:>12}",
        "operation", "ms", "GB/s", "vs d2d copy"
    );
    let copy_bw = 2.0 * bytes as f64 / (copy * 1e-3) / 1e9;
    for (name, ms, factor) in rows {
        let bw = factor * bytes as f64 / (ms * 1e-3) / 1e9;
        println!(
            "{name:<44} {ms:>10.3} {bw:>10.1} {:>11.0}%",
            100.0 * bw / copy_bw
        );
    }
    Ok(())
}

/// Median over [`REPS`] runs of `f`, timed with events on `s`, in milliseconds.
fn time(
    s: &Arc<CudaStream>,
    mut f: impl FnMut() -> Result<(), Box<dyn std::error::Error>>,
) -> Result<f64, Box<dyn std::error::Error>> {
    f()?; // warm-up
    let mut ms = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        let start = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        f()?;
        let end = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        end.synchronize()?;
        ms.push(f64::from(start.elapsed_ms(&end)?));
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[REPS / 2])
}
