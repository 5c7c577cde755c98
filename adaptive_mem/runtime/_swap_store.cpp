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
#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
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
  at::Tensor dev;   // the reloaded bytes, after the first unpack
  int64_t nbytes;
  c10::VariableVersion version;  // the saved tensor's version counter (its views share it)
  uint32_t saved_version;
  bool on_demand;  // reloaded at the unpack for want of a prefetch (the plan asked none)
  std::string label;
  Stored(std::shared_ptr<Store> s, at::Tensor h, int64_t n, const at::Tensor& t, bool demand, std::string l)
      : store(std::move(s)), host(std::move(h)), nbytes(n), version(t.unsafeGetTensorImpl()->version_counter()),
        saved_version(version.enabled() ? version.current_version() : 0), on_demand(demand), label(std::move(l)) {}
  ~Stored();
};

struct Store : std::enable_shared_from_this<Store> {
  std::mutex mu;
  py::object take, give;  // the host budget's take(nbytes) -> bool and give(nbytes)
  std::unordered_map<int64_t, std::vector<at::Tensor>> free;  // host buffers by size
  std::unordered_map<c10::StorageImpl*, std::pair<c10::weak_intrusive_ptr<c10::StorageImpl>, std::weak_ptr<Stored>>>
      seen;  // this forward's records; the weak reference keeps the StorageImpl's address from being reused
  // read from Python as attributes of the same names (the swap statistics, the host bytes)
  int64_t allocated_bytes = 0, in_use_bytes = 0;    // host bytes: all buffers / those holding a copy
  int64_t offloaded_bytes = 0, reloaded_bytes = 0;  // bytes copied out / back (cumulative)
  int64_t on_demand_reloads = 0, records = 0;       // reloads for want of a prefetch; records made (cumulative)
  bool closed = false;
  bool skip_copies = false;  // timing only (benchmarks/bench_machinery.py): the bytes are not moved

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

  py::object offload(const at::Tensor& t, const std::string& label, bool prefetch, int64_t limit);
  int64_t close();
};

Stored::~Stored() {
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
    if (!s.dev.defined()) {
      at::Tensor dev = at::empty({s.nbytes}, at::kByte);  // device bytes: may run the out-of-memory rescue
      if (!s.store->skip_copies) std::memcpy(dev.data_ptr(), s.host.data_ptr(), s.nbytes);
      s.dev = std::move(dev);
      Store& store = *s.store;
      {
        std::lock_guard<std::mutex> lock(store.mu);
        store.reloaded_bytes += s.nbytes;
        store.on_demand_reloads += s.on_demand;
      }
      store.release(std::move(s.host));
    }
    at::Tensor out = at::empty({0}, at::TensorOptions().dtype(dtype));
    out.set_(s.dev.storage(), offset, size, stride);
    return out;
  }
};

py::object Store::offload(const at::Tensor& t, const std::string& label, bool prefetch, int64_t limit) {
  const c10::Storage& st = t.storage();
  const int64_t n = static_cast<int64_t>(st.nbytes());
  if (n == 0 || n > limit || st.device_type() != c10::DeviceType::CPU || st.data() == nullptr) return py::none();
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
    if (!skip_copies) std::memcpy(host.data_ptr(), st.data(), n);
    stored = std::make_shared<Stored>(shared_from_this(), std::move(host), n, t, !prefetch, label);
    std::lock_guard<std::mutex> lock(mu);
    seen.insert_or_assign(impl, std::make_pair(st.getWeakStorageImpl(), std::weak_ptr<Stored>(stored)));
    offloaded_bytes += n;
    records += 1;
  }
  return py::cast(Handle{std::move(stored), t.scalar_type(), t.sizes().vec(), t.strides().vec(),
                         t.storage_offset()});
}

int64_t Store::close() {  // drops the free buffers; returns their bytes (for the budget)
  std::vector<at::Tensor> drop;
  int64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    closed = true;
    seen.clear();
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

}  // namespace

namespace adaptive_mem_native {

void bind_swap_store(py::module_& m) {
  py::class_<Stored, std::shared_ptr<Stored>>(m, "SwapRecord")  // one per storage: the saves of it share it
      .def_readonly("nbytes", &Stored::nbytes)
      .def_readonly("label", &Stored::label);
  py::class_<Handle>(m, "SwapHandle")
      .def("unpack", &Handle::unpack)
      .def_readonly("record", &Handle::stored);
  py::class_<Store, std::shared_ptr<Store>>(m, "SwapStore")
      .def(py::init<py::object, py::object>(), py::arg("take"), py::arg("give"))
      .def("offload", &Store::offload, py::arg("tensor"), py::arg("label"), py::arg("prefetch"), py::arg("limit"))
      .def("new_forward", [](Store& s) {
        std::lock_guard<std::mutex> lock(s.mu);
        s.seen.clear();
      })
      .def("close", &Store::close)
      .def_readwrite("skip_copies", &Store::skip_copies)
      .def_readonly("offloaded_bytes", &Store::offloaded_bytes)
      .def_readonly("reloaded_bytes", &Store::reloaded_bytes)
      .def_readonly("on_demand_reloads", &Store::on_demand_reloads)
      .def_readonly("records", &Store::records)
      .def_readonly("allocated_bytes", &Store::allocated_bytes)
      .def_readonly("in_use_bytes", &Store::in_use_bytes);
}

}  // namespace adaptive_mem_native
