// The CPU swap store: the swap engine's per-storage records in C++ (built with _cpu_allocator.cpp into one
// extension by _cpu_allocator.py; the Python side is _native_swap.py).
//
// Note: [native swap records]. On the CPU the swap engine copies a storage of up to the copier's inline size
// inline (Note: [inline copies] in _copier.py) and reloads it at its first unpack (Note: [reload at the
// unpack]): its record has no copy thread, stream or trigger to deal with, only bookkeeping, which in Python
// cost more than the bytes (benchmarks/README "The floor under the swap engine"). Such storages get a
// record here: the save copies the whole storage into a host buffer from a free list by size (a new buffer
// only when the host budget takes its bytes: HostBudget.take, called with the GIL held from the save), the
// first unpack copies it back into a fresh device buffer and returns the host buffer to the free list, each
// unpack rebuilds its view (dtype, size, stride, offset) on that buffer. A later save of the same storage in
// the same forward while a save of it is alive shares the record (Note: [swap by storage]); a record whose
// saves all died is gone, and a later save makes a new one (Note: [dead record]). The saved tensor's version
// counter is kept: an unpack after an in-place change fails with autograd's message (Note: [in-place after
// save]). Host buffers are allocated as host memory (never counted as device bytes); every op runs with the
// Python dispatch keys excluded, so no dispatch mode of the caller sees the store's ops (as on the copy
// thread). Larger storages, DTensor shards, accelerators and the file store keep the Python records.
//
// Note: [overlapped native copies]. With ``overlap`` set (the engine sets it where the compute's threads leave a
// core free: _native_swap.py) the store takes CPU storages of any size (the engine's limit), and its copies run
// on one C++ worker thread instead of inline, in issue order
// (a record's copy back never overtakes its copy out): the save takes the host buffer and queues the copy, the
// source storage kept alive by the job until its bytes have landed (then its device bytes go, as a stream's
// copy frees them at its event); a record asked to prefetch waits in ``pending`` under its trigger layer, and
// the engine's backward trigger (``prefetch``) allocates its device buffer on the calling thread (where an
// out-of-memory error is caught and the record deferred to the next trigger, as one over the free ``room``) and
// queues the copy back. An unpack and a dead record's destructor wait for the record's copies, ``evict`` and
// ``close`` for all. The worker (_swap_worker.h) never takes the GIL, so every wait may hold it; the bytes of
// queued copies out are bounded by ``window_bytes`` (a save waits beyond it). The sources of landed copies out
// are dropped by the store's next call (a save, an unpack, a trigger, a forward's start or end, a drain).
#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include "_swap_worker.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace adaptive_mem_native {
void host_enter();  // _cpu_allocator.cpp: allocations on this thread are host memory until host_exit
void host_exit();
}  // namespace adaptive_mem_native

namespace {

c10::DispatchKeySet python_keys() {
  return c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot});
}

struct Store;

struct Stored {  // one swapped storage
  std::shared_ptr<Store> store;
  at::Tensor host;  // the host copy, until the first unpack brought it back
  at::Tensor dev;   // the copy back's buffer: a prefetch's (queued or landed) or the first unpack's
  int64_t nbytes;
  c10::VariableVersion version;  // the saved tensor's version counter (its views share it)
  uint32_t saved_version;
  bool served = false;  // an unpack took dev: the host buffer is back in the free list
  int trigger;          // the backward trigger layer of its prefetch (-1: the plan asked none)
  int jobs = 0;         // its copies queued or running on the worker (under the worker's lock)
  std::string label;
  Stored(std::shared_ptr<Store> s, at::Tensor h, int64_t n, const at::Tensor& t, int trig, std::string l)
      : store(std::move(s)), host(std::move(h)), nbytes(n), version(t.unsafeGetTensorImpl()->version_counter()),
        saved_version(version.enabled() ? version.current_version() : 0), trigger(trig), label(std::move(l)) {}
  ~Stored();
};

struct Store : std::enable_shared_from_this<Store> {
  std::mutex mu;
  py::object take, give;  // the host budget's take(nbytes) -> bool and give(nbytes)
  std::unordered_map<int64_t, std::vector<at::Tensor>> free;  // host buffers by size
  std::unordered_map<c10::StorageImpl*, std::pair<c10::weak_intrusive_ptr<c10::StorageImpl>, std::weak_ptr<Stored>>>
      seen;  // this forward's records; the weak reference keeps the StorageImpl's address from being reused
  std::map<int, std::vector<std::weak_ptr<Stored>>> pending;  // prefetches by trigger layer (overlap only)
  std::vector<std::weak_ptr<Stored>> reloads;                 // prefetches queued since the forward began
  // read from Python as attributes of the same names (the swap statistics, the host bytes)
  int64_t allocated_bytes = 0, in_use_bytes = 0;    // host bytes: all buffers / those holding a copy
  int64_t offloaded_bytes = 0, reloaded_bytes = 0;  // bytes copied out / back (cumulative)
  int64_t on_demand_reloads = 0, records = 0;       // reloads for want of a prefetch; records made (cumulative)
  bool closed = false;
  bool overlap = false;  // Note: [overlapped native copies]
  adaptive_mem_native::CopyWorker worker;  // its ``skip``: timing only (bench_machinery.py), the bytes not moved

  Store(py::object take_, py::object give_) : take(std::move(take_)), give(std::move(give_)) {}

  at::Tensor acquire(int64_t n) {  // called with the GIL held
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = free.find(n);
      if (it != free.end() && !it->second.empty()) {
        at::Tensor buf = std::move(it->second.back());
        it->second.pop_back();
        in_use_bytes += n;
        return buf;
      }
    }
    if (closed || !take(n).cast<bool>()) return at::Tensor();
    at::Tensor buf;
    adaptive_mem_native::host_enter();
    try {
      c10::impl::ExcludeDispatchKeyGuard guard(python_keys());
      buf = at::empty({n}, at::kByte);
    } catch (...) {
      adaptive_mem_native::host_exit();
      give(n);
      throw;
    }
    adaptive_mem_native::host_exit();
    std::lock_guard<std::mutex> lock(mu);
    allocated_bytes += n;
    in_use_bytes += n;
    return buf;
  }

  void release(at::Tensor buf) {
    const int64_t n = buf.numel();
    {
      std::lock_guard<std::mutex> lock(mu);
      in_use_bytes -= n;
      if (!closed) {
        free[n].push_back(std::move(buf));
        return;
      }
      allocated_bytes -= n;
    }
    buf.reset();
    if (Py_IsInitialized()) {  // closed: the bytes go back to the budget
      py::gil_scoped_acquire gil;
      give(n);
    }
  }

  void new_forward() {  // forgets this forward's storages and the prefetches of dead records
    worker.reap();
    std::lock_guard<std::mutex> lock(mu);
    seen.clear();
    for (auto it = pending.begin(); it != pending.end();) {
      auto& v = it->second;
      v.erase(std::remove_if(v.begin(), v.end(), [](const auto& w) { return w.expired(); }), v.end());
      it = v.empty() ? pending.erase(it) : std::next(it);
    }
  }

  int last_trigger() {  // the highest trigger layer a prefetch waits for (-1: none)
    std::lock_guard<std::mutex> lock(mu);
    return pending.empty() ? -1 : pending.rbegin()->first;
  }

  bool has_trigger(int layer) {  // a prefetch waits for the trigger at exactly this layer
    std::lock_guard<std::mutex> lock(mu);
    return pending.count(layer) > 0;
  }

  py::object offload(const at::Tensor& t, const std::string& label, int trigger, int64_t limit);
  void prefetch(int layer, int64_t room);
  int64_t evict(int64_t needed);
  int64_t close();
};

Stored::~Stored() {
  store->worker.wait(jobs);
  if (host.defined()) store->release(std::move(host));
}

struct Handle {  // what autograd holds for one save
  std::shared_ptr<Stored> stored;
  at::ScalarType dtype;
  std::vector<int64_t> size, stride;
  int64_t offset;

  at::Tensor unpack() {
    Stored& s = *stored;
    if (s.version.enabled() && s.version.current_version() != s.saved_version) {
      throw std::runtime_error("one of the variables needed for gradient computation has been modified by an "
                               "inplace operation (swapped activation of " + s.label + ")");
    }
    c10::impl::ExcludeDispatchKeyGuard guard(python_keys());
    if (!s.served) {
      Store& store = *s.store;
      store.worker.wait(s.jobs);  // its copy out, and a prefetch's copy back
      store.worker.reap();
      const bool prefetched = s.dev.defined();
      if (!prefetched) {
        at::Tensor dev = at::empty({s.nbytes}, at::kByte);  // device bytes: may run the out-of-memory rescue
        if (!store.worker.skip) std::memcpy(dev.data_ptr(), s.host.data_ptr(), s.nbytes);
        s.dev = std::move(dev);
      }
      s.served = true;
      {
        std::lock_guard<std::mutex> lock(store.mu);
        store.reloaded_bytes += s.nbytes;
        // reloaded here for want of a prefetch: none asked, or (overlapped) none issued in time
        store.on_demand_reloads += s.trigger < 0 || (!prefetched && store.overlap);
      }
      store.release(std::move(s.host));
    }
    at::Tensor out = at::empty({0}, at::TensorOptions().dtype(dtype));
    out.set_(s.dev.storage(), offset, size, stride);
    return out;
  }
};

py::object Store::offload(const at::Tensor& t, const std::string& label, int trigger, int64_t limit) {
  const c10::Storage& st = t.storage();
  const int64_t n = static_cast<int64_t>(st.nbytes());
  if (n == 0 || n > limit || st.device_type() != c10::DeviceType::CPU || st.data() == nullptr) return py::none();
  if (overlap) worker.reap();
  c10::StorageImpl* impl = st.unsafeGetStorageImpl();
  std::shared_ptr<Stored> stored;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = seen.find(impl);
    if (it != seen.end() && !it->second.first.expired()) stored = it->second.second.lock();
  }
  if (!stored) {  // Note: [dead record]: a record whose saves all died is not reused
    at::Tensor host = acquire(n);
    if (!host.defined()) return py::none();  // over the host budget: the Python records (disk tier)
    stored = std::make_shared<Stored>(shared_from_this(), std::move(host), n, t, trigger, label);
    if (overlap) {
      worker.submit({stored->host.data_ptr(), st.data(), n, &stored->jobs, st});
    } else if (!worker.skip) {
      std::memcpy(stored->host.data_ptr(), st.data(), n);
    }
    std::lock_guard<std::mutex> lock(mu);
    seen.insert_or_assign(impl, std::make_pair(st.getWeakStorageImpl(), std::weak_ptr<Stored>(stored)));
    if (overlap && trigger >= 0) pending[trigger].push_back(stored);
    offloaded_bytes += n;
    records += 1;
  }
  return py::cast(Handle{std::move(stored), t.scalar_type(), t.sizes().vec(), t.strides().vec(),
                         t.storage_offset()});
}

// Queues the copies back of the prefetches due at ``layer`` or later, the latest trigger first, each while its
// bytes fit ``room`` (< 0: unknown) and its buffer allocates; the rest wait for the trigger below.
void Store::prefetch(int layer, int64_t room) {
  worker.reap();
  std::vector<std::shared_ptr<Stored>> due;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = pending.lower_bound(layer); it != pending.end(); it = pending.erase(it)) {
      for (auto& w : it->second) {
        if (auto s = w.lock()) due.push_back(std::move(s));
      }
    }
  }
  std::vector<std::shared_ptr<Stored>> deferred;
  for (auto it = due.rbegin(); it != due.rend(); ++it) {
    Stored& s = **it;
    if (s.served || s.dev.defined()) continue;
    if (closed || (room >= 0 && s.nbytes > room)) {
      deferred.push_back(*it);
      continue;
    }
    try {
      c10::impl::ExcludeDispatchKeyGuard guard(python_keys());
      s.dev = at::empty({s.nbytes}, at::kByte);
    } catch (const c10::OutOfMemoryError&) {
      deferred.push_back(*it);
      continue;
    }
    room -= room >= 0 ? s.nbytes : 0;
    worker.submit({s.dev.data_ptr(), s.host.data_ptr(), s.nbytes, &s.jobs, c10::Storage()});
    std::lock_guard<std::mutex> lock(mu);
    reloads.push_back(*it);
  }
  if (!deferred.empty() && layer > 0) {
    std::lock_guard<std::mutex> lock(mu);
    auto& below = pending[layer - 1];
    for (auto& s : deferred) below.push_back(s);
  }
}

// Drops the device buffers of prefetches not yet served (their host copies stay), the trigger below the others
// first (needed last): up to ``needed`` bytes; each goes back to wait for its trigger or its unpack.
int64_t Store::evict(int64_t needed) {
  worker.drain();
  std::vector<std::shared_ptr<Stored>> live;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& w : reloads) {
      auto s = w.lock();
      if (s && !s->served && s->dev.defined()) live.push_back(std::move(s));
    }
    reloads.clear();
    for (auto& s : live) reloads.push_back(s);
  }
  std::stable_sort(live.begin(), live.end(), [](const auto& a, const auto& b) { return a->trigger < b->trigger; });
  int64_t freed = 0;
  for (auto& s : live) {
    if (freed >= needed) break;
    s->dev.reset();
    freed += s->nbytes;
    std::lock_guard<std::mutex> lock(mu);
    pending[std::max(s->trigger, 0)].push_back(s);
  }
  return freed;
}

int64_t Store::close() {  // drops the free buffers; returns their bytes (for the budget)
  worker.stop();
  worker.reap();
  std::vector<at::Tensor> drop;
  int64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    closed = true;
    seen.clear();
    pending.clear();
    reloads.clear();
    for (auto& entry : free) {
      for (auto& buf : entry.second) {
        bytes += buf.numel();
        drop.push_back(std::move(buf));
      }
    }
    free.clear();
    allocated_bytes -= bytes;
  }
  return bytes;
}

#include "_layer_pack.h"

}  // namespace

namespace adaptive_mem_native {

void bind_swap_store(py::module_& m) {
  bind_layer_packer(m);
  py::class_<Stored, std::shared_ptr<Stored>>(m, "SwapRecord")  // one per storage: the saves of it share it
      .def_readonly("nbytes", &Stored::nbytes)
      .def_readonly("label", &Stored::label);
  py::class_<Handle>(m, "SwapHandle")
      .def("unpack", &Handle::unpack)
      .def_readonly("record", &Handle::stored);
  py::class_<Store, std::shared_ptr<Store>>(m, "SwapStore")
      .def(py::init<py::object, py::object>(), py::arg("take"), py::arg("give"))
      .def("offload", &Store::offload, py::arg("tensor"), py::arg("label"), py::arg("trigger"), py::arg("limit"))
      .def("prefetch", &Store::prefetch, py::arg("layer"), py::arg("room"))
      .def("evict", &Store::evict, py::arg("needed"))
      .def("drain", [](Store& s) { return s.worker.drain(); })
      .def("new_forward", &Store::new_forward)
      .def("close", &Store::close)
      .def_property(
          "skip_copies", [](const Store& s) { return s.worker.skip.load(); },
          [](Store& s, bool v) { s.worker.skip = v; })
      .def_readwrite("overlap", &Store::overlap)
      .def_property(
          "window_bytes", [](const Store& s) { return s.worker.window_bytes; },
          [](Store& s, int64_t v) { s.worker.window_bytes = v; })
      .def_property_readonly("last_trigger", &Store::last_trigger)
      .def("has_trigger", &Store::has_trigger, py::arg("layer"))
      .def_readonly("offloaded_bytes", &Store::offloaded_bytes)
      .def_readonly("reloaded_bytes", &Store::reloaded_bytes)
      .def_readonly("on_demand_reloads", &Store::on_demand_reloads)
      .def_readonly("records", &Store::records)
      .def_readonly("allocated_bytes", &Store::allocated_bytes)
      .def_readonly("in_use_bytes", &Store::in_use_bytes);
}

}  // namespace adaptive_mem_native
