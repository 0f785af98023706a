#!/usr/bin/env python3
"""Synthetic training throughput with FastHorovod, in the style of Horovod's
``pytorch_synthetic_benchmark.py``.

Every rank trains a CNN (built here: torchvision is not needed) on one random batch, over
and over, and reports images per second: per rank and in total, as mean +- 1.96 standard
deviations over the iterations. The model is VGG-16 (``--model vgg16``: torchvision's layout,
13 3x3 convolutions and 3 fully connected layers, 138.4 M parameters with 1000 classes; any
``--image-size`` down to 32, the classifier's shape unchanged) or a small ResNet-like one
(``--model resnet-like --model-size ...``). Apart from its import this is a Horovod script:
``--hvd-module horovod.torch`` (or ``HVD_MODULE=horovod.torch``) imports Horovod in place of
``fasthorovod.torch`` and runs the same code on it:

    fhrun -np 4 python pytorch_synthetic_benchmark.py --model vgg16 --batch-size 2
    horovodrun -np 4 python pytorch_synthetic_benchmark.py --model vgg16 --batch-size 2 \
        --hvd-module horovod.torch

``--use-ddp`` runs the same model and batch under PyTorch DistributedDataParallel on Gloo
instead, for the comparison (launch with torchrun's environment):

    python -m torch.distributed.run --nproc_per_node 4 pytorch_synthetic_benchmark.py --use-ddp

The last line rank 0 prints is a JSON summary (``{"benchmark": ...}``) for scripts.
"""

import argparse
import importlib
import json
import math
import os
import timeit

import torch
import torch.nn.functional as F

# The Horovod API this script runs on (the one line that differs from Horovod's script).
DEFAULT_HVD_MODULE = os.environ.get("HVD_MODULE", "fasthorovod.torch")

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


# VGG-16's convolutions (output channels; "M": 2x2 max pooling), as in torchvision's vgg16.
VGG16_LAYERS = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
                512, 512, 512, "M", 512, 512, 512, "M")


class VGG16(torch.nn.Module):
    """VGG-16 (configuration D, no batch norm) laid out as torchvision's ``vgg16``: 13 3x3
    convolutions with ReLU in five pooled stages, adaptive average pooling to 7x7 (so any image
    of at least 32x32 gives the same classifier), then 25088 -> 4096 -> 4096 -> classes with
    ReLU and dropout."""

    def __init__(self, num_classes):
        super().__init__()
        layers, cin = [], 3
        for v in VGG16_LAYERS:
            if v == "M":
                layers.append(torch.nn.MaxPool2d(2, 2))
            else:
                layers += [torch.nn.Conv2d(cin, v, 3, padding=1), torch.nn.ReLU(inplace=True)]
                cin = v
        self.features = torch.nn.Sequential(*layers)
        self.avgpool = torch.nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = torch.nn.Sequential(
            torch.nn.Linear(512 * 7 * 7, 4096), torch.nn.ReLU(inplace=True), torch.nn.Dropout(),
            torch.nn.Linear(4096, 4096), torch.nn.ReLU(inplace=True), torch.nn.Dropout(),
            torch.nn.Linear(4096, num_classes))

    def forward(self, x):
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def build_model(args):
    """The model ``args`` names: VGG-16 or the ResNet-like one of ``--model-size``."""
    if args.model == "vgg16":
        return VGG16(args.num_classes)
    return SmallResNet(args.model_size, args.num_classes)


def describe_model(args):
    """The model's name for the log."""
    if args.model == "vgg16":
        return "VGG-16"
    return f"ResNet-like '{args.model_size}'"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("resnet-like", "vgg16"), default="resnet-like",
                   help="the model: VGG-16 or a small ResNet-like CNN")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small",
                   help="size of the ResNet-like model")
    p.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
    p.add_argument("--image-size", type=int, default=32, help="square images of this side")
    p.add_argument("--num-classes", type=int, default=None,
                   help="classes of the classifier (default: 1000 for VGG-16, 100 otherwise)")
    p.add_argument("--num-warmup-batches", type=int, default=5,
                   help="batches before the timed iterations")
    p.add_argument("--num-batches-per-iter", type=int, default=5,
                   help="batches per timed iteration")
    p.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    p.add_argument("--fp16-allreduce", action="store_true",
                   help="compress gradients to float16 for the allreduce")
    p.add_argument("--use-ddp", action="store_true",
                   help="PyTorch DDP on Gloo instead of Horovod's API (torchrun's environment)")
    p.add_argument("--hvd-module", default=DEFAULT_HVD_MODULE,
                   help="the module imported as hvd: fasthorovod.torch (default; $HVD_MODULE "
                        "overrides) or horovod.torch")
    p.add_argument("--threads", type=int, default=1,
                   help="torch compute threads per rank (torch.set_num_threads)")
    args = p.parse_args(argv)
    if args.num_classes is None:
        args.num_classes = 1000 if args.model == "vgg16" else 100
    for name in ("batch_size", "image_size", "num_classes", "num_batches_per_iter",
                 "num_iters", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.num_warmup_batches < 0:
        p.error("--num-warmup-batches must be >= 0")
    if args.model == "vgg16" and args.image_size < 32:
        p.error("--image-size must be at least 32 for VGG-16 (five 2x2 poolings)")
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
        model = DistributedDataParallel(build_model(args))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        backend = "ddp-gloo"
    else:
        hvd = importlib.import_module(args.hvd_module)
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        model = build_model(args)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size)
        compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
        optimizer = hvd.DistributedOptimizer(optimizer,
                                             named_parameters=model.named_parameters(),
                                             compression=compression)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        backend = args.hvd_module.split(".")[0]

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
    log(f"Model: {describe_model(args)} ({params / 1e6:.2f} M parameters), "
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
                    "model": args.model, "model_size": args.model_size,
                    "image_size": args.image_size, "batch_size": args.batch_size,
                    "fp16_allreduce": args.fp16_allreduce, "img_sec_per_rank": mean,
                    "img_sec_per_rank_conf": conf, "img_sec_total": size * mean,
                    "img_sec_total_conf": size * conf}))
    if args.use_ddp:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
