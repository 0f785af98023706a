//! What a chaos run does: its fault, transport, launcher, victim and timing, drawn from a
//! seeded generator so that a seed replays a draw.

use super::{SIZE, WORLD};

/// The faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Fault {
    Kill,
    Stop,
    Cut,
    Partition,
    FrozenHost,
    Loss,
    Delay,
    SlowHost,
}

impl Fault {
    pub(crate) const ALL: [Fault; 8] = [
        Fault::Kill,
        Fault::Stop,
        Fault::Cut,
        Fault::Partition,
        Fault::FrozenHost,
        Fault::Loss,
        Fault::Delay,
        Fault::SlowHost,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Fault::Kill => "kill",
            Fault::Stop => "stop",
            Fault::Cut => "cut",
            Fault::Partition => "partition",
            Fault::FrozenHost => "frozen-host",
            Fault::Loss => "loss",
            Fault::Delay => "delay",
            Fault::SlowHost => "slow-host",
        }
    }

    /// Whether the job must finish with nobody blamed.
    pub(crate) fn benign(self) -> bool {
        matches!(self, Fault::Loss | Fault::Delay | Fault::SlowHost)
    }
}

/// One run's plan.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub fault: Fault,
    pub transport: &'static str,
    pub fhrun: bool,
    /// The victim rank (kill, stop) or host (the others).
    pub victim: usize,
    /// Milliseconds between every rank's first step and the fault.
    pub delay_ms: u64,
    /// Loss percentage (loss).
    pub pct: u64,
}

/// A small deterministic generator (xorshift64*), so that a seed replays a draw.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
    }
}

/// The CI plans: every fault once per transport direct, and kill, stop, cut, partition and a
/// frozen host once each under fhrun (transports alternating).
pub(crate) fn ci_plans(rng: &mut Rng) -> Vec<Plan> {
    let mut plans = Vec::new();
    for fault in Fault::ALL {
        for transport in ["tcp", "hier"] {
            plans.push(draw(rng, fault, transport, false));
        }
    }
    for (i, fault) in [
        Fault::Kill,
        Fault::Stop,
        Fault::Cut,
        Fault::Partition,
        Fault::FrozenHost,
    ]
    .into_iter()
    .enumerate()
    {
        plans.push(draw(rng, fault, ["tcp", "hier"][i % 2], true));
    }
    plans
}

/// `n` plans drawn at random.
pub(crate) fn random_plans(rng: &mut Rng, n: usize) -> Vec<Plan> {
    (0..n)
        .map(|_| {
            let fault = Fault::ALL[rng.below(Fault::ALL.len() as u64) as usize];
            let transport = ["tcp", "hier"][rng.below(2) as usize];
            let fhrun = rng.below(4) == 0;
            draw(rng, fault, transport, fhrun)
        })
        .collect()
}

fn draw(rng: &mut Rng, fault: Fault, transport: &'static str, fhrun: bool) -> Plan {
    let victim = match fault {
        Fault::Kill | Fault::Stop => rng.below(SIZE as u64) as usize,
        // fhrun runs on h0: a frozen h0 would freeze fhrun with it (a launcher's host that
        // freezes stops the launcher too), so under fhrun the frozen host is h1.
        Fault::FrozenHost if fhrun => 1,
        _ => rng.below(WORLD.len() as u64) as usize,
    };
    Plan {
        fault,
        transport,
        fhrun,
        victim,
        delay_ms: rng.below(800),
        pct: 1 + rng.below(5),
    }
}
