"""CUDA only: a pluggable allocator whose failed ``cudaMalloc`` asks the SwapManager for room, then retries.

MindSpeed intercepts out-of-memory on NPU through ``NPUPluggableAllocator``; this is the same idea on
CUDA with ``torch.cuda.memory.CUDAPluggableAllocator`` and a small C++ shim built by
``torch.utils.cpp_extension.load_inline``. Imported only when asked for on a CUDA device
(``make_hook(..., pluggable=True)``); everywhere else the retry-at-the-op path of ``_oom.py`` is used.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ._hook import OomHook, Rescue

__all__ = ["CudaAllocatorHook"]

# Note: [cuda shim untested]. Written against the documented CUDAPluggableAllocator ABI
# (malloc(ssize_t, int, cudaStream_t) / free(void*, ssize_t, int, cudaStream_t)); it has never
# been compiled here (CPU-only torch, no nvcc). Every allocation goes straight to cudaMalloc
# (no caching), so a freed swap-out really returns device memory before the retry.
_CUDA_SHIM = r"""
#include <Python.h>
#include <sys/types.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>

static PyObject* g_rescue = nullptr;

void set_rescue(py::object fn) {
  PyObject* obj = fn.ptr();
  Py_XINCREF(obj);
  Py_XDECREF(g_rescue);
  g_rescue = obj;
}

extern "C" {
void* am_malloc(ssize_t size, int device, cudaStream_t stream) {
  void* ptr = nullptr;
  for (int attempt = 0; attempt < 8; ++attempt) {
    if (cudaMalloc(&ptr, size) == cudaSuccess) return ptr;
    cudaGetLastError();
    if (g_rescue == nullptr) return nullptr;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject* res = PyObject_CallFunction(g_rescue, "n", (Py_ssize_t)size);
    int freed = res != nullptr && PyObject_IsTrue(res) == 1;
    Py_XDECREF(res);
    if (res == nullptr) PyErr_Clear();
    PyGILState_Release(gil);
    if (!freed) return nullptr;
  }
  return nullptr;
}

void am_free(void* ptr, ssize_t size, int device, cudaStream_t stream) {
  cudaStreamSynchronize(stream);
  cudaFree(ptr);
}
}
"""

_cuda_lock = threading.Lock()
_cuda_module: Any = None


class CudaAllocatorHook(OomHook):
    """CUDA only: replace the allocator with the shim above; its failed ``cudaMalloc`` calls ``rescue``.

    Must run before the process makes its first CUDA allocation (PyTorch refuses to change the
    allocator afterwards); :func:`make_hook` falls back to :class:`RetryOnOom` when it cannot.
    """

    name = "cuda-pluggable"

    def __init__(self, rescue: Rescue, device: torch.device) -> None:
        super().__init__(rescue)
        global _cuda_module
        if not torch.cuda.is_available():
            raise RuntimeError("the CUDA pluggable allocator needs a CUDA build of torch and a GPU")
        from torch.utils.cpp_extension import load_inline

        with _cuda_lock:
            if _cuda_module is None:
                _cuda_module = load_inline(name="adaptive_mem_oom_shim", cpp_sources=[_CUDA_SHIM],
                                           functions=["set_rescue"], with_cuda=True,
                                           extra_ldflags=["-lcudart"], verbose=False)
        self.device = device
        allocator = torch.cuda.memory.CUDAPluggableAllocator(_cuda_module.__file__, "am_malloc", "am_free")
        torch.cuda.memory.change_current_allocator(allocator)
        _cuda_module.set_rescue(self._hook)

    def _hook(self, needed: int) -> bool:
        self.retries += 1
        return self.rescue(needed)

    def live(self) -> int | None:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def remove(self) -> None:
        if _cuda_module is not None:
            _cuda_module.set_rescue(None)
