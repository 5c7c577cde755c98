// The native swap store's copy worker (Note: [overlapped native copies] in _swap_store.cpp): one thread running
// memcpy jobs in issue order. It runs no ATen op, holds no Python object and never takes the GIL, so a caller may
// wait for it holding the GIL; the source storage of a copy out is handed back to the callers (``reap``) instead
// of dropped on the worker, as dropping a storage may need Python (its Python object). In a process forked while
// the thread ran (a DataLoader's worker process) the thread is not there: the copies it had not finished run
// inline at the child's first call (the child's memory is the parent's at the fork), and nothing joins it.
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
    if (out) {
      landed_.wait(lock, [&] { return out_bytes_ == 0 || out_bytes_ + job.nbytes <= window_bytes; });
      out_bytes_ += job.nbytes;
    }
    ++*job.pending;
    ++busy_;
    jobs_.push_back(std::move(job));
    queued_.notify_one();
  }

  void wait(const int& pending) {  // until a record's copies have landed
    after_fork();
    std::unique_lock<std::mutex> lock(mu_);
    landed_.wait(lock, [&] { return pending == 0; });
  }

  bool drain() {  // until every queued copy has landed; whether there was one
    after_fork();
    std::unique_lock<std::mutex> lock(mu_);
    const bool any = busy_ > 0;
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
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      queued_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
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
  }

  std::mutex mu_;
  std::condition_variable queued_, landed_;
  std::deque<CopyJob> jobs_;
  CopyJob running_{nullptr, nullptr, 0, nullptr, c10::Storage()};  // the copy on the thread (no source kept)
  pid_t pid_ = 0;  // the process that started the thread
  int64_t out_bytes_ = 0;  // bytes of copies out queued or running
  int busy_ = 0;           // copies queued or running
  std::vector<c10::Storage> reaped_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace adaptive_mem_native
