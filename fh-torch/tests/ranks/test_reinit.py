"""Rapid ``shutdown()``/``init()`` cycles, each with an allreduce, with a busy thread loading the
process: nothing of one engine may reach the next (the issue's "shutdown requested by another
rank" on a fresh engine, with a peer hung in an allreduce). Each world and each engine has its
own incarnation; a stale message is refused, never read as the new engine's."""

import threading

import torch

import fasthorovod.torch as hvd

CYCLES = 50


def test_rapid_reinit_cycles_each_with_an_allreduce():
    n, r = hvd.size(), hvd.rank()
    stop = threading.Event()

    def busy():
        x = torch.rand(64, 64)
        while not stop.is_set():
            x = (x @ x).clamp_(-1, 1)

    loader = threading.Thread(target=busy, daemon=True)
    loader.start()
    try:
        for cycle in range(CYCLES):
            hvd.shutdown()
            assert not hvd.is_initialized(), f"rank {r}: cycle {cycle}: still initialized"
            hvd.init()
            assert (hvd.rank(), hvd.size()) == (r, n), \
                f"rank {r}: cycle {cycle}: topology {(hvd.rank(), hvd.size())}"
            # Rank x sends [10 * cycle + x, x - cycle]: sums n * 10 * cycle + n(n-1)/2 and
            # n(n-1)/2 - n * cycle. The same name every cycle, as a re-initialising script has.
            t = torch.tensor([10.0 * cycle + r, float(r - cycle)])
            out = hvd.allreduce(t, name="reinit", op=hvd.Sum)
            want = [n * 10.0 * cycle + n * (n - 1) / 2, n * (n - 1) / 2 - n * cycle]
            for i, (g, w) in enumerate(zip(out.tolist(), want)):
                assert g == w, f"rank {r}: cycle {cycle}: element {i} is {g}, want {w}"
    finally:
        stop.set()
        loader.join(timeout=10)
    assert hvd.is_initialized()
