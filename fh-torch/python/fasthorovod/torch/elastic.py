"""Horovod's ``horovod.torch.elastic`` (elastic training: ranks joining and leaving a running
job). FastHorovod has no elastic mode: each name here exists so that scripts import, and
raises ``NotImplementedError`` naming itself and what to use instead when used."""

_INSTEAD = ("FastHorovod has no elastic training: run a fixed-size job (fhrun -np N, torchrun, "
            "mpirun or srun) and restart it from a checkpoint to change its size")


def _unsupported(what):
    return NotImplementedError(f"hvd.elastic.{what} is not supported: {_INSTEAD}")


def run(func):
    """Horovod's decorator that reruns ``func`` after a membership change: not supported."""
    raise _unsupported("run")


class ObjectState:
    """Horovod's elastic state of plain objects: not supported."""

    def __init__(self, *args, **kwargs):
        raise _unsupported("ObjectState")


class TorchState(ObjectState):
    """Horovod's elastic state of a model and optimizer: not supported."""

    def __init__(self, *args, **kwargs):
        raise _unsupported("TorchState")


class ElasticSampler:
    """Horovod's sampler that re-partitions a data set when ranks change: not supported (use
    ``torch.utils.data.distributed.DistributedSampler(num_replicas=hvd.size(),
    rank=hvd.rank())``)."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "hvd.elastic.ElasticSampler is not supported: FastHorovod has no elastic training; "
            "use torch.utils.data.distributed.DistributedSampler(dataset, "
            "num_replicas=hvd.size(), rank=hvd.rank())")


__all__ = ["run", "ObjectState", "TorchState", "ElasticSampler"]
