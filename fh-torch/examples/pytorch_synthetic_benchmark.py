#!/usr/bin/env python3
"""Synthetic training throughput with FastHorovod, in the style of Horovod's
``pytorch_synthetic_benchmark.py``.

Every rank trains a small ResNet-like CNN (built here: torchvision is not needed) on one
random batch, over and over, and reports images per second: per rank and in total, as
mean +- 1.96 standard deviations over the iterations. Apart from its import this is a
Horovod script (``import horovod.torch as hvd`` runs it on Horovod):

    fhrun -np 4 python pytorch_synthetic_benchmark.py --model-size small --batch-size 16

``--use-ddp`` runs the same model and batch under PyTorch DistributedDataParallel on Gloo
instead, for the comparison (launch with torchrun's environment):

    python -m torch.distributed.run --nproc_per_node 4 pytorch_synthetic_benchmark.py --use-ddp

The last line rank 0 prints is a JSON summary (``{"benchmark": ...}``) for scripts.
"""

import argparse
import json
import math
import os
import timeit

import torch
import torch.nn.functional as F

import fasthorovod.torch as hvd

# (stem width, (blocks per stage, ...), widening per stage) per --model-size.
MODEL_SIZES = {
    "tiny": (8, (1, 1), 2),
    "small": (16, (1, 1, 1), 2),
    "medium": (32, (2, 2, 2), 2),
    "large": (64, (2, 2, 2, 2), 2),
}


class BasicBlock(torch.nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (a 1x1 projection when the shape
    changes), as in ResNet-18/34."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.project = None
        if stride != 1 or cin != cout:
            self.project = torch.nn.Sequential(
                torch.nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                torch.nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.project is None else self.project(x)))


class SmallResNet(torch.nn.Module):
    """A ResNet-like classifier: a stem, stages of basic blocks (each stage after the first
    halves the resolution and widens the channels), global average pooling, a linear head."""

    def __init__(self, size, num_classes):
        super().__init__()
        width, stages, widen = MODEL_SIZES[size]
        self.stem = torch.nn.Sequential(
            torch.nn.Conv2d(3, width, 3, padding=1, bias=False),
            torch.nn.BatchNorm2d(width), torch.nn.ReLU())
        blocks, cin = [], width
        for s, n in enumerate(stages):
            cout = width * widen ** s
            for b in range(n):
                blocks.append(BasicBlock(cin, cout, 2 if (s > 0 and b == 0) else 1))
                cin = cout
        self.blocks = torch.nn.Sequential(*blocks)
        self.head = torch.nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small",
                   help="size of the ResNet-like model")
    p.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
    p.add_argument("--image-size", type=int, default=32, help="square images of this side")
    p.add_argument("--num-classes", type=int, default=100)
    p.add_argument("--num-warmup-batches", type=int, default=5,
                   help="batches before the timed iterations")
    p.add_argument("--num-batches-per-iter", type=int, default=5,
                   help="batches per timed iteration")
    p.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    p.add_argument("--fp16-allreduce", action="store_true",
                   help="compress gradients to float16 for the allreduce")
    p.add_argument("--use-ddp", action="store_true",
                   help="PyTorch DDP on Gloo instead of fasthorovod (torchrun's environment)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch compute threads per rank (torch.set_num_threads)")
    args = p.parse_args(argv)
    for name in ("batch_size", "image_size", "num_classes", "num_batches_per_iter",
                 "num_iters", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.num_warmup_batches < 0:
        p.error("--num-warmup-batches must be >= 0")
    if args.use_ddp and args.fp16_allreduce:
        p.error("--fp16-allreduce is a Horovod option; DDP runs without it")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(42)

    if args.use_ddp:
        import datetime

        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        rank, size = dist.get_rank(), dist.get_world_size()
        model = DistributedDataParallel(SmallResNet(args.model_size, args.num_classes))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        backend = "ddp-gloo"
    else:
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        model = SmallResNet(args.model_size, args.num_classes)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size)
        compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
        optimizer = hvd.DistributedOptimizer(optimizer,
                                             named_parameters=model.named_parameters(),
                                             compression=compression)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        backend = "fasthorovod"

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, args.num_classes, (args.batch_size,))

    def benchmark_step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def log(s):
        if rank == 0:
            print(s, flush=True)

    params = sum(p.numel() for p in model.parameters())
    log(f"Model: ResNet-like '{args.model_size}' ({params / 1e6:.2f} M parameters), "
        f"{args.image_size}x{args.image_size} images")
    log(f"Batch size: {args.batch_size} per rank; backend: {backend}; ranks: {size}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)

    log("Running benchmark...")
    img_secs = []
    for i in range(args.num_iters):
        t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / t
        log(f"Iter #{i}: {img_sec:.1f} img/sec per rank")
        img_secs.append(img_sec)

    mean = sum(img_secs) / len(img_secs)
    std = math.sqrt(sum((x - mean) ** 2 for x in img_secs) / len(img_secs))
    conf = 1.96 * std
    log(f"Img/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {size} rank(s): {size * mean:.1f} +-{size * conf:.1f}")
    log(json.dumps({"benchmark": "pytorch_synthetic", "backend": backend, "ranks": size,
                    "model_size": args.model_size, "batch_size": args.batch_size,
                    "fp16_allreduce": args.fp16_allreduce, "img_sec_per_rank": mean,
                    "img_sec_per_rank_conf": conf, "img_sec_total": size * mean,
                    "img_sec_total_conf": size * conf}))
    if args.use_ddp:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
