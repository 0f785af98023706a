//! Device tensors in the engine: refused clearly without the GPU path (every build, no GPU
//! needed), and run on the device channels when a GPU is there (feature `cuda`; the GPU tests
//! print `skipped: ...` and return on a machine without one).

mod common;

use std::time::Duration;

use fh_scheduler::{
    AllreduceOptions, CollectiveOptions, Config, DType, Device, DeviceMemory, Engine, ReduceOp,
    Tensor,
};
use fh_transport::backend::local::LocalWorld;

use common::run_world;

/// A device tensor over a made-up address: never dereferenced, since every test using it
/// expects the submission to be refused before anything touches the memory.
fn fake_device_tensor(device: u32) -> Tensor {
    let mem = DeviceMemory {
        device,
        ptr: 0x1000,
        len: 16,
        stream: 0,
    };
    // SAFETY: refused at submission (asserted by the tests), so the memory is never used.
    unsafe { Tensor::from_device(DType::F32, vec![4], mem, Box::new(())) }.unwrap()
}

#[test]
fn device_tensors_describe_their_memory_without_host_bytes() {
    let t = fake_device_tensor(1);
    assert!(t.is_device());
    assert_eq!(t.device(), Device::Gpu(1));
    assert_eq!(t.numel(), 4);
    assert!(t.data().is_empty());
    assert!(t.to_vec::<f32>().unwrap_err().to_string().contains("gpu:1"));
    // A clone aliases the same device memory.
    assert_eq!(t.clone().device_memory(), t.device_memory());
    assert_eq!(Tensor::from_slice(&[1.0f32]).device(), Device::Cpu);
    let bad = DeviceMemory {
        device: 0,
        ptr: 0x1000,
        len: 12,
        stream: 0,
    };
    // SAFETY: refused (wrong length): never used.
    let e = unsafe { Tensor::from_device(DType::F32, vec![4], bad, Box::new(())) }.unwrap_err();
    assert!(e.to_string().contains("16 bytes"), "{e}");
    let null = DeviceMemory { ptr: 0, ..bad };
    // SAFETY: refused (null): never used.
    let e = unsafe { Tensor::from_device(DType::F32, vec![3], null, Box::new(())) }.unwrap_err();
    assert!(e.to_string().contains("null"), "{e}");
}

/// Without the GPU path (no `cuda` feature, or an engine started without `FH_CUDA=1`), a
/// device tensor is refused at submission with the same message on every rank, and the engine
/// goes on with host tensors.
#[test]
fn device_tensor_without_the_gpu_path_is_refused_at_submission() {
    let out = run_world(2, Config::default().channels(2), |e, _| {
        assert_eq!(e.gpu(), None);
        let err = e
            .allreduce("g", fake_device_tensor(0), AllreduceOptions::default())
            .unwrap_err()
            .to_string();
        let err2 = e
            .broadcast_with(
                "b",
                fake_device_tensor(0),
                0,
                CollectiveOptions::default().device(Device::Gpu(0)),
            )
            .unwrap_err()
            .to_string();
        // A host tensor may not claim a GPU either.
        let err3 = e
            .allreduce(
                "h",
                Tensor::from_slice(&[1.0f32]),
                AllreduceOptions::default().device(Device::Gpu(0)),
            )
            .unwrap_err()
            .to_string();
        let y = e
            .allreduce(
                "g",
                Tensor::from_slice(&[1.0f32, 2.0]),
                AllreduceOptions::with_op(ReduceOp::Sum),
            )
            .unwrap()
            .wait()
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        (err, err2, err3, y)
    });
    for (err, err2, err3, y) in &out {
        assert!(err.contains("gpu:0"), "{err}");
        if fh_transport::backend::cuda::COMPILED {
            assert!(err.contains("FH_CUDA=1"), "{err}");
        } else {
            assert!(
                err.contains("lacks the GPU path") && err.contains("--features"),
                "{err}"
            );
        }
        assert_eq!(err, err2);
        assert!(err3.contains("Tensor::from_device"), "{err3}");
        assert_eq!(y, &[2.0, 4.0]);
    }
    assert_eq!(out[0].0, out[1].0, "the same message on every rank");
}

/// Asking for the GPU path where it cannot run fails on every rank, naming the ranks and
/// what is missing here; nothing hangs or panics.
#[test]
fn requesting_the_gpu_path_without_a_gpu_fails_on_every_rank() {
    if fh_transport::backend::cuda::available().is_ok() {
        eprintln!("skipped: this machine can run the GPU path (the GPU tests cover it)");
        return;
    }
    let threads: Vec<_> = LocalWorld::with_timeout(2, Duration::from_secs(20))
        .into_iter()
        .map(|t| {
            std::thread::spawn(move || {
                Engine::start(Box::new(t), Config::default().channels(2).cuda(true)).unwrap_err()
            })
        })
        .collect();
    for t in threads {
        let err = t.join().unwrap().to_string();
        assert!(
            err.contains("FH_CUDA") && err.contains("rank(s) [0, 1]"),
            "{err}"
        );
        if fh_transport::backend::cuda::COMPILED {
            assert!(err.contains("libcuda.so.1") || err.contains("GPU"), "{err}");
        } else {
            assert!(err.contains("--features fh-transport/cuda"), "{err}");
        }
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    //! The engine driving GPU tensors (skipped without a GPU).

    use super::*;
    use fh_transport::backend::cuda::{CudaContext, CudaStream, DeviceBytesMut};
    use std::sync::{Arc, Mutex};

    fn have_gpu() -> bool {
        match fh_transport::backend::cuda::available() {
            Ok(_) => true,
            Err(fh_transport::TransportError::BackendUnavailable { reason, .. }) => {
                eprintln!("skipped: {reason}");
                false
            }
            Err(e) => {
                eprintln!("skipped: {e}");
                false
            }
        }
    }

    /// One allocation shared by the test and the tensor's guard.
    type Buf = Arc<Mutex<fh_transport::backend::cuda::CudaSlice<u8>>>;

    /// Upload `values` on `stream` (asynchronously: the engine's readiness event orders it)
    /// and describe the memory as a device tensor.
    fn upload(stream: &Arc<CudaStream>, device: u32, values: &[f32]) -> (Tensor, Buf) {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
        let mut slice = stream.clone_htod(&bytes).expect("htod");
        // SAFETY: only the address is read.
        let ptr = unsafe { DeviceBytesMut::from_slice(&mut slice, stream) }.device_ptr();
        let buf: Buf = Arc::new(Mutex::new(slice));
        let mem = DeviceMemory {
            device,
            ptr,
            len: bytes.len(),
            stream: stream.cu_stream() as usize as u64,
        };
        // SAFETY: the allocation lives in `buf`, which the guard keeps alive; the stream is
        // live for the test; nothing touches the memory until the completion events fired.
        let t = unsafe {
            Tensor::from_device(DType::F32, vec![values.len()], mem, Box::new(buf.clone()))
        }
        .expect("device tensor");
        (t, buf)
    }

    fn download(stream: &Arc<CudaStream>, buf: &Buf) -> Vec<f32> {
        let b = stream.clone_dtoh(&*buf.lock().unwrap()).expect("dtoh");
        b.chunks_exact(4)
            .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// Rank `rank`'s device work: a single allreduce, a fused group with scaling, a tensor
    /// partitioned across two channels, and a broadcast; results read back on the producer's
    /// stream after waiting for the completion events (on the stream for some, on the host
    /// for others).
    fn exercise(e: &Engine, rank: usize) -> Vec<Vec<f32>> {
        let n = e.size() as f32;
        let (ord, mode) = e.gpu().expect("the GPU path is open");
        let gpus = fh_transport::backend::cuda::probe().devices.max(1);
        assert_eq!(ord as usize, e.local_rank() % gpus);
        // NCCL refuses two ranks on one GPU: more local ranks than GPUs means host staging.
        let staged = e.local_size() > gpus;
        assert_eq!(
            mode == fh_transport::backend::cuda::DeviceMode::HostStaged,
            staged
        );
        eprintln!("rank {rank}: gpu:{ord}, {mode}");
        let ctx = CudaContext::new(ord as usize).expect("context");
        let stream = ctx.new_stream().expect("stream");
        let r = rank as f32 + 1.0;
        let mut out = Vec::new();

        let (t, b) = upload(&stream, ord, &[r, 2.0 * r, 3.0 * r]);
        let y = e
            .allreduce("one", t, AllreduceOptions::with_op(ReduceOp::Sum))
            .unwrap()
            .wait()
            .unwrap();
        assert!(y.is_device() && !y.completion_events().is_empty());
        // SAFETY: `stream` is a live stream of the tensor's device.
        unsafe { y.wait_on_stream(stream.cu_stream() as usize as u64) }.unwrap();
        out.push(download(&stream, &b));

        let parts: Vec<(Tensor, Buf)> = (0..3)
            .map(|i| upload(&stream, ord, &vec![r * (i as f32 + 1.0); 5 + i]))
            .collect();
        let (ts, bs): (Vec<Tensor>, Vec<Buf>) = parts.into_iter().unzip();
        let opts = AllreduceOptions::default()
            .prescale(2.0)
            .postscale(0.5 * f64::from(n));
        let ys = e
            .grouped_allreduce("grp", ts, opts)
            .unwrap()
            .wait()
            .unwrap();
        for y in &ys {
            y.wait_on_host(Duration::from_secs(30)).unwrap();
        }
        for b in &bs {
            out.push(download(&stream, b));
        }

        // 64 KiB with 16 KiB partitions: chunks on both channels, reduced in place.
        let big: Vec<f32> = (0..16384).map(|i| (i % 7) as f32 * r).collect();
        let (t, b) = upload(&stream, ord, &big);
        let y = e
            .allreduce("big", t, AllreduceOptions::with_op(ReduceOp::Max))
            .unwrap()
            .wait()
            .unwrap();
        y.wait_on_host(Duration::from_secs(30)).unwrap();
        out.push(download(&stream, &b));

        let (t, b) = upload(&stream, ord, &[r; 4]);
        let y = e.broadcast("bc", t, e.size() - 1).unwrap().wait().unwrap();
        y.wait_on_host(Duration::from_secs(30)).unwrap();
        out.push(download(&stream, &b));
        out
    }

    fn check(results: &[Vec<Vec<f32>>], n: usize) {
        let sum_r: f32 = (1..=n).map(|r| r as f32).sum();
        let max_r = n as f32;
        for res in results {
            assert_eq!(res[0], [sum_r, 2.0 * sum_r, 3.0 * sum_r]);
            for i in 0..3 {
                // average(2 * x) * 0.5 * n = sum(x)
                let want = vec![sum_r * (i as f32 + 1.0); 5 + i];
                assert_eq!(res[1 + i], want, "group member {i}");
            }
            let big: Vec<f32> = (0..16384).map(|i| (i % 7) as f32 * max_r).collect();
            assert_eq!(res[4], big);
            assert_eq!(res[5], [n as f32; 4]);
        }
    }

    fn config() -> Config {
        Config::default()
            .channels(2)
            .partition_bytes(16 << 10)
            .cuda(true)
    }

    #[test]
    fn engine_allreduce_of_device_tensors_one_rank() {
        if !have_gpu() {
            return;
        }
        let results = run_world(1, config(), exercise);
        check(&results, 1);
        eprintln!("engine, 1 rank, device tensors: ok");
    }

    /// Two ranks (threads of one process) on one GPU: NCCL refuses two ranks on one device,
    /// so the channels stage through the host (on a machine with 2 GPUs, each rank gets its
    /// own and NCCL runs).
    #[test]
    fn engine_allreduce_of_device_tensors_two_ranks() {
        if !have_gpu() {
            return;
        }
        let results = run_world(2, config(), exercise);
        check(&results, 2);
        eprintln!("engine, 2 ranks, device tensors: ok");
    }

    const CHILD: &str = "FH_TEST_DEVICE_CHILD";

    /// Kills and reaps the child ranks when the test ends (also on failure).
    struct Children(Vec<std::process::Child>);

    impl Drop for Children {
        fn drop(&mut self) {
            for c in &mut self.0 {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    /// Two processes on GPU 0 over TCP on 127.0.0.1: NCCL refuses two ranks on one GPU, so
    /// the engine's device channels stage through the host.
    #[test]
    fn engine_two_processes_on_one_gpu_host_staged() {
        if !have_gpu() {
            return;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("an ephemeral port");
        let token = format!(
            "tok-5f1d0c3a-{:032x}",
            (u128::from(std::process::id()) << 64) | (u128::from(port) << 16) | 0xd1ce
        );
        let exe = std::env::current_exe().expect("current exe");
        let mut kids = Children(Vec::new());
        for rank in 0..2 {
            let mut launch = fh_job::LaunchInfo::for_rank(
                fh_job::Topology::single_host(rank, 2),
                format!("127.0.0.1:{port}"),
                fh_job::JobToken::new(token.clone()),
            );
            launch.timeout = Duration::from_secs(60);
            let mut cmd = std::process::Command::new(&exe);
            cmd.args([
                "gpu::device_child_rank",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .env("CUDA_VISIBLE_DEVICES", "0")
            .envs(launch.to_vars())
            .env("FH_TRANSPORT", "tcp")
            .env("FH_CUDA", "1")
            .stdin(std::process::Stdio::null());
            kids.0.push(cmd.spawn().expect("spawn a rank"));
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(180);
        let mut done = [None; 2];
        while done.iter().any(Option::is_none) {
            for (r, c) in kids.0.iter_mut().enumerate() {
                if done[r].is_none() {
                    done[r] = c.try_wait().expect("wait for a rank");
                }
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the ranks did not finish within 180 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        for (r, st) in done.iter().enumerate() {
            let st = st.expect("finished");
            assert!(st.success(), "rank {r} failed: {st}");
        }
        eprintln!("engine, 2 processes on one GPU (host-staged), device tensors: ok");
    }

    /// One rank of [`engine_two_processes_on_one_gpu_host_staged`].
    #[test]
    #[ignore = "a child rank of the two-process GPU test"]
    fn device_child_rank() {
        if std::env::var_os(CHILD).is_none() {
            return;
        }
        let world = fh_transport::from_env().expect("host world");
        let cfg = Config::from_env()
            .expect("config")
            .channels(2)
            .partition_bytes(16 << 10);
        assert!(cfg.cuda, "FH_CUDA=1 is set by the parent");
        let e = Engine::start(world, cfg).expect("engine with the GPU path");
        let res = exercise(&e, e.rank());
        e.shutdown().expect("clean shutdown");
        check(&[res], 2);
    }
}
