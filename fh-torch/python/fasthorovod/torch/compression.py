"""Gradient compression, as in Horovod: a compressor turns a tensor into what travels and back."""

import torch


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16; other tensors as they are."""

    @staticmethod
    def compress(tensor):
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype != torch.float16:
            return tensor.type(torch.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor, ctx):
        if ctx is not None and ctx != tensor.dtype:
            return tensor.type(ctx)
        return tensor


class Compression:
    """The compressors, under Horovod's names."""

    none = NoneCompressor
    fp16 = FP16Compressor
