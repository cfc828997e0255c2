// Thread pool of the Adam kernel (see adam_pool.h).
#include "adam/adam_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#define SWAPIO_HAVE_ATFORK 1
#endif
#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // _mm_pause (SSE2, baseline on x86-64)
#endif

namespace swapio {
namespace adam {
namespace {

constexpr int kMaxWorkers = 255;
// How long a worker that finished a job watches for the next before it sleeps (see Pool::linger)
constexpr int kLingerUs = 250;

// CPUs this process may run on now (its affinity mask), at least 1.
int usable_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__) && defined(__GNUC__)
  __asm__ __volatile__("yield");
#endif
}

// Spin briefly, then yield, until pred() holds. Used only for the short tail of a job (at most one tile per
// worker), so the calling thread does not pay a futex sleep and wake-up there.
template <typename Pred>
void spin_until(Pred pred) {
  for (int i = 0; !pred(); ++i) {
    if (i < 4096) cpu_relax();
    else std::this_thread::yield();
  }
}

struct Job {
  TileFn fn;
  const void* ctx;
  int64_t n;
  int64_t tile;
  int64_t ntiles;
  int helpers;                      // workers with id < helpers join
  std::atomic<int64_t> next{0};     // next tile to hand out
  std::atomic<int64_t> done{0};     // tiles finished
  std::atomic<int> users{0};        // workers that may still touch this Job

  void work() {
    for (;;) {
      int64_t t = next.fetch_add(1, std::memory_order_relaxed);
      if (t >= ntiles) return;
      int64_t b = t * tile;
      fn(ctx, b, std::min(n, b + tile));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

class Pool {
 public:
  int workers() {
    std::lock_guard<std::mutex> lk(mu_);
    return static_cast<int>(threads_.size());
  }

  void run(int64_t n, int64_t tile, int threads, TileFn fn, const void* ctx) {
    const int64_t ntiles = (n + tile - 1) / tile;
    std::unique_lock<std::mutex> run_lock(run_mu_);
    int want = static_cast<int>(std::min<int64_t>({static_cast<int64_t>(threads) - 1, ntiles - 1,
                                                    static_cast<int64_t>(kMaxWorkers)}));
    int have = start_workers(want);
    int helpers = std::min(want, have);
    if (helpers <= 0) {
      run_lock.unlock();
      fn(ctx, 0, n);
      return;
    }
    // more threads than CPUs: a lingering worker would spin on a CPU the others need
    linger_.store(helpers + 1 <= usable_cpus(), std::memory_order_relaxed);
    Job job;
    job.fn = fn;
    job.ctx = ctx;
    job.n = n;
    job.tile = tile;
    job.ntiles = ntiles;
    job.helpers = helpers;
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &job;
      ++generation_;
      published_.store(generation_, std::memory_order_release);
    }
    cv_.notify_all();
    job.work();
    spin_until([&] { return job.done.load(std::memory_order_acquire) >= ntiles; });
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = nullptr;  // late wakers find no job
    }
    spin_until([&] { return job.users.load(std::memory_order_acquire) == 0; });
  }

  // Joins the workers; later calls run on the caller. Waits for a job in flight to finish first.
  void shutdown() {
    std::lock_guard<std::mutex> run_lock(run_mu_);
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    std::lock_guard<std::mutex> lk(mu_);
    threads_.clear();
  }

 private:
  // Starts workers until there are `want` of them (called with run_mu_ held). Returns how many exist; fewer
  // than asked when the system refuses a thread (the job then runs on fewer threads).
  int start_workers(int want) {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return 0;
    while (static_cast<int>(threads_.size()) < want) {
      int id = static_cast<int>(threads_.size());
      try {
        threads_.emplace_back([this, id, gen = generation_] { worker_main(id, gen); });
      } catch (const std::system_error&) {
        break;
      }
    }
    return static_cast<int>(threads_.size());
  }

  void worker_main(int id, uint64_t seen) {
    bool worked = false;
    for (;;) {
      Job* job;
      if (worked && linger_.load(std::memory_order_relaxed)) linger(seen);
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
        if (job == nullptr || id >= job->helpers) {
          worked = false;  // not one of this job's threads: nothing to linger after
          continue;
        }
        job->users.fetch_add(1, std::memory_order_relaxed);
      }
      job->work();
      job->users.fetch_sub(1, std::memory_order_release);
      worked = true;
    }
  }

  // After a job, a worker watches for the next one for a short while before it sleeps on the condition
  // variable: an optimizer step calls the kernel once per parameter (or chunk), and waking a sleeping thread
  // costs more than a whole call of a few MiB on a virtual machine, whose idle vCPU the host has to schedule
  // again (0.4 ms and more measured: benchmarks/RESULTS.md, "The kernel's thread pool").
  void linger(uint64_t seen) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kLingerUs);
    for (int i = 1; published_.load(std::memory_order_acquire) == seen; ++i) {
      cpu_relax();
      if (i % 64 == 0 && std::chrono::steady_clock::now() >= until) return;
    }
  }

  std::mutex run_mu_;  // one job at a time
  std::mutex mu_;      // guards the fields below
  std::condition_variable cv_;
  uint64_t generation_ = 0;
  std::atomic<uint64_t> published_{0};  // generation_, for lingering workers to watch without the lock
  std::atomic<bool> linger_{false};     // the last job had no more threads than CPUs: its workers may linger
  Job* job_ = nullptr;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// The pool object is never freed: a call that comes after the exit-time shutdown (from a thread still
// running then) finds a stopped pool and runs inline instead of touching freed memory. Its threads are
// joined by the Reaper below, so nothing runs at exit.
std::atomic<Pool*> g_pool{nullptr};
std::mutex g_pool_mu;
bool g_shut_down = false;  // guarded by g_pool_mu

#ifdef SWAPIO_HAVE_ATFORK
// In a child the parent's workers do not exist and its locks may be held: forget that pool (without
// touching it) and start a fresh one on the next parallel call.
void on_fork_child() {
  new (&g_pool_mu) std::mutex();
  g_pool.store(nullptr, std::memory_order_relaxed);
}
#endif

Pool* get_pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p) return p;
  std::lock_guard<std::mutex> lk(g_pool_mu);
  if (g_shut_down) return nullptr;
  p = g_pool.load(std::memory_order_relaxed);
  if (!p) {
#ifdef SWAPIO_HAVE_ATFORK
    static bool registered = (pthread_atfork(nullptr, nullptr, on_fork_child) == 0);
    (void)registered;
#endif
    p = new Pool();
    g_pool.store(p, std::memory_order_release);
  }
  return p;
}

struct Reaper {
  ~Reaper() {
    Pool* p;
    {
      std::lock_guard<std::mutex> lk(g_pool_mu);
      g_shut_down = true;
      p = g_pool.load(std::memory_order_acquire);
    }
    if (p) p->shutdown();
  }
} g_reaper;

}  // namespace

void parallel_for(int64_t n, int64_t tile, int threads, TileFn fn, const void* ctx) {
  if (n <= 0) return;
  if (tile <= 0) tile = n;
  Pool* pool = (threads > 1 && n > tile) ? get_pool() : nullptr;
  if (pool == nullptr) {
    fn(ctx, 0, n);
    return;
  }
  pool->run(n, tile, threads, fn, ctx);
}

int pool_workers() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  return p ? p->workers() : 0;
}

}  // namespace adam
}  // namespace swapio
