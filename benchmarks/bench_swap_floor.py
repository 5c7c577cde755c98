"""The floor under a whole-layer swap: a minimal C++ pack/unpack beside the runtime's swap engine.

    python benchmarks/bench_swap_floor.py [--models llama-tiny,hf:llama] [--rounds 32]

At batch 8 x seq 128, one thread, SGD step included (``bench_machinery.py``'s setting): plain; the runtime's
whole-layer swap of the first layers (up to 3; ``adaptive_mem.optimize``; on the CPU its storages up to the inline
copy size get the native records, Note: [native swap records] in ``adaptive_mem/runtime/_swap_store.cpp``); the same
with every save a Python record (the engine's native store switched off); and the
same layers' saved tensors through a minimal pack/unpack written in C++ (compiled here with
``torch.utils.cpp_extension.load_inline``): each storage saved in those layers copied once to a pooled host buffer
when first saved (later saves of it share the copy), copied back into a fresh buffer at its first unpack, the host
buffer back to the pool when the last save dies. Its saved-tensor hooks are entered per layer and called per saved
tensor from Python, and it has none of the runtime's other work: no parameter or input check, no prefetch
triggers, no copy thread or stream, no host budget or disk tier, no in-place check, no statistics, CPU only. Its
gradients are checked ``torch.equal`` to plain's before timing.

Each variant on its own copy of the model, one step of each per round (interleaved), after two untimed; medians.
The difference between the runtime's row and the C++ row is what the runtime's own work costs here beyond the
copies; the C++ row against ``bench_machinery.py``'s target (plain + the copies + 2 %) says what any record
would reach.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time
from typing import Any

import torch

from adaptive_mem import build_model, optimize
from profiler.naming import find_layers
from search import Action, Decision, Plan

BATCH, SEQ = 8, 128

_SOURCE = r"""
#include <torch/extension.h>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

// One saved storage's host copy; ``dev`` is the reloaded device copy (after the first unpack).
struct Stored {
  at::Tensor host, dev;
  int64_t nbytes;
};

// What autograd holds for one saved tensor: its storage's copy and its view of it.
struct View {
  std::shared_ptr<Stored> stored;
  at::ScalarType dtype;
  std::vector<int64_t> size, stride;
  int64_t offset;
};

static std::unordered_map<int64_t, std::vector<at::Tensor>> pool;  // free host buffers by size
// this step's stored storages: the weak reference keeps the StorageImpl's address from being reused
static std::unordered_map<c10::StorageImpl*,
                          std::pair<c10::weak_intrusive_ptr<c10::StorageImpl>, std::weak_ptr<Stored>>> seen;

static void give_back(Stored* s) {
  pool[s->nbytes].push_back(s->host);
  delete s;
}

std::shared_ptr<View> pack(const at::Tensor& t) {
  const c10::Storage& st = t.storage();
  c10::StorageImpl* impl = st.unsafeGetStorageImpl();
  std::shared_ptr<Stored> stored;
  auto it = seen.find(impl);
  if (it != seen.end() && !it->second.first.expired()) stored = it->second.second.lock();
  if (!stored) {
    int64_t n = st.nbytes();
    std::vector<at::Tensor>& free = pool[n];
    at::Tensor host;
    if (free.empty()) {
      host = at::empty({n}, at::kByte);
    } else {
      host = std::move(free.back());
      free.pop_back();
    }
    std::memcpy(host.data_ptr(), st.data(), n);
    stored = std::shared_ptr<Stored>(new Stored{host, at::Tensor(), n}, give_back);
    seen.insert_or_assign(impl, std::make_pair(st.getWeakStorageImpl(), std::weak_ptr<Stored>(stored)));
  }
  return std::make_shared<View>(View{stored, t.scalar_type(), t.sizes().vec(), t.strides().vec(),
                                     t.storage_offset()});
}

at::Tensor unpack(const std::shared_ptr<View>& v) {
  Stored& s = *v->stored;
  if (!s.dev.defined()) {
    s.dev = at::empty({s.nbytes}, at::kByte);
    std::memcpy(s.dev.data_ptr(), s.host.data_ptr(), s.nbytes);
  }
  at::Tensor out = at::empty({0}, s.dev.options().dtype(v->dtype));
  out.set_(s.dev.storage(), v->offset, v->size, v->stride);
  return out;
}

void new_step() { seen.clear(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<View, std::shared_ptr<View>>(m, "View");
  m.def("pack", &pack);
  m.def("unpack", &unpack);
  m.def("new_step", &new_step);
}
"""


def _extension() -> Any:
    from torch.utils.cpp_extension import load_inline

    return load_inline("adaptive_mem_swap_floor", cpp_sources=[_SOURCE], extra_cflags=["-O2"])


def floor_hooks(ext: Any, model: Any, layers: list[Any]) -> None:
    """Every tensor the given layer modules save goes through ``ext``'s pack and unpack (parameters stay)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    view = ext.View

    def pack(t: torch.Tensor) -> Any:
        if isinstance(t, torch.nn.Parameter) or t.untyped_storage()._cdata in params:
            return t
        return ext.pack(t)

    def unpack(x: Any) -> Any:
        return ext.unpack(x) if type(x) is view else x

    entered: list[Any] = []

    def pre(module: Any, args: Any) -> None:
        if module is layers[0]:
            ext.new_step()
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        entered.append(hooks)

    def post(module: Any, args: Any, output: Any) -> None:
        entered.pop().__exit__(None, None, None)

    for layer in layers:
        layer.register_forward_pre_hook(pre)
        layer.register_forward_hook(post)


def _variants(bundle: Any, ext: Any) -> list[tuple[str, Any, Any]]:
    info = find_layers(bundle.model)
    paths = [info.layer_path(i) for i in range(min(3, info.count))]
    span = f"layers 0-{len(paths) - 1}"
    out = []
    names = ("plain", f"runtime's whole-layer swap of {span}", "the same, Python records only",
             f"C++ pack/unpack of {span} (the floor)")
    for name in names:
        copy_ = copy.copy(bundle)
        copy_.model = copy.deepcopy(bundle.model)
        layers = [copy_.model.get_submodule(p) for p in paths]
        if name.startswith(("runtime", "the same")):
            handle = optimize(copy_.model, plan=Plan(decisions={p: Decision(Action.SWAP, backward_prefetch=1)
                                                                for p in paths}))
            if name.startswith("the same"):
                handle._executor.engine.store = None  # every save a Python record (Note: [native swap records])
        elif name.startswith("C++"):
            floor_hooks(ext, copy_.model, layers)
        out.append((name, copy_, torch.optim.SGD(copy_.model.parameters(), lr=1e-3)))
    return out


def _grads(bundle: Any, batch: Any) -> list[torch.Tensor]:
    bundle.loss(batch).backward()
    grads = [p.grad.clone() for p in bundle.model.parameters()]
    bundle.model.zero_grad(set_to_none=True)
    return grads


def run_model(spec: str, rounds: int, ext: Any) -> None:
    bundle = build_model(spec, batch_size=BATCH, seq_len=SEQ, seed=0)
    variants = _variants(bundle, ext)
    batches = [bundle.batch(seed=k) for k in range(rounds + 2)]
    plain = _grads(variants[0][1], batches[0])
    exact = all(torch.equal(a, b) for a, b in zip(plain, _grads(variants[-1][1], batches[0])))
    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    for k in range(rounds + 2):
        for name, copy_, opt in variants:
            start = time.perf_counter()
            copy_.loss(batches[k]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if k >= 2:
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["plain"])
    print(f"\n{spec} b{BATCH} s{SEQ}, 1 thread, medians of {rounds} interleaved rounds; the C++ variant's gradients "
          f"{'torch.equal to plain' if exact else 'DIFFER from plain'}")
    print("| variant | step ms | vs plain |\n|---|---|---|")
    for name, _, _ in variants:
        step = statistics.median(times[name])
        print(f"| {name} | {step * 1e3:.2f} | {(step / base - 1) * 100:+.1f} % |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-tiny,hf:llama")
    parser.add_argument("--rounds", type=int, default=32)
    args = parser.parse_args(argv)
    logging.getLogger("adaptive_mem").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    ext = _extension()
    for spec in args.models.split(","):
        run_model(spec, args.rounds, ext)
    return 0


if __name__ == "__main__":
    sys.exit(main())
