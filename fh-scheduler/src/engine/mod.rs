//! The engine: public submission API and the state shared by its threads.

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::unbounded;
use fh_transport::compose::subset::SubsetTransport;
use fh_transport::{Topology, Transport};

use crate::control::Control;
use crate::flight::Recorder;
pub use crate::options::{AllreduceOptions, CollectiveOptions};
use crate::shared::{lock, Gate, Inner, Msg, OnLoss};
use crate::stats::{Counters, EngineStats, GroupRecord, StallReport};
use crate::timeline::Identity;
use crate::{Config, SchedulerError, Wire};

mod submit;

/// The FastHorovod engine of one rank: submit named collectives, get handles.
///
/// `Engine` is `Send + Sync`; share it by reference (or in an `Arc`) between the threads
/// that submit. Every rank of the world must start an engine with a compatible configuration;
/// the engine negotiates which names are ready everywhere and runs the collectives.
///
/// ```
/// use fh_scheduler::{AllreduceOptions, Config, Engine, Tensor};
/// use fh_core::ReduceOp;
/// use fh_transport::backend::local::LocalWorld;
///
/// let threads: Vec<_> = LocalWorld::new(2).into_iter().map(|t| std::thread::spawn(move || {
///     let engine = Engine::start(Box::new(t), Config::default().channels(2)).unwrap();
///     let x = Tensor::from_slice(&[engine.rank() as f32 + 1.0; 3]);
///     let h = engine.allreduce("x", x, AllreduceOptions::with_op(ReduceOp::Sum)).unwrap();
///     let y = h.wait().unwrap().to_vec::<f32>().unwrap();
///     engine.shutdown().unwrap();
///     y
/// })).collect();
/// for t in threads {
///     assert_eq!(t.join().unwrap(), [3.0; 3]);
/// }
/// ```
pub struct Engine {
    inner: Arc<Inner>,
    topology: Topology,
    backend: &'static str,
    control: Mutex<Option<JoinHandle<()>>>,
    transport: Mutex<Option<Box<dyn Transport>>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("rank", &self.inner.rank)
            .field("size", &self.inner.size)
            .field("preset", &self.inner.config.preset)
            .finish()
    }
}

impl Engine {
    /// Start an engine on a world. Collective: every rank must call it (it opens the control
    /// communicator and one communicator per data channel, and checks that the ranks'
    /// configurations agree).
    pub fn start(transport: Box<dyn Transport>, config: Config) -> Result<Engine, SchedulerError> {
        Self::start_inner(transport, config, None)
    }

    /// Start an engine on a world whose ranks stand for other ranks: rank `r` of `transport`
    /// is rank `world_ranks[r]` of the job (a process set's members, numbered `0..n` by their
    /// communicators). The engine works on `transport`'s ranks as [`Engine::start`] does; its
    /// negotiation errors name the world ranks. `world_ranks` must have one entry per rank of
    /// `transport`, the same on every rank. Collective, as [`Engine::start`].
    pub fn start_with_world_ranks(
        transport: Box<dyn Transport>,
        config: Config,
        world_ranks: &[usize],
    ) -> Result<Engine, SchedulerError> {
        let size = transport.size();
        if world_ranks.len() != size {
            return Err(SchedulerError::InvalidArgument(format!(
                "{} world ranks given for an engine over {size} ranks",
                world_ranks.len()
            )));
        }
        Self::start_inner(transport, config, Some(world_ranks.into()))
    }

    fn start_inner(
        mut transport: Box<dyn Transport>,
        config: Config,
        world_ranks: Option<Arc<[usize]>>,
    ) -> Result<Engine, SchedulerError> {
        config.validate()?;
        let topo = transport.topology();
        // Staging applies on one host only; the value in effect is the one agreed and used.
        let config = Config {
            stage_bytes: config.effective_stage_bytes(topo.cross_size),
            ..config
        };
        let wire = Wire::of(transport.wire(), topo.cross_size);
        let mut control = transport.open_as(fh_transport::Role::Control, "fh-control")?;
        // The channels this rank asks for (under `auto`, fitted to the cores its host's ranks
        // share); the smallest request is agreed below.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let asked = config.channels_for(cores, topo.local_size);
        let mut k = asked;
        let mut data = Vec::with_capacity(k);
        let mut incarnation = 0;
        let watch = transport.liveness();
        let beats = watch.as_ref().map(|w| w.settings());
        let mut clock_offset_us = 0;
        let agreed = crate::config::agree(control.as_mut(), &config, wire, beats, asked);
        let opened = agreed.and_then(|agreed| {
            k = agreed.channels;
            incarnation = crate::config::agree_incarnation(control.as_mut())?;
            clock_offset_us = crate::config::measure_clock(control.as_mut(), topo)?;
            for c in 0..k {
                data.push(transport.open(&format!("fh-channel-{c}"))?);
            }
            crate::gpu::open(transport.as_mut(), control.as_mut(), &config, topo, k)
        });
        let (gpu, devices) = match opened {
            Ok(g) => g,
            Err(e) => {
                // A rank lost during start-up: the peers blame it, not this rank.
                if let Some(lost) = e.lost_rank() {
                    control.abort(lost);
                    for d in &mut data {
                        d.abort(lost);
                    }
                }
                return Err(e);
            }
        };
        if config.channels_auto && k != config.effective_channels() && topo.rank == 0 {
            tracing::info!(
                channels = k,
                cores,
                local_ranks = topo.local_size,
                "FH_CHANNELS=auto: {k} data channels, since a host's ranks have fewer than {} \
                 cores each (FH_CHANNELS=K sets the count)",
                crate::config::AUTO_CORES_PER_RANK
            );
        }
        // From here on the count in effect is the configuration (process sets open as many).
        let config = Config {
            channels: k,
            channels_auto: false,
            ..config
        };
        // Every rank writes its own timeline when the path names a file per rank, else rank 0
        // alone; a process set's engine writes none (its ranks' world engines do).
        let who = Identity {
            rank: topo.rank,
            offset_us: clock_offset_us,
        };
        let timeline = match (&config.timeline, &world_ranks) {
            (Some(pattern), None) => crate::timeline::create_rank_timeline(pattern, k, who)
                .map_err(|(path, e)| {
                    SchedulerError::config(
                        "FH_TIMELINE",
                        format!("cannot create {}: {e}", path.display()),
                    )
                })?
                .map(Arc::new),
            _ => None,
        };
        let on_loss = OnLoss {
            interrupts: std::iter::once(&control)
                .chain(&data)
                .filter_map(|c| c.interrupter())
                .collect(),
            // A process set's engine runs over the world's communicators: the world's engine
            // speaks for the world.
            watch: if world_ranks.is_none() { watch } else { None },
        };
        let (tx, rx) = unbounded();
        let helper = Arc::new(crate::control::Helper::new());
        let inner = Arc::new(Inner {
            rank: topo.rank,
            size: topo.size,
            world_ranks,
            pacing: config.pacing(topo.size, wire),
            config: config.clone(),
            gate: Mutex::new(Gate {
                closed: None,
                tx,
                orphans: Vec::new(),
                held: Vec::new(),
            }),
            in_flight: Mutex::new(HashSet::new()),
            counters: Counters::default(),
            stalls: Mutex::new(Vec::new()),
            barrier_seq: AtomicU64::new(0),
            groups: Mutex::new(Vec::new()),
            timeline: RwLock::new(timeline),
            gpu,
            pacing_wait: AtomicBool::new(false),
            on_loss,
            culprit_hook: RwLock::new(None),
            flight: Recorder::new(config.flight_records),
            flight_told: AtomicBool::new(false),
            clock: who,
            assist: Arc::clone(&helper) as Arc<dyn crate::handle::Assist>,
        });
        let _ = inner.counters.started.set(Instant::now());
        // The heartbeats' verdict stops the engine at once, also while it idles.
        if let Some(w) = &inner.on_loss.watch {
            let weak = Arc::downgrade(&inner);
            w.subscribe(move |v| {
                if let Some(inner) = weak.upgrade() {
                    inner.fail(SchedulerError::from_transport_owned(v.error()));
                }
            });
        }
        let ctl = Control::new(
            Arc::clone(&inner),
            control,
            data,
            devices,
            rx,
            incarnation,
            helper,
        )?;
        let handle = std::thread::Builder::new()
            .name(format!("fh-control-{}", topo.rank))
            .spawn(move || ctl.run())
            .map_err(|e| SchedulerError::InvalidArgument(format!("cannot spawn a thread: {e}")))?;
        tracing::debug!(
            rank = topo.rank,
            size = topo.size,
            preset = config.preset.name(),
            channels = k,
            backend = transport.backend(),
            ?wire,
            backpressure = inner.pacing.enabled,
            "engine started"
        );
        Ok(Engine {
            inner,
            topology: topo,
            backend: transport.backend(),
            control: Mutex::new(Some(handle)),
            transport: Mutex::new(Some(transport)),
        })
    }

    /// Collectively (every rank of this engine's world) open communicators over the world
    /// ranks `members`, one per label, on the world this engine was started on; see
    /// [`fh_transport::compose::subset::open_subset`]. Used by [`crate::ProcessSets`].
    pub fn open_subset(
        &self,
        members: &[usize],
        labels: &[String],
    ) -> Result<SubsetTransport, SchedulerError> {
        let mut guard = lock(&self.transport);
        let world = guard.as_mut().ok_or_else(|| SchedulerError::ShutDown {
            reason: "the engine's world is closed".into(),
        })?;
        Ok(fh_transport::compose::subset::open_subset(
            world.as_mut(),
            members,
            labels,
        )?)
    }

    /// Shut the engine down through a shared reference (as [`Engine::shutdown`]; for an
    /// engine held in an `Arc`). Later submissions fail with [`SchedulerError::ShutDown`].
    pub fn close(&self) -> Result<(), SchedulerError> {
        self.stop(None)
    }

    /// Shut the engine down as [`Engine::close`] does, telling the other ranks why: their
    /// engines stop with an error naming this rank and `reason` (for example "raised
    /// ValueError: bad batch"), so that a rank that leaves because of a failure is named as
    /// the cause on every rank.
    pub fn close_with_reason(&self, reason: &str) -> Result<(), SchedulerError> {
        self.stop(Some(reason.to_string()))
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// This rank's place among the ranks of its host.
    pub fn local_rank(&self) -> usize {
        self.topology.local_rank
    }

    /// Number of ranks on this rank's host.
    pub fn local_size(&self) -> usize {
        self.topology.local_size
    }

    /// Index of this rank's host among the hosts.
    pub fn cross_rank(&self) -> usize {
        self.topology.cross_rank
    }

    /// Number of hosts.
    pub fn cross_size(&self) -> usize {
        self.topology.cross_size
    }

    /// Where this rank sits: rank, size, local and cross ranks and sizes.
    pub fn topology(&self) -> Topology {
        self.topology
    }

    /// The backend of the world the engine runs on (`tcp`, `shm`, `hier`, `mpi`, `local`, ...).
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// The TCP streams the engine's world uses to each peer on another host, and what they
    /// were chosen from ([`fh_transport::Transport::stream_choice`]; the same on every rank).
    /// `None` when nothing crosses hosts over TCP, or once the engine has shut down.
    pub fn stream_choice(&self) -> Option<fh_transport::backend::tcp::StreamChoice> {
        lock(&self.transport)
            .as_ref()
            .and_then(|t| t.stream_choice())
    }

    /// Start writing a Chrome-trace timeline to `path` (rank 0 writes; other ranks accept
    /// the call and do nothing; a path holding `{rank}` names a file per rank, and every
    /// rank writes its own), replacing any timeline being written. Every rank should call it,
    /// as with Horovod's `start_timeline`.
    pub fn start_timeline(&self, path: &Path) -> Result<(), SchedulerError> {
        let k = self.inner.config.effective_channels();
        let made = crate::timeline::create_rank_timeline(path, k, self.inner.clock).map_err(
            |(path, e)| {
                SchedulerError::InvalidArgument(format!(
                    "cannot create the timeline {}: {e}",
                    path.display()
                ))
            },
        )?;
        let Some(t) = made else {
            return Ok(());
        };
        if let Some(old) = self.inner.replace_timeline(Some(Arc::new(t))) {
            old.finish(crate::timeline::STOP_WAIT);
        }
        Ok(())
    }

    /// Whether this rank writes a timeline now.
    pub fn timeline_on(&self) -> bool {
        self.inner.timeline().is_some()
    }

    /// Put a span of the framework's side on this rank's timeline (its Python lane), if one
    /// is written: `name` (`submit`, `synchronize`, `optimizer.step`) from `begin` to `end`,
    /// with a detail (a tensor's name, a count). Cheap, never blocks.
    pub fn timeline_span(&self, name: &str, detail: &str, begin: Instant, end: Instant) {
        if let Some(t) = self.inner.timeline() {
            t.framework(name.to_string(), detail.to_string(), begin, end);
        }
    }

    /// Stop writing the timeline: the events already handed to its writer thread are written,
    /// the JSON array is closed and the writer joined (waiting at most 10 s) before this
    /// returns. A no-op when none is written.
    pub fn stop_timeline(&self) {
        self.inner.finish_timeline();
    }

    /// The GPU this rank's device channels drive and how they move bytes (NCCL, or host
    /// staging when a host runs more ranks than it has GPUs); `None` when the GPU path is not
    /// open (see [`Config::cuda`](crate::Config#structfield.cuda)).
    pub fn gpu(&self) -> Option<(u32, fh_transport::backend::cuda::DeviceMode)> {
        match (&self.inner.gpu.device, self.inner.gpu.mode) {
            (Ok(d), Some(m)) => Some((*d, m)),
            _ => None,
        }
    }

    /// The configuration the engine runs with.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// A snapshot of this rank's counters.
    pub fn stats(&self) -> EngineStats {
        self.inner.counters.snapshot()
    }

    /// The framework finished a training step whose gradients' reductions it waited for
    /// `exposed` (the communication the step did not hide behind its computation): counted in
    /// [`EngineStats::steps`] and [`EngineStats::exposed`].
    pub fn record_step(&self, exposed: Duration) {
        let c = &self.inner.counters;
        Counters::add(&c.steps, 1);
        Counters::add(
            &c.exposed_nanos,
            u64::try_from(exposed.as_nanos()).unwrap_or(u64::MAX),
        );
    }

    /// Why the engine has stopped (shutdown, lost rank, stall), or `None` while it runs.
    pub fn stopped(&self) -> Option<SchedulerError> {
        self.inner.failure()
    }

    /// Run `hook` on the engine's control thread whenever the stall inspector names this rank
    /// as one that has not submitted tensors the other ranks have (once per new list of
    /// names), so that the rank can show where it is instead: `fasthorovod` prints the Python
    /// stack of every thread. The hook must not block or wait on the engine; it replaces any
    /// hook set before.
    pub fn set_culprit_hook(&self, hook: crate::shared::CulpritHook) {
        *self
            .inner
            .culprit_hook
            .write()
            .unwrap_or_else(|p| p.into_inner()) = Some(hook);
    }

    /// Write this rank's flight record now (its last operations and their timings; see
    /// [`crate::flight`]) to the flight directory, with `reason`; returns the file written
    /// (`None`: the recorder is off, or this is a process set's engine, whose operations the
    /// world engine's record does not hold). `fasthorovod` calls it on `SIGUSR1`.
    pub fn write_flight_record(
        &self,
        reason: &str,
    ) -> Result<Option<std::path::PathBuf>, SchedulerError> {
        self.inner.write_flight(reason).map_err(|e| {
            SchedulerError::InvalidArgument(format!("cannot write the flight record: {e}"))
        })
    }

    /// The stall inspector's reports so far.
    pub fn stall_reports(&self) -> Vec<StallReport> {
        lock(&self.inner.stalls).clone()
    }

    #[allow(clippy::too_many_arguments)]
    /// The fused groups dispatched so far, in dispatch order (empty unless
    /// `Config::record_groups` is on). Identical on every rank.
    pub fn group_log(&self) -> Vec<GroupRecord> {
        lock(&self.inner.groups).clone()
    }

    /// Shut the engine down: every rank's engine stops (a shutdown on one rank is agreed with
    /// the others in the next negotiation round), pending operations fail with
    /// [`SchedulerError::ShutDown`], the threads are joined. Returns the communication error
    /// that stopped the engine, if one did.
    pub fn shutdown(self) -> Result<(), SchedulerError> {
        self.stop(None)
    }

    fn stop(&self, reason: Option<String>) -> Result<(), SchedulerError> {
        let _ = self.inner.send(Msg::Shutdown(reason));
        let handle = lock(&self.control).take();
        if let Some(h) = handle {
            if h.join().is_err() {
                tracing::error!(rank = self.inner.rank, "the control thread panicked");
            }
            drop(lock(&self.transport).take());
        }
        // After the control thread (which joins the channels): their last events are queued.
        self.inner.finish_timeline();
        match self.inner.failure() {
            Some(SchedulerError::ShutDown { .. }) | None => Ok(()),
            Some(e) => Err(e),
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.stop(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handle::{GroupHandle, Handle};
    use crate::Tensor;

    #[test]
    fn public_types_are_send_and_sync() {
        fn send_sync<T: Send + Sync>() {}
        fn send<T: Send>() {}
        send_sync::<Engine>();
        send_sync::<Config>();
        send_sync::<Tensor>();
        send_sync::<SchedulerError>();
        send::<Handle>();
        send::<GroupHandle>();
    }
}
