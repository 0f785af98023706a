"""Which engine serves a process group of the ``fasthorovod`` backend, and how its world forms.

- **The default group** runs on the engine of ``fasthorovod.torch``: the one already running
  (``hvd.init()`` was called first), else the world of the launcher's environment (``fhrun``,
  ``torchrun``, ``mpirun``, Slurm; exactly what ``hvd.init()`` joins), else -- no launcher,
  ``init_process_group(store=..., rank=..., world_size=...)`` -- a world agreed through the
  store (below). torch's rank and world size must be the engine's.
- **A subgroup** (``new_group``) gets a world of its own among its members, agreed through the
  group's store, since torch asks only the members to create its backend (a Horovod process
  set is registered by every rank of the world, so it cannot serve here).

A world agreed through a store: every member counts itself in (``store.add``), which numbers
the worlds formed on this store; the group's rank 0 chooses its rendezvous address (the
address through which it reaches the store's host, or 127.0.0.1 when the world is on one
host, and a free port) and a nonce, and publishes them; the members read them and form an
ordinary world of the engine (its rendezvous, handshake, host facts, ``FH_TRANSPORT``). Its key
is ``FH_JOB_TOKEN`` (or, for a subgroup, the world's key) derived for the nonce; without
``FH_JOB_TOKEN`` the default group's rank 0 draws a token and publishes it too, so that world
is as private as the store.
"""

import datetime
import json
import os
import secrets
import socket

from fasthorovod import _core

# Store keys, under the group's own prefix.
_COUNT_KEY = "fasthorovod/members"
_WORLD_KEY = "fasthorovod/world/{}"


def _timeout_seconds():
    """``FH_TIMEOUT_SECONDS`` (the engine checks the value; 30 when unset or unreadable)."""
    try:
        t = float(os.environ.get("FH_TIMEOUT_SECONDS", "") or 30.0)
    except ValueError:
        t = 30.0
    return max(t, 1.0)


def _underlying(store):
    """The store under torch's ``PrefixStore`` wrappers."""
    seen = 0
    while hasattr(store, "underlying_store") and seen < 64:
        store = store.underlying_store
        seen += 1
    return store


def _store_host(store):
    """The host of the store's server (a ``TCPStore``), else ``MASTER_ADDR``, else None."""
    host = getattr(_underlying(store), "host", None)
    if isinstance(host, str) and host.strip() not in ("", "0.0.0.0", "::"):
        return host.strip()
    master = os.environ.get("MASTER_ADDR", "").strip()
    return master or None


def _address_toward(host):
    """This host's address on the route to ``host`` (no packet is sent): the address the
    store's other clients can reach us at. 127.0.0.1 for a loopback or unknown host."""
    if host is None:
        return "127.0.0.1"
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _rendezvous_address(store, world_on_one_host):
    """``host:port`` where this rank (a group's rank 0) will listen: a port free now on the
    address the members reach (the same probe ``fhrun`` makes for its rendezvous)."""
    addr = "127.0.0.1" if world_on_one_host else _address_toward(_store_host(store))
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        port = s.getsockname()[1]
    return f"[{addr}]:{port}" if family == socket.AF_INET6 else f"{addr}:{port}"


def _agree(store, rank, size, world_on_one_host, with_token):
    """Agree through ``store`` on a new world of ``size`` members: rank 0 publishes its
    rendezvous address, a nonce (and, with ``with_token``, a token it draws); every member
    returns what was published. Bounded by ``FH_TIMEOUT_SECONDS``."""
    n = store.add(_COUNT_KEY, 1)
    key = _WORLD_KEY.format((n - 1) // size)
    if rank == 0:
        plan = {"rendezvous": _rendezvous_address(store, world_on_one_host),
                "nonce": secrets.token_hex(16)}
        if with_token:
            plan["token"] = secrets.token_hex(32)
        store.set(key, json.dumps(plan))
        return plan
    timeout = _timeout_seconds()
    try:
        store.wait([key], datetime.timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001 - torch raises several kinds for a timeout
        raise RuntimeError(
            f"fasthorovod backend: rank 0 of the group did not publish its rendezvous address "
            f"in the torch store within {timeout:g} s (FH_TIMEOUT_SECONDS): is it alive, and "
            f"did every member call init_process_group/new_group? ({e})") from None
    return json.loads(bytes(store.get(key)).decode())


def environment_world():
    """``(launcher, rank, size, local_rank, local_size)`` of the world the environment
    describes, or None."""
    return _core.environment_world()


def export_torch_variables():
    """Give torch's default ``env://`` rendezvous what it reads (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) from the launcher's variables when torchrun's are
    absent: under ``fhrun`` (which also exports ``MASTER_ADDR`` and ``MASTER_PORT``),
    ``mpirun`` or ``srun``, ``init_process_group("fasthorovod")`` then needs no
    ``init_method``. Variables already set are kept; a bad launcher variable is left for
    ``init_process_group`` to report."""
    if os.environ.get("RANK") and os.environ.get("WORLD_SIZE"):
        return
    try:
        world = environment_world()
    except ValueError:
        return
    if world is None:
        return
    _, rank, size, local_rank, local_size = world
    for key, value in (("RANK", rank), ("WORLD_SIZE", size), ("LOCAL_RANK", local_rank),
                       ("LOCAL_WORLD_SIZE", local_size)):
        if not os.environ.get(key):
            os.environ[key] = str(value)


def start_default(store, rank, size):
    """Start (or find) the engine of the default group; returns whether the backend owns it
    (started it, so that destroying the group shuts it down)."""
    from fasthorovod.torch.mpi_ops import _basics

    if _core.is_initialized():
        _check_same_world("the running FastHorovod runtime (hvd.init() was called first)",
                          rank, size)
        return False
    if _core.elastic_enabled():
        raise NotImplementedError(
            "init_process_group('fasthorovod') in an elastic fhrun job is not supported: use "
            "fasthorovod.torch.elastic (hvd.elastic.run) for elastic training")
    env = environment_world()
    if env is not None:
        launcher, env_rank, env_size = env[:3]
        if (env_rank, env_size) != (rank, size):
            raise ValueError(
                f"init_process_group('fasthorovod') was given rank {rank} of {size}, but the "
                f"{launcher} environment of this process says rank {env_rank} of {env_size}: "
                f"the fasthorovod backend runs on the launcher's world, so pass the "
                f"launcher's rank and world size (or none)")
        _basics.init()
        return True
    if size == 1:
        _basics.init()
        return True
    with_token = not os.environ.get("FH_JOB_TOKEN")
    plan = _agree(store, rank, size, world_on_one_host=False, with_token=with_token)
    _basics.start(None, lambda: _core.init(rank=rank, size=size, rendezvous=plan["rendezvous"],
                                           label=plan["nonce"], token=plan.get("token")))
    _check_same_world("the world agreed through the store", rank, size)
    return True


def _check_same_world(what, rank, size):
    engine_rank, engine_size = _core.topology()[:2]
    if (engine_rank, engine_size) != (rank, size):
        raise ValueError(
            f"init_process_group('fasthorovod') was given rank {rank} of {size}, but "
            f"{what} has this process as rank {engine_rank} of {engine_size}: the default "
            f"group must be the engine's world")


def start_subgroup(store, group_rank, group_size, group_name):
    """Form the world of a subgroup among its members (collective over them); returns its
    engine's id (the ``process_set_id`` the submissions take)."""
    on_one_host = _core.topology()[5] == 1
    plan = _agree(store, group_rank, group_size, world_on_one_host=on_one_host,
                  with_token=False)
    return _core.group_start(group_rank, group_size, plan["rendezvous"],
                             f"{group_name};{plan['nonce']}")


def start_single_group():
    """The world of a subgroup of one member (no rendezvous)."""
    return _core.group_start(0, 1, "", "")
