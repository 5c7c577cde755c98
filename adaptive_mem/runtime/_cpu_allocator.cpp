// The CPU allocator hook behind adaptive_mem.DeviceMemory (built by _cpu_allocator.py at first use, into one
// extension with the CPU swap store, _swap_store.cpp).
//
// A c10::Allocator installed with c10::SetCPUAllocator in front of the allocator it replaces. Every
// allocation carries a 64-byte header (before the data, so the DataPtr stays "simple": context ==
// data) holding the base allocator's context and deleter, the exact size, whether it is host memory
// and the sessions (DeviceMemory objects) that count it. Frees therefore decrement exactly the
// sessions that counted the allocation, whatever thread frees it and whenever.
//
// A Session counts new allocations while it is "counting" (between DeviceMemory.__enter__ and
// __exit__); tensors that existed before are counted only when adopted (DeviceMemory.track / the gc
// scan on entry): an allocation of ours gets the session added to its header, one of the default
// CPU allocator gets its deleter swapped for ours (context unchanged, the old deleter kept in a
// table), so its free decrements too. Allocations made while the calling thread is inside
// host_allocations() (a thread-local depth) are host memory: never counted, and the mark is kept in
// the header so later scans skip them.
//
// Over a session's cap, the allocation first calls the Python callback (the session's on_oom hooks,
// i.e. the SwapManager's rescue) with the GIL taken and no lock held, then re-checks; still over:
// c10::OutOfMemoryError (torch.OutOfMemoryError in Python). A refused allocation never counts.
//
// A session restricted to one thread (Session.own_thread) counts only the allocations made on that
// thread and tallies the bytes of its allocations that another thread frees (foreign_freed): what a
// collective's worker thread releases after the calling thread dropped its last reference.
#include <pybind11/pybind11.h>

#include <ATen/Parallel.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <new>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

constexpr size_t kHeader = 64;  // keeps the base allocator's 64-byte alignment
constexpr int kOwners = 4;      // sessions one allocation can count in (nested DeviceMemory)

struct Session {
  int64_t id = 0;  // key of the Python object, for the callback
  int64_t live = 0, peak = 0, cap = -1;
  int64_t allocations = 0, faults = 0;
  std::vector<std::pair<int64_t, int64_t>> scheduled;  // injected faults (allocation number, bytes), latest first
  int refs = 1;  // the Python handle + every allocation counted here
  bool counting = false;
  bool dead = false;  // the Python handle is gone: owners may drop it
  bool one_thread = false;  // count only allocations made on ``thread``
  pthread_t thread{};
  int64_t foreign_freed = 0;  // bytes of its allocations freed on another thread (one_thread only)
};

struct Header {
  void* base_ctx;
  c10::DeleterFnPtr base_deleter;
  int64_t size;
  Session* owners[kOwners];
  uint8_t host;
};
static_assert(sizeof(Header) <= kHeader, "header does not fit");

struct Adopted {  // a storage of another allocator whose deleter was swapped for adopted_delete
  c10::DeleterFnPtr deleter;
  int64_t size;
  std::vector<Session*> owners;
  bool host = false;
};

// Process-lifetime state, never destroyed: storages are still freed (through our deleters) while the
// process exits, after static destructors would have run.
std::mutex& g_mu = *new std::mutex;
std::vector<Session*>& g_counting = *new std::vector<Session*>;
std::atomic<int> g_num_counting{0};
std::unordered_map<void*, Adopted>& g_adopted = *new std::unordered_map<void*, Adopted>;
PyObject* g_callback = nullptr;
thread_local int t_host = 0;
thread_local int t_rescue = 0;

// ---------------------------------------------------------------- bookkeeping (under g_mu)
void unref(Session* s) {
  if (--s->refs == 0) delete s;
}

void add_live(Session* s, int64_t n) {
  s->live += n;
  if (s->live > s->peak) s->peak = s->live;
}

bool counts_here(const Session* s) {
  return !s->one_thread || pthread_equal(s->thread, pthread_self());
}

void drop_owner(Session* s, int64_t size) {
  s->live -= size;
  if (!counts_here(s)) s->foreign_freed += size;
  unref(s);
}

Header* header_of(void* data) {
  return reinterpret_cast<Header*>(static_cast<char*>(data) - kHeader);
}

// ---------------------------------------------------------------- deleters
void header_delete(void* data) {
  if (data == nullptr) return;
  Header* h = header_of(data);
  if (h->owners[0] != nullptr) {
    std::lock_guard<std::mutex> lock(g_mu);
    for (int i = 0; i < kOwners && h->owners[i] != nullptr; ++i) drop_owner(h->owners[i], h->size);
  }
  h->base_deleter(h->base_ctx);
}

void adopted_delete(void* ctx) {
  c10::DeleterFnPtr deleter = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_adopted.find(ctx);
    TORCH_INTERNAL_ASSERT(it != g_adopted.end(), "adaptive_mem: free of an unknown adopted storage");
    deleter = it->second.deleter;
    for (Session* s : it->second.owners) drop_owner(s, it->second.size);
    g_adopted.erase(it);
  }
  deleter(ctx);
}

// ---------------------------------------------------------------- the Python callback
struct RescueScope {
  RescueScope() { ++t_rescue; }
  ~RescueScope() { --t_rescue; }
};

// Calls callback(session_id, nbytes, fault_needed) with the GIL; a Python exception propagates.
void call_python(int64_t id, int64_t nbytes, int64_t fault) {
  if (g_callback == nullptr || !Py_IsInitialized()) return;
  RescueScope scope;
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* res = PyObject_CallFunction(g_callback, "LLL", (long long)id, (long long)nbytes, (long long)fault);
  if (res == nullptr) {
    py::error_already_set err;  // fetches the Python error; restored where torch catches it
    PyGILState_Release(gil);
    throw err;
  }
  Py_DECREF(res);
  PyGILState_Release(gil);
}

[[noreturn]] void refuse(const Session* s, size_t n) {
  std::string msg = "device memory cap exceeded: allocation needs " + std::to_string(n) + " bytes with " +
                    std::to_string(s->live) + " live of cap " + std::to_string(s->cap);
  TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
}

Session* over_cap(size_t n, const std::vector<Session*>& skip) {
  for (Session* s : g_counting) {
    if (counts_here(s) && s->cap >= 0 && s->live + static_cast<int64_t>(n) > s->cap) {
      bool seen = false;
      for (Session* k : skip) seen |= k == s;
      if (!seen) return s;
    }
  }
  return nullptr;
}

// Counts ``n`` bytes in every counting session (under g_mu); fills ``owners``.
void commit(size_t n, Session** owners) {
  int i = 0;
  for (Session* s : g_counting) {
    if (!counts_here(s)) continue;
    add_live(s, static_cast<int64_t>(n));
    ++s->refs;
    owners[i++] = s;
  }
}

// Counts ``n`` bytes in every counting session after fault injection and rescues; fills ``owners``.
void reserve(size_t n, Session** owners) {
  std::unique_lock<std::mutex> lock(g_mu);
  // Inside an intra-op parallel region (at::parallel_for) the allocation is a kernel's scratch buffer
  // and other threads wait for this one, maybe holding the GIL: counted, never rescued nor refused.
  const bool parallel = at::in_parallel_region();
  std::vector<std::pair<int64_t, int64_t>> faults;
  for (Session* s : g_counting) {
    if (!counts_here(s)) continue;
    ++s->allocations;
    // a scheduled fault fires once, at the first allocation from its number on that may call Python
    if (!s->scheduled.empty() && s->allocations >= s->scheduled.back().first && t_rescue == 0 && !parallel) {
      ++s->faults;
      faults.emplace_back(s->id, s->scheduled.back().second);
      s->scheduled.pop_back();
    }
  }
  if (!faults.empty()) {  // injected transient failure: the hooks run, then the allocation succeeds
    lock.unlock();
    for (auto& f : faults) call_python(f.first, static_cast<int64_t>(n), f.second);
    lock.lock();
  }
  if (parallel) {
    commit(n, owners);
    return;
  }
  std::vector<Session*> tried;
  while (Session* s = over_cap(n, tried)) {
    if (t_rescue > 0 || g_callback == nullptr) break;  // no rescue inside a rescue
    tried.push_back(s);
    ++s->refs;
    int64_t id = s->id;
    lock.unlock();
    try {
      call_python(id, static_cast<int64_t>(n), 0);
    } catch (...) {
      std::lock_guard<std::mutex> relock(g_mu);
      unref(s);
      throw;
    }
    lock.lock();
    unref(s);
  }
  if (Session* s = over_cap(n, {})) refuse(s, n);
  commit(n, owners);
}

void unreserve(size_t n, Session** owners) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (int i = 0; i < kOwners && owners[i] != nullptr; ++i) drop_owner(owners[i], static_cast<int64_t>(n));
}

// ---------------------------------------------------------------- the allocator
struct CountingAllocator final : public c10::Allocator {
  c10::Allocator* base = nullptr;

  c10::DataPtr allocate(size_t n) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) return {nullptr, nullptr, &header_delete, cpu};
    Session* owners[kOwners] = {nullptr, nullptr, nullptr, nullptr};
    const bool host = t_host > 0;
    if (!host && g_num_counting.load(std::memory_order_acquire) > 0) reserve(n, owners);
    c10::DataPtr inner;
    try {
      inner = base->allocate(n + kHeader);
    } catch (...) {
      unreserve(n, owners);
      throw;
    }
    void* raw = inner.get();
    c10::DeleterFnPtr deleter = inner.get_deleter();
    void* ctx = inner.release_context();
    Header* h = static_cast<Header*>(raw);
    h->base_ctx = ctx;
    h->base_deleter = deleter;
    h->size = static_cast<int64_t>(n);
    for (int i = 0; i < kOwners; ++i) h->owners[i] = owners[i];
    h->host = host;
    void* data = static_cast<char*>(raw) + kHeader;
    return {data, data, &header_delete, cpu};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &header_delete;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingAllocator& g_allocator = *new CountingAllocator;  // never destroyed, like the state above

// A forked child (e.g. a DataLoader worker) starts with no session counting: the parent's sessions,
// caps and rescue hooks are the parent's. The mutex is re-created in case another thread held it.
void after_fork_in_child() {
  new (&g_mu) std::mutex;
  g_counting.clear();
  g_num_counting.store(0);
  t_rescue = 0;
}

bool plain_deleter(c10::DeleterFnPtr d) {
  return d == c10::GetDefaultCPUAllocator()->raw_deleter() ||
         (g_allocator.base != nullptr && d == g_allocator.base->raw_deleter());
}

c10::StorageImpl* storage_of(int64_t cdata) {
  return reinterpret_cast<c10::StorageImpl*>(cdata);
}

bool has_owner(Session* const* owners, int count, Session* s) {
  for (int i = 0; i < count; ++i)
    if (owners[i] == s) return true;
  return false;
}

// ---------------------------------------------------------------- the Python surface
void install() {
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current == &g_allocator) return;
  g_allocator.base = current;
  c10::SetCPUAllocator(&g_allocator, /*priority=*/0);
  TORCH_CHECK(c10::GetCPUAllocator() == &g_allocator,
              "adaptive_mem: another CPU allocator with a higher priority is installed; cannot count device memory");
}

bool installed() {
  return c10::GetCPUAllocator() == &g_allocator;
}

void set_callback(py::object fn) {
  PyObject* obj = fn.is_none() ? nullptr : fn.ptr();
  Py_XINCREF(obj);
  Py_XDECREF(g_callback);
  g_callback = obj;
}

void host_enter() { ++t_host; }
void host_exit() { --t_host; }
int host_depth() { return t_host; }

// Marks a storage as host memory (swap store). False when it belongs to an allocator we cannot mark.
bool mark_host(int64_t cdata) {
  c10::StorageImpl* impl = storage_of(cdata);
  c10::DataPtr& dp = impl->_mutable_data_ptr_no_checks();
  void* ctx = dp.get_context();
  if (ctx == nullptr) return true;
  std::lock_guard<std::mutex> lock(g_mu);
  if (dp.get_deleter() == &header_delete) {
    header_of(ctx)->host = 1;
    return true;
  }
  if (dp.get_deleter() == &adopted_delete) {
    g_adopted.at(ctx).host = true;
    return true;
  }
  c10::DeleterFnPtr old = dp.get_deleter();
  if (!plain_deleter(old) || !dp.compare_exchange_deleter(old, &adopted_delete)) return false;
  Adopted entry{old, static_cast<int64_t>(impl->nbytes()), {}, true};
  g_adopted.emplace(ctx, std::move(entry));
  return true;
}

// 1 host, 0 not host, -1 unknown (another allocator's storage).
int is_host(int64_t cdata) {
  c10::StorageImpl* impl = storage_of(cdata);
  const c10::DataPtr& dp = impl->_mutable_data_ptr_no_checks();
  void* ctx = dp.get_context();
  if (ctx == nullptr) return 0;
  std::lock_guard<std::mutex> lock(g_mu);
  if (dp.get_deleter() == &header_delete) return header_of(ctx)->host ? 1 : 0;
  if (dp.get_deleter() == &adopted_delete) return g_adopted.at(ctx).host ? 1 : 0;
  return -1;
}

class Handle {
 public:
  explicit Handle(int64_t id) : s_(new Session) { s_->id = id; }
  ~Handle() {
    std::lock_guard<std::mutex> lock(g_mu);
    stop_locked();
    s_->dead = true;
    unref(s_);
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  void start() {
    install();
    std::lock_guard<std::mutex> lock(g_mu);
    if (s_->counting) return;
    TORCH_CHECK(static_cast<int>(g_counting.size()) < kOwners, "adaptive_mem: at most ", kOwners,
                " DeviceMemory can count at once (nested)");
    s_->counting = true;
    g_counting.push_back(s_);
    g_num_counting.store(static_cast<int>(g_counting.size()), std::memory_order_release);
  }

  void stop() {
    std::lock_guard<std::mutex> lock(g_mu);
    stop_locked();
  }

  // Counts an existing storage in this session until it dies. Returns the bytes added (0 when it is
  // already counted here, host memory or empty), -1 when it belongs to an allocator we cannot hook.
  int64_t adopt(int64_t cdata) {
    c10::StorageImpl* impl = storage_of(cdata);
    if (impl->device_type() != c10::DeviceType::CPU) return -1;
    c10::DataPtr& dp = impl->_mutable_data_ptr_no_checks();
    void* ctx = dp.get_context();
    if (ctx == nullptr || impl->nbytes() == 0) return 0;
    std::lock_guard<std::mutex> lock(g_mu);
    if (dp.get_deleter() == &header_delete) {
      Header* h = header_of(ctx);
      if (h->host || has_owner(h->owners, kOwners, s_)) return 0;
      int free_slot = first_free(h);
      TORCH_CHECK(free_slot >= 0, "adaptive_mem: a tensor is counted by more than ", kOwners,
                  " live DeviceMemory objects");
      h->owners[free_slot] = s_;
      ++s_->refs;
      add_live(s_, h->size);
      return h->size;
    }
    if (dp.get_deleter() == &adopted_delete) {
      Adopted& entry = g_adopted.at(ctx);
      if (entry.host || has_owner(entry.owners.data(), static_cast<int>(entry.owners.size()), s_)) return 0;
      prune(entry.owners, entry.size);
      entry.owners.push_back(s_);
      ++s_->refs;
      add_live(s_, entry.size);
      return entry.size;
    }
    c10::DeleterFnPtr old = dp.get_deleter();
    if (!plain_deleter(old) || !dp.compare_exchange_deleter(old, &adopted_delete)) return -1;
    int64_t size = static_cast<int64_t>(impl->nbytes());
    Adopted entry{old, size, {s_}, false};
    g_adopted.emplace(ctx, std::move(entry));
    ++s_->refs;
    add_live(s_, size);
    if (impl->allocator() == c10::GetDefaultCPUAllocator() || impl->allocator() == g_allocator.base) {
      impl->set_allocator(&g_allocator);  // a later resize allocates through the hook
    }
    return size;
  }

  void add(int64_t delta) {  // storages Python tracks itself (foreign allocators)
    std::lock_guard<std::mutex> lock(g_mu);
    add_live(s_, delta);
  }

  int64_t live() { std::lock_guard<std::mutex> lock(g_mu); return s_->live; }
  int64_t peak() { std::lock_guard<std::mutex> lock(g_mu); return s_->peak; }
  void set_peak(int64_t v) { std::lock_guard<std::mutex> lock(g_mu); s_->peak = v; }
  void reset_peak() { std::lock_guard<std::mutex> lock(g_mu); s_->peak = s_->live; }
  void set_cap(int64_t cap) { std::lock_guard<std::mutex> lock(g_mu); s_->cap = cap; }
  int64_t allocations() { std::lock_guard<std::mutex> lock(g_mu); return s_->allocations; }
  void set_allocations(int64_t v) { std::lock_guard<std::mutex> lock(g_mu); s_->allocations = v; }
  int64_t faults() { std::lock_guard<std::mutex> lock(g_mu); return s_->faults; }
  void inject_fault(int64_t at, int64_t needed) {  // one more scheduled fault
    std::lock_guard<std::mutex> lock(g_mu);
    auto& faults = s_->scheduled;
    faults.emplace_back(at, needed);
    std::sort(faults.begin(), faults.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  }
  void clear_faults() { std::lock_guard<std::mutex> lock(g_mu); s_->scheduled.clear(); }
  void own_thread() {  // from now on count only the calling thread's allocations
    std::lock_guard<std::mutex> lock(g_mu);
    s_->one_thread = true;
    s_->thread = pthread_self();
  }
  int64_t foreign_freed() { std::lock_guard<std::mutex> lock(g_mu); return s_->foreign_freed; }

 private:
  void stop_locked() {
    if (!s_->counting) return;
    s_->counting = false;
    for (auto it = g_counting.begin(); it != g_counting.end(); ++it) {
      if (*it == s_) {
        g_counting.erase(it);
        break;
      }
    }
    g_num_counting.store(static_cast<int>(g_counting.size()), std::memory_order_release);
  }

  static int first_free(Header* h) {
    for (int i = 0; i < kOwners; ++i)
      if (h->owners[i] == nullptr) return i;
    // full: drop owners whose DeviceMemory is gone (nobody reads them), then compact
    int j = 0;
    for (int i = 0; i < kOwners; ++i) {
      if (h->owners[i]->dead) {
        drop_owner(h->owners[i], h->size);
      } else {
        h->owners[j++] = h->owners[i];
      }
    }
    for (int i = j; i < kOwners; ++i) h->owners[i] = nullptr;
    return j < kOwners ? j : -1;
  }

  static void prune(std::vector<Session*>& owners, int64_t size) {
    if (owners.size() < 8) return;
    std::vector<Session*> keep;
    for (Session* s : owners) {
      if (s->dead) {
        drop_owner(s, size);
      } else {
        keep.push_back(s);
      }
    }
    owners.swap(keep);
  }

  Session* s_;
};

}  // namespace

namespace adaptive_mem_native {  // for _swap_store.cpp
void host_enter() { ++t_host; }
void host_exit() { --t_host; }
void bind_swap_store(py::module_& m);
}  // namespace adaptive_mem_native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "adaptive_mem's counting CPU allocator";
  pthread_atfork(nullptr, nullptr, &after_fork_in_child);
  m.def("install", &install);
  m.def("installed", &installed);
  m.def("set_callback", &set_callback);
  m.def("host_enter", &host_enter);
  m.def("host_exit", &host_exit);
  m.def("host_depth", &host_depth);
  m.def("mark_host", &mark_host);
  m.def("is_host", &is_host);
  py::class_<Handle>(m, "Session")
      .def(py::init<int64_t>())
      .def("start", &Handle::start)
      .def("stop", &Handle::stop)
      .def("adopt", &Handle::adopt)
      .def("add", &Handle::add)
      .def("live", &Handle::live)
      .def("peak", &Handle::peak)
      .def("set_peak", &Handle::set_peak)
      .def("reset_peak", &Handle::reset_peak)
      .def("set_cap", &Handle::set_cap)
      .def("allocations", &Handle::allocations)
      .def("set_allocations", &Handle::set_allocations)
      .def("faults", &Handle::faults)
      .def("inject_fault", &Handle::inject_fault)
      .def("clear_faults", &Handle::clear_faults)
      .def("own_thread", &Handle::own_thread)
      .def("foreign_freed", &Handle::foreign_freed);
  adaptive_mem_native::bind_swap_store(m);
}
