"""FastHorovod: fast data-parallel collectives; ``fasthorovod.torch`` is a drop-in for
``horovod.torch``.

Replace ``import horovod.torch as hvd`` with ``import fasthorovod.torch as hvd`` and launch with
``fhrun -np N python train.py`` (or ``torchrun``, ``mpirun``, ``srun``).

``__version__`` is the FastHorovod release (``fhrun --version`` names the same one when both
come from one wheel); ``PROTOCOL_VERSION`` is the version of the wire protocol its ranks speak.
Every rank of a job, and the ``fhrun`` that starts them, must be of the same release: a
difference stops the job with an error naming both.
"""

from fasthorovod._core import PROTOCOL_VERSION, __version__  # noqa: F401
from fasthorovod._compat import TORCH_MIN  # noqa: F401
