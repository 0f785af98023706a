"""Checks shared by the rank suites: failure messages name this rank and the first element off."""

import torch

import fasthorovod.torch as hvd


def assert_close(got, want, what, atol=1e-5, rtol=1e-4):
    """Elementwise comparison (sparse tensors compared densely) whose message names this rank
    and the first element off."""
    got = got.detach().to_dense() if got.is_sparse else got.detach()
    want = want.detach().to_dense() if want.is_sparse else want.detach()
    me = hvd.rank()
    assert got.shape == want.shape, f"rank {me}: {what}: shape {list(got.shape)}, want " \
                                    f"{list(want.shape)}"
    bad = ~torch.isclose(got.to(torch.float64), want.to(torch.float64), atol=atol, rtol=rtol)
    if bad.any():
        idx = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"rank {me}: {what} element {idx}: got {got[idx].item()}, want "
                             f"{want[idx].item()} ({int(bad.sum())} of {bad.numel()} "
                             "elements differ)")
