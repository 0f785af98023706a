"""``torch.distributed`` on FastHorovod: ``import fasthorovod.torch.distributed`` registers the
backend ``"fasthorovod"``, so that a DDP, FSDP or plain ``torch.distributed`` script runs on
FastHorovod's engine by changing one string::

    import torch.distributed as dist
    import fasthorovod.torch.distributed  # noqa: F401 - registers the backend

    dist.init_process_group("fasthorovod")          # was: "gloo"
    model = torch.nn.parallel.DistributedDataParallel(model)

The world is the engine's: under ``torchrun`` or ``fhrun`` the launcher's (the same rendezvous,
job token, transports and host facts as ``fasthorovod.torch.init()``, which it shares: a
script may use both); with an explicit ``store``, ``rank`` and ``world_size`` and no launcher,
one agreed through the store. Subgroups (``new_group``) form worlds of their own among their
members. See ``fh-torch/README.md`` ("torch.distributed backend") for what is supported.
"""

import torch.distributed as _dist

from fasthorovod.torch.distributed import _world
from fasthorovod.torch.distributed._backend import NAME, ProcessGroupFastHorovod

__all__ = ["NAME", "ProcessGroupFastHorovod", "register"]


def _create(options, backend_options=None):
    """torch's creator (extended API): the backend of one group on this member."""
    store = options.store
    rank, size = int(options.group_rank), int(options.group_size)
    group_name = str(options.group_id)
    global_ranks = list(options.global_ranks_in_group)
    if not global_ranks:
        owns = _world.start_default(store, rank, size)
        return ProcessGroupFastHorovod(rank, size, 0, group_name, owns)
    if size == 1:
        ps = _world.start_single_group()
    else:
        ps = _world.start_subgroup(store, rank, size, group_name)
    return ProcessGroupFastHorovod(rank, size, ps, group_name, True)


def register():
    """Register the backend ``"fasthorovod"`` with ``torch.distributed`` (done on import;
    calling it again does nothing)."""
    if NAME.upper() in getattr(_dist.Backend, "_plugins", {}):
        return
    _dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])


register()
_world.export_torch_variables()
