"""A minimal ctypes binding of the NCCL library that PyTorch ships (unique id, init, broadcast, all-reduce).

Why not ``torch.cuda.nccl``: its ``init_rank`` fails on Python >= 3.12 with some
torch builds ("PY_SSIZE_T_CLEAN macro must be defined for '#' formats"), and the
vLLM protocol's unique-id rendezvous needs exactly ``ncclGetUniqueId`` +
``ncclCommInitRank``. The library is the one torch already loaded (or the
``nvidia-nccl`` wheel beside it), so nothing is downloaded or built.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from functools import lru_cache

import torch

NCCL_UNIQUE_ID_BYTES = 128
_SUM = 0  # ncclSum
_DTYPES = {  # ncclDataType_t
    torch.int8: 0, torch.uint8: 1, torch.bool: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
    torch.float32: 7, torch.float64: 8, torch.bfloat16: 9,
}  # fmt: skip


class NcclError(RuntimeError):
    """An NCCL call returned an error code."""


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


def _candidates() -> list[str]:
    names = ["libnccl.so.2", "libnccl.so"]
    for base in sys.path:
        names += sorted(glob.glob(os.path.join(base, "nvidia", "nccl", "lib", "libnccl.so*")))
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    names += sorted(glob.glob(os.path.join(torch_lib, "libnccl*.so*")))
    return names


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The NCCL shared library (the one torch uses when it is already loaded)."""
    errors = []
    for name in _candidates():
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            errors.append(f"{name}: {e}")
            continue
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(UniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
        lib.ncclBroadcast.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
        lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
        lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]
        lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
        return lib
    raise NcclError("could not load the NCCL library (is this a CUDA build of torch?): " + "; ".join(errors[-3:]))


def _check(code: int, what: str) -> None:
    if code != 0:
        msg = library().ncclGetErrorString(code).decode(errors="replace")
        raise NcclError(f"{what} failed with NCCL error {code}: {msg}")


def unique_id() -> bytes:
    """A fresh 128-byte NCCL unique id (rank 0 mints it; every rank passes it to :class:`Communicator`)."""
    uid = UniqueId()
    _check(library().ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return bytes(bytearray(uid.internal))


class Communicator:
    """One rank of an NCCL communicator bound to ``device``; collectives run on the current stream."""

    def __init__(self, world_size: int, uid: bytes, rank: int, device: torch.device) -> None:
        if len(uid) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        self.device = device
        cuid = UniqueId()
        ctypes.memmove(cuid.internal, uid, NCCL_UNIQUE_ID_BYTES)
        self._comm = ctypes.c_void_p()
        with torch.cuda.device(device):  # ncclCommInitRank binds to the current device
            _check(library().ncclCommInitRank(ctypes.byref(self._comm), world_size, cuid, rank), "ncclCommInitRank")

    def _stream(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)

    @staticmethod
    def _dtype(t: torch.Tensor) -> int:
        if t.dtype not in _DTYPES:
            raise TypeError(f"NCCL cannot move {t.dtype}; view it as uint8 first")
        return _DTYPES[t.dtype]

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        """In-place broadcast of a contiguous CUDA tensor from ``root``."""
        assert tensor.is_cuda and tensor.is_contiguous(), "broadcast needs a contiguous CUDA tensor"
        ptr = ctypes.c_void_p(tensor.data_ptr())
        code = library().ncclBroadcast(ptr, ptr, tensor.numel(), self._dtype(tensor), root, self._comm, self._stream())
        _check(code, "ncclBroadcast")

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        assert tensor.is_cuda and tensor.is_contiguous(), "all_reduce needs a contiguous CUDA tensor"
        ptr = ctypes.c_void_p(tensor.data_ptr())
        code = library().ncclAllReduce(ptr, ptr, tensor.numel(), self._dtype(tensor), _SUM, self._comm, self._stream())
        _check(code, "ncclAllReduce")

    def destroy(self) -> None:
        if self._comm:
            library().ncclCommDestroy(self._comm)
            self._comm = ctypes.c_void_p()

    def abort(self) -> None:
        """End the communicator with its collectives still in flight (a peer is gone): destroy would wait."""
        if self._comm:
            comm, self._comm = self._comm, ctypes.c_void_p()
            library().ncclCommAbort(comm)
