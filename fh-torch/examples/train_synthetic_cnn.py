#!/usr/bin/env python3
"""Train a small CNN on synthetic data with FastHorovod.

Apart from its import this is a plain Horovod training script: change
``import fasthorovod.torch as hvd`` to ``import horovod.torch as hvd`` and it runs on Horovod.
It downloads nothing: every rank makes its own batches from a seed (an image's label is where
its bright patch is), so the script also serves as a correctness check:

    fhrun -np 2 python train_synthetic_cnn.py --steps 20 --save /tmp/params-{rank}.pt
    python train_synthetic_cnn.py --steps 20 --concat-ranks 2 --save /tmp/params-ref.pt

The two ranks end with bit-identical parameters, and (to float tolerance) the same parameters
as one process training on the two ranks' batches concatenated (``--concat-ranks 2``), since
DistributedOptimizer averages the ranks' gradients.
"""

import argparse

import torch
import torch.nn.functional as F

import fasthorovod.torch as hvd


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, kernel_size=3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 16, kernel_size=3, padding=1)
        self.fc1 = torch.nn.Linear(16 * 3 * 3, 32)
        self.fc2 = torch.nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def batch(seed, step, rank, size):
    """Rank ``rank``'s batch of step ``step``: noisy 12x12 images with a bright 3x3 patch at
    one of ten places; the label is the place."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    y = torch.randint(0, 10, (size,), generator=g)
    x = 0.5 * torch.randn(size, 1, 12, 12, generator=g)
    for i, label in enumerate(y.tolist()):
        row, col = divmod(label, 4)
        x[i, 0, 1 + 4 * row:4 + 4 * row, 1 + 3 * col:4 + 3 * col] += 2.0
    return x, y


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--fp16-allreduce", action="store_true")
    p.add_argument("--concat-ranks", type=int, default=0,
                   help="(single process) train on the batches of this many ranks, "
                        "concatenated: the reference for an N-rank run")
    p.add_argument("--save", default=None, help="save the parameters here ({rank} is replaced)")
    args = p.parse_args()

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    if args.concat_ranks and hvd.size() != 1:
        raise SystemExit("--concat-ranks is for a single process")

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)

    for step in range(args.steps):
        if args.concat_ranks:
            parts = [batch(args.seed, step, r, args.batch_size) for r in range(args.concat_ranks)]
            x = torch.cat([a for a, _ in parts])
            y = torch.cat([b for _, b in parts])
        else:
            x, y = batch(args.seed, step, hvd.rank(), args.batch_size)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            avg = metric_average(loss.item(), "avg_loss")
            if hvd.rank() == 0:
                print(f"step {step:4d}  loss {avg:.4f}", flush=True)

    if args.save:
        torch.save(model.state_dict(), args.save.format(rank=hvd.rank()))
    hvd.shutdown()


if __name__ == "__main__":
    main()
