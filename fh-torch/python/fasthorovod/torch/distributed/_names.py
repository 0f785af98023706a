"""The names of the ``fasthorovod`` backend's collectives.

A name is a function of the collective's place in the group's sequence and of a
period the members agree on, never of the tensors, so that ranks that disagree on a collective
(its kind, shape, dtype, op or root) meet under one name and fail with the engine's error
naming the ranks on each side; and names come back when the group's sequence of collectives
repeats (DDP's buckets, step after step), so that the engine negotiates them through its
bit-vector cache.
"""

import collections
import threading

import torch

from fasthorovod import _core


def _sig(*parts):
    """A collective's signature for the period search: its kind and arguments, tensors by
    dtype and shape."""
    out = []
    for p in parts:
        if isinstance(p, torch.Tensor):
            out.append((str(p.dtype), tuple(p.shape)))
        elif isinstance(p, (list, tuple)):
            out.append(_sig(*p))
        else:
            out.append(p)
    return tuple(out)


class _Namer:
    """The names of a group's collectives, the same on every member.

    torch requires every member to issue a group's collectives in the same order, so the
    ``n``-th collective is the same operation everywhere. Until the members agree on a period
    it is named ``tdist.<n>`` (used once: negotiated through the engine's coordinator). Every
    ``CHECK`` collectives the members agree, with one small allreduce issued at the same ``n``
    everywhere and applied ``CHECK`` collectives later (it is not waited for in between, so the
    collectives after it are not held up behind it), on the period of their sequence of
    signatures up to the ``n`` it was issued at: each takes the ``p`` (up
    to ``LONGEST``) whose repetition reaches furthest back in its history (at least twice; the
    shortest such ``p`` on a tie), so that a step's run of equal collectives (DDP's equal
    buckets, a transformer's layers) does not pass for the period of the whole step; the period
    is taken when every member found the same one. From then on the ``n``-th collective is
    ``tdist.<base>+<P>.<(n - base) mod S>``, ``S`` the smallest multiple of ``P`` of at least
    ``DEPTH`` (``RUN`` for ``P`` = 1, below): the names of a training step come back at the next step with the same
    signatures, and the engine negotiates them through its bit-vector cache. A name is a
    function of ``n`` and the agreed period alone, so members that disagree on a collective
    still meet under one name and fail with the engine's error naming them; a sequence that
    stops repeating costs the cache a changed slot, and the next agreement applied falls back
    to names used once. A name is reused only after the collective that last had it has completed on
    this rank (``S`` names apart: at least ``DEPTH`` collectives may be in flight however short
    the period; and a period agreed anew, at ``base``, starts names of its own).

    Period 1 is a run of one collective: a loop of the same collective, or -- in DDP's first
    steps, before a whole step is in the history -- a step's run of equal buckets (a
    transformer's), which is agreed until the next agreement finds the step's period. Its
    names are ``RUN`` apart, not ``DEPTH``: DDP submits every bucket of a backward before it
    waits for any, and with names 4 apart the thread that runs DDP's hooks waited at each
    bucket for the one 4 before it to complete (10-50 ms each, 4 ranks on 2 cores). Longer
    periods keep ``S`` small, so that a step's names come back -- and hit the cache -- at the
    next step."""

    CHECK = 8
    LONGEST = 256
    DEPTH = 4
    RUN = 64

    def __init__(self, process_set_id):
        self._ps = process_set_id
        self._n = 0
        self._period = 0
        self._span = 0
        self._base = 0
        self._history = collections.deque(maxlen=2 * self.LONGEST)
        self._holders = {}  # reused name -> the ``done`` event of the op that has it now
        self._pending = None  # the last agreement issued: (handle, its tensor)
        self._lock = threading.Lock()

    @property
    def period(self):
        """The agreed period (0: none; names are used once)."""
        return self._period

    def claim(self, sig):
        """The next name, for a collective of signature ``sig``, and the ``done`` event of the
        op that had that name last (to be set before the name is submitted again), or None."""
        with self._lock:
            n = self._n
            if n and n % self.CHECK == 0:
                self._agree(n)
            self._n += 1
            self._history.append(sig)
            if not self._period:
                return f"tdist.{n}", None
            name = f"tdist.{self._base}+{self._period}.{(n - self._base) % self._span}"
            return name, self._holders.get(name)

    def hold(self, name, done):
        """The op whose ``done`` event this is has ``name`` now (names used once are not
        kept)."""
        if "+" not in name:
            return
        with self._lock:
            self._holders[name] = done

    @classmethod
    def period_of(cls, history):
        """The period of a sequence of signatures: the ``p`` (1 to ``LONGEST``) whose
        repetition covers the longest end of ``history``, at least ``2p`` long (the shortest
        ``p`` among equals); 0 when none repeats."""
        h = list(history)
        size = len(h)
        best, covered = 0, 0
        for p in range(1, min(cls.LONGEST, size // 2) + 1):
            if covered == size:
                break  # nothing can cover more; longer periods only tie
            i = size - 1 - p  # h[i] == h[i + p] for every i above this one
            while i >= 0 and h[i] == h[i + p]:
                i -= 1
            length = size - 1 - i  # the end of the history that repeats with period p
            if length >= 2 * p and length > covered:
                best, covered = p, length
        return best

    def _agree(self, n):
        """At the same ``n`` everywhere: apply the agreement issued ``CHECK`` collectives ago
        (its period starts at ``n``), then issue the next one, on the history up to ``n``."""
        if self._pending is not None:
            handle, both = self._pending
            self._pending = None
            handle.wait()  # issued CHECK collectives ago: done by now, as a rule
            most, least = int(both[0]), -int(both[1])
            self._apply(most if most == least else 0, n)
        mine = self.period_of(self._history)
        both = torch.tensor([mine, -mine], dtype=torch.int64)
        handle = _core.allreduce(both, name=f"tdist.agree.{n}", op="max",
                                 process_set_id=self._ps)
        self._pending = (handle, both)

    def _apply(self, agreed, n):
        """Name the collectives from the ``n``-th on by the period ``agreed`` (0: none)."""
        if agreed != self._period:
            self._period, self._base = agreed, n
            self._span = self.span_of(agreed)
            self._holders.clear()

    @classmethod
    def span_of(cls, period):
        """``S``: how many names apart a name comes back under ``period`` (0: none)."""
        if period == 1:
            return cls.RUN
        return period * -(-cls.DEPTH // period) if period else 0
