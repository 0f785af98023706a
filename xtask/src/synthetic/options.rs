//! The synthetic run's options (`synthetic [OPTIONS]`), its systems, and the arguments the
//! benchmark script gets.

/// The systems compared, in the order each round runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum System {
    /// `fasthorovod.torch` under fhrun.
    FastHorovod,
    /// Horovod (`horovod.torch`) over MPI, under mpirun.
    HorovodMpi,
    /// Horovod (`horovod.torch`) over Gloo, under `horovodrun --gloo`.
    HorovodGloo,
    /// PyTorch DistributedDataParallel on Gloo.
    DdpGloo,
}

impl System {
    const ALL: [System; 4] = [
        System::FastHorovod,
        System::HorovodMpi,
        System::HorovodGloo,
        System::DdpGloo,
    ];

    pub(super) fn name(self) -> &'static str {
        match self {
            System::FastHorovod => "fasthorovod.torch (fhrun)",
            System::HorovodMpi => "Horovod, MPI (mpirun)",
            System::HorovodGloo => "Horovod, Gloo (horovodrun)",
            System::DdpGloo => "DDP, Gloo",
        }
    }

    pub(super) fn key(self) -> &'static str {
        match self {
            System::FastHorovod => "fasthorovod",
            System::HorovodMpi => "horovod-mpi",
            System::HorovodGloo => "horovod-gloo",
            System::DdpGloo => "ddp",
        }
    }
}

/// The experiment's options (after `synthetic`).
#[derive(Debug, PartialEq)]
pub(crate) struct Options {
    /// `--model`: `vgg16` or `resnet-like`.
    pub model: String,
    /// `--batch-size`, per rank.
    pub batch_size: usize,
    /// `--image-size`.
    pub image_size: usize,
    /// `--iters`: timed iterations per run.
    pub iters: usize,
    /// `--batches-per-iter`.
    pub batches_per_iter: usize,
    /// `--warmup`: batches before the timed ones.
    pub warmup: usize,
    /// `--rounds`.
    pub rounds: usize,
    /// `--systems`: which, in this order.
    pub systems: Vec<System>,
    /// `--timeout`: the limit of one run, in seconds.
    pub timeout: u64,
}

/// Usage of the subcommand.
pub(crate) const USAGE: &str = "cargo xtask bench --emulate HxR [--link RATE [--flow RATE]] \
     [--rtt TIME] synthetic [--model vgg16|resnet-like] [--batch-size N] [--image-size PX] \
     [--iters N] [--batches-per-iter N] [--warmup N] [--rounds R] \
     [--systems fasthorovod,horovod-mpi,horovod-gloo,ddp] [--timeout SECONDS]";

/// Parses the options after `synthetic`.
pub(crate) fn parse(args: &[String]) -> Result<Options, String> {
    let mut o = Options {
        model: "vgg16".into(),
        batch_size: 2,
        image_size: 224,
        iters: 5,
        batches_per_iter: 2,
        warmup: 2,
        rounds: 3,
        systems: System::ALL.to_vec(),
        timeout: 1800,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || {
            it.next()
                .ok_or(format!("{a} wants a value\nusage: {USAGE}"))
        };
        let mut number = |min: usize| -> Result<usize, String> {
            let v = value()?;
            v.parse::<usize>()
                .ok()
                .filter(|&n| n >= min)
                .ok_or(format!("{a} {v}: expected a whole number >= {min}"))
        };
        match a.as_str() {
            "--model" => {
                let v = value()?;
                if v != "vgg16" && v != "resnet-like" {
                    return Err(format!("--model {v}: expected vgg16 or resnet-like"));
                }
                o.model = v.clone();
            }
            "--batch-size" => o.batch_size = number(1)?,
            "--image-size" => o.image_size = number(1)?,
            "--iters" => o.iters = number(1)?,
            "--batches-per-iter" => o.batches_per_iter = number(1)?,
            "--warmup" => o.warmup = number(0)?,
            "--rounds" => o.rounds = number(1)?,
            "--timeout" => o.timeout = number(1)? as u64,
            "--systems" => {
                let v = value()?;
                o.systems = v
                    .split(',')
                    .map(|s| {
                        System::ALL
                            .into_iter()
                            .find(|x| x.key() == s.trim())
                            .ok_or(format!(
                                "--systems: unknown `{s}` (fasthorovod, horovod-mpi, horovod-gloo, ddp)"
                            ))
                    })
                    .collect::<Result<_, _>>()?;
            }
            other => return Err(format!("unexpected argument `{other}`\nusage: {USAGE}")),
        }
    }
    if o.model == "vgg16" && o.image_size < 32 {
        return Err("--image-size must be at least 32 for VGG-16".into());
    }
    Ok(o)
}

/// The script's arguments for `o`.
pub(super) fn script_args(o: &Options) -> Vec<String> {
    let mut a = vec!["--model".to_string(), o.model.clone()];
    if o.model == "resnet-like" {
        a.extend(["--model-size".into(), "medium".into()]);
    }
    for (k, v) in [
        ("--batch-size", o.batch_size),
        ("--image-size", o.image_size),
        ("--num-iters", o.iters),
        ("--num-batches-per-iter", o.batches_per_iter),
        ("--num-warmup-batches", o.warmup),
    ] {
        a.push(k.into());
        a.push(v.to_string());
    }
    a
}

#[cfg(test)]
mod tests {
    use super::{parse, script_args, System};

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn options_are_parsed_and_checked() {
        let o = parse(&args(&[
            "--model",
            "vgg16",
            "--batch-size",
            "1",
            "--image-size",
            "32",
            "--iters",
            "2",
            "--rounds",
            "1",
            "--systems",
            "ddp,fasthorovod",
        ]))
        .unwrap();
        assert_eq!(
            (o.batch_size, o.image_size, o.iters, o.rounds),
            (1, 32, 2, 1)
        );
        assert_eq!(o.systems, [System::DdpGloo, System::FastHorovod]);
        assert_eq!(parse(&[]).unwrap().systems, System::ALL);
        assert!(script_args(&o)
            .join(" ")
            .contains("--image-size 32 --num-iters 2"));
        for (bad, want) in [
            (&["--model", "vgg19"][..], "vgg16 or resnet-like"),
            (&["--iters", "0"][..], ">= 1"),
            (&["--image-size", "16"][..], "at least 32"),
            (&["--systems", "nccl"][..], "unknown `nccl`"),
            (&["--rounds"][..], "wants a value"),
            (&["--fast"][..], "unexpected argument"),
        ] {
            let err = parse(&args(bad)).err().unwrap();
            assert!(err.contains(want), "{bad:?}: {err}");
        }
    }
}
