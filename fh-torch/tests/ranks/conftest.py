"""Runs on every rank: `fhrun -np N python -m pytest fh-torch/tests/ranks`. Every rank runs the
same tests in the same order, so that their collectives meet."""

import torch

import fasthorovod.torch as hvd


def pytest_configure(config):
    hvd.init()
    torch.manual_seed(1234)


def pytest_unconfigure(config):
    hvd.shutdown()
