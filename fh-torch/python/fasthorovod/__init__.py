"""FastHorovod: fast data-parallel collectives; ``fasthorovod.torch`` is a drop-in for
``horovod.torch``.

Replace ``import horovod.torch as hvd`` with ``import fasthorovod.torch as hvd`` and launch with
``fhrun -np N python train.py`` (or ``torchrun``, ``mpirun``, ``srun``).
"""

from fasthorovod._core import __version__  # noqa: F401
