// The native swap store's copy worker (Note: [overlapped native copies] in _swap_store.cpp): one thread running
// memcpy jobs in issue order. It runs no ATen op, holds no Python object and never takes the GIL, so a caller may
// wait for it holding the GIL; the source storage of a copy out is handed back to the callers (``reap``) instead
// of dropped on the worker, as dropping a storage may need Python (its Python object). In a process forked while
// the thread ran (a DataLoader's worker process) the thread is not there: the copies it had not finished run
// inline at the child's first call (the child's memory is the parent's at the fork), and nothing joins it.
//
// Note: [batched wake-ups]. Waking the sleeping thread costs a system call and, on a virtual machine, an
// interrupt to the other vCPU: tens of microseconds, more than the copy of a small saved tensor, paid by the
// compute thread once per save. So a queued copy wakes the thread only once ``kick_bytes`` of copies wait
// (a thread that is awake takes the queue without one); ``kick`` wakes it for whatever waits, and every wait
// of a caller kicks first (a copy it waits for may be queued behind a sleeping thread). The store kicks at the
// end of a trigger's prefetches and at a forward's start and end, the engine at each layer's end and at the
// first save of another layer: a layer's copies out start by the next layer at the latest, as the copy
// stream's batch of a layer does (Note: [batched issue] in _copier.py), so the device bytes the plan frees in
// a layer's forward are gone by the next one (tests/test_executor_memory.py measures it).
#pragma once

#include <unistd.h>

#include <c10/core/Storage.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <new>
#include <thread>
#include <utility>
#include <vector>

namespace adaptive_mem_native {

struct CopyJob {
  void* dst;
  const void* src;
  int64_t nbytes;
  int* pending;       // the record's count of copies not yet landed (under the worker's lock)
  c10::Storage keep;  // a copy out's source: kept until its bytes have landed and a caller reaped it
};

class CopyWorker {
 public:
  std::atomic<bool> skip{false};  // timing only: the bytes are not moved
  int64_t window_bytes = 8 << 20;  // the most bytes of copies out queued at once
  int64_t kick_bytes = 1 << 20;    // the bytes of queued copies that wake the thread (Note: [batched wake-ups])
  std::atomic<int64_t> wakes{0};   // times the thread was woken from sleep

  ~CopyWorker() { stop(); }

  // Queues a copy; a copy out (one with a source to keep) waits while the window is full.
  void submit(CopyJob job) {
    after_fork();
    std::unique_lock<std::mutex> lock(mu_);
    if (!thread_.joinable()) {
      thread_ = std::thread([this] { run(); });
      pid_ = getpid();
    }
    const bool out = static_cast<bool>(job.keep);
    if (out && !(out_bytes_ == 0 || out_bytes_ + job.nbytes <= window_bytes)) {
      kick_locked();
      landed_.wait(lock, [&] { return out_bytes_ == 0 || out_bytes_ + job.nbytes <= window_bytes; });
    }
    out_bytes_ += out ? job.nbytes : 0;
    ++*job.pending;
    ++busy_;
    unkicked_ += job.nbytes;
    jobs_.push_back(std::move(job));
    if (unkicked_ >= kick_bytes) kick_locked();
  }

  void kick() {  // wakes the thread for the queued copies
    after_fork();
    std::lock_guard<std::mutex> lock(mu_);
    kick_locked();
  }

  void wait(const int& pending) {  // until a record's copies have landed
    after_fork();
    std::unique_lock<std::mutex> lock(mu_);
    if (pending == 0) return;
    kick_locked();
    landed_.wait(lock, [&] { return pending == 0; });
  }

  bool drain() {  // until every queued copy has landed; whether there was one
    after_fork();
    std::unique_lock<std::mutex> lock(mu_);
    const bool any = busy_ > 0;
    kick_locked();
    landed_.wait(lock, [&] { return busy_ == 0; });
    lock.unlock();
    reap();
    return any;
  }

  void reap() {  // drops the landed copies' sources on the calling thread
    after_fork();
    std::vector<c10::Storage> drop;
    std::lock_guard<std::mutex> lock(mu_);
    drop.swap(reaped_);
  }

  void stop() {  // runs what is queued, then ends the thread
    after_fork();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    queued_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void kick_locked() {  // under the lock
    unkicked_ = 0;
    if (sleeping_ && !jobs_.empty()) {
      sleeping_ = false;  // one wake-up until it sleeps again
      ++wakes;
      queued_.notify_one();
    }
  }

  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (jobs_.empty() && !stopping_) {
        sleeping_ = true;
        queued_.wait(lock);  // a spurious wake-up only takes the queue early
        sleeping_ = false;
        continue;
      }
      if (jobs_.empty()) return;
      CopyJob job = std::move(jobs_.front());
      jobs_.pop_front();
      running_ = {job.dst, job.src, job.nbytes, job.pending, c10::Storage()};
      lock.unlock();
      if (!skip) std::memcpy(job.dst, job.src, job.nbytes);
      lock.lock();
      if (job.keep) {
        out_bytes_ -= job.nbytes;
        reaped_.push_back(std::move(job.keep));
      }
      --*job.pending;
      --busy_;
      running_.pending = nullptr;
      landed_.notify_all();
    }
  }

  void after_fork() {  // in a child forked while the thread ran: its unfinished copies inline, no thread
    if (pid_ == 0 || pid_ == getpid()) return;
    pid_ = 0;
    new (&mu_) std::mutex;  // the parent's locks and thread are not this process's
    new (&queued_) std::condition_variable;
    new (&landed_) std::condition_variable;
    new (&thread_) std::thread;
    if (running_.pending != nullptr) jobs_.push_front(running_);
    for (CopyJob& job : jobs_) {
      if (!skip) std::memcpy(job.dst, job.src, job.nbytes);
      if (job.keep) reaped_.push_back(std::move(job.keep));
      --*job.pending;
    }
    jobs_.clear();
    running_.pending = nullptr;
    busy_ = 0;
    out_bytes_ = 0;
    unkicked_ = 0;
    sleeping_ = false;
  }

  std::mutex mu_;
  std::condition_variable queued_, landed_;
  std::deque<CopyJob> jobs_;
  CopyJob running_{nullptr, nullptr, 0, nullptr, c10::Storage()};  // the copy on the thread (no source kept)
  pid_t pid_ = 0;  // the process that started the thread
  int64_t out_bytes_ = 0;  // bytes of copies out queued or running
  int busy_ = 0;           // copies queued or running
  int64_t unkicked_ = 0;   // bytes queued since the thread was last woken
  bool sleeping_ = false;  // the thread waits for a kick
  std::vector<c10::Storage> reaped_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace adaptive_mem_native
