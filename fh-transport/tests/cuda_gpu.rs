//! GPU tests of the `cuda` feature: NCCL at world size 1, device fusion and scaling kernels,
//! event readiness, and the host-staged path with 2 processes on one GPU (plus NCCL across 2
//! processes when 2 GPUs are visible). Every test prints `skipped: ...` and returns when this
//! machine has no CUDA driver, no GPU, or (for NCCL) no libnccl.so.2.
//!
//! Run: `cargo test -p fh-transport --features cuda --test cuda_gpu -- --nocapture`
//! (`scripts/gpu-check.sh` does it on a GPU machine).

mod support;

use std::sync::Arc;
use std::time::Duration;

use fh_core::{kernels, DType, ReduceOp};
use fh_transport::backend::cuda::{
    self, CudaStream, CudaWorld, DeviceBytes, DeviceBytesMut, DeviceChannel, DeviceMode, Staging,
};
use fh_transport::backend::local::LocalWorld;
use fh_transport::{Topology, Transport};
use support::{free_port, launcher_env, rank_command, Children, Place};

const CHILD: &str = "FH_TEST_GPU_CHILD";
const EXPECT_MODE: &str = "FH_TEST_GPU_EXPECT_MODE";
const TIMEOUT: Duration = Duration::from_secs(60);

/// `None` (after printing why) when this machine cannot run GPU tests.
fn gpu(need_nccl: bool) -> Option<cuda::Probe> {
    let p = cuda::probe();
    if !p.driver {
        eprintln!("skipped: no CUDA driver (libcuda.so.1) on this machine");
        return None;
    }
    if p.devices == 0 {
        eprintln!("skipped: the CUDA driver sees no GPU");
        return None;
    }
    if need_nccl {
        if let Err(e) = &p.nccl {
            eprintln!("skipped: no NCCL: {e}");
            return None;
        }
    }
    Some(p)
}

/// A world-size-1 channel over the in-process host transport.
fn channel(staging: Staging) -> DeviceChannel {
    let mut host = LocalWorld::new(1).into_iter().next().expect("one rank");
    let ctl = host.open("control").expect("host communicator");
    let mut world = CudaWorld::new(Topology::single_host(0, 1), staging).expect("cuda world");
    world.open(ctl, "gpu-test").expect("device channel")
}

/// A device byte buffer of the tests: `len` bytes (the allocation has at least 1, since the
/// driver refuses empty allocations).
struct Buf {
    slice: cudarc::driver::CudaSlice<u8>,
    len: usize,
}

fn upload(stream: &Arc<CudaStream>, bytes: &[u8]) -> Buf {
    let slice = if bytes.is_empty() {
        stream.clone_htod(&[0u8]).expect("htod")
    } else {
        stream.clone_htod(bytes).expect("htod")
    };
    Buf {
        slice,
        len: bytes.len(),
    }
}

fn download(stream: &Arc<CudaStream>, b: &Buf) -> Vec<u8> {
    let mut v = stream.clone_dtoh(&b.slice).expect("dtoh");
    v.truncate(b.len);
    v
}

fn view(stream: &Arc<CudaStream>, b: &Buf) -> DeviceBytes<'static> {
    // SAFETY: the tests keep every buffer alive until the stream has been synchronized.
    unsafe { DeviceBytes::from_raw(dev_ptr(stream, b), b.len) }
}

fn view_mut(stream: &Arc<CudaStream>, b: &Buf) -> DeviceBytesMut<'static> {
    // SAFETY: as in `view`; no other access while the operation runs.
    unsafe { DeviceBytesMut::from_raw(dev_ptr(stream, b), b.len) }
}

fn dev_ptr(stream: &Arc<CudaStream>, b: &Buf) -> u64 {
    use cudarc::driver::DevicePtr;
    b.slice.device_ptr(stream).0
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn sample(dtype: DType, n: usize, seed: u32) -> Vec<u8> {
    let vals: Vec<f64> = (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2001) as f64 / 7.0 - 140.0
        })
        .collect();
    match dtype {
        DType::F32 => f32_bytes(&vals.iter().map(|&v| v as f32).collect::<Vec<_>>()),
        DType::F64 => bytemuck::cast_slice(&vals).to_vec(),
        DType::F16 => vals
            .iter()
            .flat_map(|&v| half::f16::from_f64(v).to_ne_bytes())
            .collect(),
        DType::BF16 => vals
            .iter()
            .flat_map(|&v| half::bf16::from_f64(v).to_ne_bytes())
            .collect(),
        other => panic!("no sample for {other:?}"),
    }
}

#[test]
fn nccl_world_size_one_collectives() {
    if gpu(true).is_none() {
        return;
    }
    let mut ch = channel(Staging::Auto);
    assert_eq!(ch.mode(), DeviceMode::Nccl);
    let s = ch.stream().clone();
    let data: Vec<f32> = (0..1027).map(|i| i as f32 * 0.5 - 3.0).collect();
    let buf = upload(&s, &f32_bytes(&data));
    ch.comm()
        .allreduce(view_mut(&s, &buf), DType::F32, ReduceOp::Sum)
        .unwrap();
    ch.comm()
        .allreduce(view_mut(&s, &buf), DType::F32, ReduceOp::Average)
        .unwrap();
    ch.comm().broadcast(view_mut(&s, &buf), 0).unwrap();
    assert_eq!(download(&s, &buf), f32_bytes(&data));

    let out = upload(&s, &vec![0u8; 4 * data.len()]);
    ch.comm()
        .allgather(view(&s, &buf), view_mut(&s, &out))
        .unwrap();
    assert_eq!(download(&s, &out), f32_bytes(&data));
    let rs = upload(&s, &vec![0u8; 4 * data.len()]);
    ch.comm()
        .reduce_scatter(view(&s, &buf), view_mut(&s, &rs), DType::F32, ReduceOp::Max)
        .unwrap();
    assert_eq!(download(&s, &rs), f32_bytes(&data));
    let a2a = upload(&s, &vec![0u8; 4 * data.len()]);
    let n = 4 * data.len();
    ch.comm()
        .alltoallv(view(&s, &buf), &[n], view_mut(&s, &a2a), &[n])
        .unwrap();
    assert_eq!(download(&s, &a2a), f32_bytes(&data));
    // Argument errors are errors, not crashes.
    assert!(ch.comm().broadcast(view_mut(&s, &buf), 1).is_err());
    assert!(ch
        .comm()
        .allreduce(view_mut(&s, &buf), DType::I32, ReduceOp::BitAnd)
        .is_err());
    eprintln!("NCCL world size 1: allreduce, broadcast, allgather, reduce_scatter, alltoallv ok");
}

#[test]
fn scaling_kernels_match_the_host_kernels() {
    if gpu(false).is_none() {
        return;
    }
    let mut ch = channel(Staging::Always);
    let s = ch.stream().clone();
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for (n, factor) in [(1usize, 0.5), (1000, 0.37), (300_001, 3.0), (77, 1e-3)] {
            let mut host = sample(dtype, n, 11);
            let dev = upload(&s, &host);
            ch.scale(view_mut(&s, &dev), dtype, factor).unwrap();
            kernels::scale(dtype, &mut host, factor).unwrap();
            assert!(
                download(&s, &dev) == host,
                "device scaling of {n} {dtype:?} by {factor} differs from fh_core::kernels::scale"
            );
        }
    }
    let ints = upload(&s, &[0u8; 16]);
    assert!(ch.scale(view_mut(&s, &ints), DType::I32, 2.0).is_err());
    eprintln!("scaling kernels (f16, bf16, f32, f64) match the host kernels bit for bit");
}

#[test]
fn fusion_pack_unpack_and_fused_allreduce() {
    if gpu(false).is_none() {
        return;
    }
    // Host-staged at world size 1 needs no NCCL; the fusion logic is the same for both modes.
    let mut ch = channel(Staging::Always);
    let s = ch.stream().clone();
    let sizes = [12usize, 0, 4000, 4];
    let inputs: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &b)| sample(DType::F32, b / 4, i as u32))
        .collect();
    let bufs: Vec<_> = inputs.iter().map(|h| upload(&s, h)).collect();
    let outs: Vec<_> = sizes.iter().map(|&b| upload(&s, &vec![0u8; b])).collect();
    let views: Vec<_> = bufs.iter().map(|b| view(&s, b)).collect();
    let total = ch.pack(&views).unwrap();
    assert_eq!(total, sizes.iter().sum::<usize>());
    let mut outs_mut: Vec<_> = outs.iter().map(|b| view_mut(&s, b)).collect();
    ch.unpack(&mut outs_mut).unwrap();
    for (o, i) in outs.iter().zip(&inputs) {
        assert_eq!(&download(&s, o), i);
    }

    let mut group: Vec<_> = bufs.iter().map(|b| view_mut(&s, b)).collect();
    ch.allreduce_fused(&mut group, DType::F32, ReduceOp::Sum, 0.5, 4.0)
        .unwrap();
    for (b, i) in bufs.iter().zip(&inputs) {
        let mut want = i.clone();
        kernels::scale(DType::F32, &mut want, 0.5).unwrap();
        kernels::scale(DType::F32, &mut want, 4.0).unwrap();
        assert_eq!(download(&s, b), want);
    }
    eprintln!("device fusion: pack/unpack round trip and fused scaled allreduce ok");
}

#[test]
fn readiness_and_completion_events() {
    use cudarc::driver::DevicePtr;
    if gpu(false).is_none() {
        return;
    }
    let mut ch = channel(Staging::Always);
    let producer = ch.context().new_stream().unwrap();
    let data = sample(DType::F32, 1 << 20, 3);
    // The producer writes on its own stream and records readiness; the channel stream waits
    // for it on the device, scales, and records completion, which the host waits for.
    let buf = producer.clone_htod(&data).unwrap();
    let ready = producer.record_event(None).unwrap();
    ch.wait_ready(&ready).unwrap();
    let ptr = buf.device_ptr(&producer).0;
    // SAFETY: `buf` outlives the bounded wait for completion below.
    let dev = unsafe { DeviceBytesMut::from_raw(ptr, buf.len()) };
    ch.scale(dev, DType::F32, 2.0).unwrap();
    let done = ch.record_completion().unwrap();
    ch.wait_completion(&done, TIMEOUT).unwrap();
    let mut want = data.clone();
    kernels::scale(DType::F32, &mut want, 2.0).unwrap();
    assert_eq!(producer.clone_dtoh(&buf).unwrap(), want);
    eprintln!("readiness (producer event) and completion events ok");
}

// ---------------------------------------------------------------------------------------------
// Two processes: host staging on one GPU; NCCL when two GPUs are visible.
// ---------------------------------------------------------------------------------------------

fn run_pair(visible: Option<&str>, expect: DeviceMode) {
    let port = free_port();
    let token = format!(
        "tok-5f1d0c3a-{:032x}",
        u128::from(std::process::id()) << 32 | u128::from(port)
    );
    let mut children = Children(Vec::new());
    for rank in 0..2 {
        let mut cmd = rank_command("two_process_child", true);
        let place = Place {
            rank,
            size: 2,
            local_rank: rank,
            local_size: 2,
            cross_rank: 0,
            cross_size: 1,
        };
        launcher_env(
            &mut cmd,
            &place,
            "tcp",
            &format!("127.0.0.1:{port}"),
            &token,
            60,
        );
        cmd.env(CHILD, "1").env(EXPECT_MODE, expect.to_string());
        if let Some(v) = visible {
            cmd.env("CUDA_VISIBLE_DEVICES", v);
        }
        children.0.push(cmd.spawn().expect("spawn a rank"));
    }
    let statuses = children.wait_all(Duration::from_secs(120));
    for (r, st) in statuses.iter().enumerate() {
        assert!(st.success(), "rank {r} failed: {st}");
    }
}

#[test]
fn host_staged_two_processes_on_one_gpu() {
    if gpu(false).is_none() {
        return;
    }
    run_pair(Some("0"), DeviceMode::HostStaged);
    eprintln!("host-staged path, 2 processes on GPU 0: ok");
}

#[test]
fn nccl_two_processes_on_two_gpus() {
    let Some(p) = gpu(true) else { return };
    if p.devices < 2 {
        eprintln!(
            "skipped: NCCL across 2 processes needs 2 GPUs (this machine has {})",
            p.devices
        );
        return;
    }
    run_pair(None, DeviceMode::Nccl);
    eprintln!("NCCL, 2 processes on 2 GPUs: ok");
}

/// One rank of [`run_pair`]: every device collective against a host-computed reference.
#[test]
#[ignore = "a child rank of the two-process GPU tests"]
fn two_process_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let mut host = fh_transport::from_env().expect("host world");
    let topo = host.topology();
    let (rank, size) = (topo.rank, topo.size);
    let mut world = CudaWorld::new(topo, Staging::Auto).expect("cuda world");
    let ctl = host.open("gpu-control").expect("host communicator");
    let mut ch = world.open(ctl, "gpu-pair").expect("device channel");
    let expect = std::env::var(EXPECT_MODE).unwrap();
    assert_eq!(ch.mode().to_string(), expect);
    let s = ch.stream().clone();

    let n = 1003;
    let mine: Vec<f32> = (0..n).map(|i| (i * (rank + 1)) as f32).collect();
    let sum: Vec<f32> = (0..n).map(|i| (i * 3) as f32).collect(); // ranks 0 and 1
                                                                  // Fused average of three tensors, prescale 2, postscale 0.25.
    let parts = [0..3usize, 3..3, 3..n];
    let bufs: Vec<_> = parts
        .iter()
        .map(|r| upload(&s, &f32_bytes(&mine[r.clone()])))
        .collect();
    let mut group: Vec<_> = bufs.iter().map(|b| view_mut(&s, b)).collect();
    ch.allreduce_fused(&mut group, DType::F32, ReduceOp::Average, 2.0, 0.25)
        .unwrap();
    for (b, r) in bufs.iter().zip(&parts) {
        let want: Vec<f32> = sum[r.clone()]
            .iter()
            .map(|v| v * 2.0 / 2.0 * 0.25)
            .collect();
        assert_eq!(
            download(&s, b),
            f32_bytes(&want),
            "rank {rank}: fused average"
        );
    }
    // Broadcast from rank 1.
    let b = upload(&s, &f32_bytes(&mine));
    ch.comm().broadcast(view_mut(&s, &b), 1).unwrap();
    let r1: Vec<f32> = (0..n).map(|i| (i * 2) as f32).collect();
    assert_eq!(download(&s, &b), f32_bytes(&r1));
    // Allgather.
    let src = upload(&s, &f32_bytes(&mine));
    let out = upload(&s, &vec![0u8; 4 * n * size]);
    ch.comm()
        .allgather(view(&s, &src), view_mut(&s, &out))
        .unwrap();
    let r0: Vec<f32> = (0..n).map(|i| i as f32).collect();
    assert_eq!(
        download(&s, &out),
        [f32_bytes(&r0), f32_bytes(&r1)].concat()
    );
    // Reduce-scatter of 2×8 elements.
    let rs_in: Vec<f32> = (0..16).map(|i| (i + rank) as f32).collect();
    let rs_src = upload(&s, &f32_bytes(&rs_in));
    let rs_out = upload(&s, &[0u8; 32]);
    ch.comm()
        .reduce_scatter(
            view(&s, &rs_src),
            view_mut(&s, &rs_out),
            DType::F32,
            ReduceOp::Sum,
        )
        .unwrap();
    let want: Vec<f32> = (8 * rank..8 * rank + 8)
        .map(|i| (2 * i + 1) as f32)
        .collect();
    assert_eq!(download(&s, &rs_out), f32_bytes(&want));
    // Alltoallv with uneven blocks: rank r sends r+1 bytes to rank 0 and 2 bytes to rank 1.
    let send: Vec<u8> = (0..(rank + 3) as u8).map(|b| b + 10 * rank as u8).collect();
    let send_counts = [rank + 1, 2];
    let recv_counts: Vec<usize> = (0..size)
        .map(|p| if rank == 0 { p + 1 } else { 2 })
        .collect();
    let a_src = upload(&s, &send);
    let a_out = upload(&s, &vec![0u8; recv_counts.iter().sum()]);
    ch.comm()
        .alltoallv(
            view(&s, &a_src),
            &send_counts,
            view_mut(&s, &a_out),
            &recv_counts,
        )
        .unwrap();
    let got = download(&s, &a_out);
    let want: Vec<u8> = if rank == 0 {
        vec![0, 10, 11]
    } else {
        vec![1, 2, 12, 13]
    };
    assert_eq!(got, want, "rank {rank}: alltoallv");
    let done = ch.record_completion().unwrap();
    ch.wait_completion(&done, TIMEOUT).unwrap();
    eprintln!("rank {rank}: {} collectives ok", ch.mode());
}
