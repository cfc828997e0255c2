#pragma once
// AioHandle's native side: validates a request, opens the file, cuts the request into per-worker stripes
// and hands them to the workers. Thread-safe; close() (or the destructor) finishes queued work first.
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "io/engine.h"
#include "io/file.h"
#include "io/request.h"
#include "io/worker.h"

namespace swapio::io {

// Limits on HandleOptions (exposed to Python as swapio._C.MAX_*; the CLI reads them there).
constexpr int64_t kMaxBlockSize = int64_t(1) << 30;
constexpr int64_t kMaxQueueDepth = 4096;
constexpr int64_t kMaxThreads = 256;

struct HandleOptions {
  int64_t block_size = 1 << 20;
  int64_t queue_depth = 32;
  int64_t threads = 1;
  std::string engine = "auto";  // auto | uring | aio | psync | null
  DirectMode direct = DirectMode::automatic;
  // Most pieces handed to the engine per call (fio's iodepth_batch_submit, default 1 like fio: lower
  // latency for small random I/O, no loss for large pieces, measured); 0: all that are ready.
  int64_t submit_batch = 1;
  // Fault injection for tests (see io/fault.h); empty: the SWAPIO_FAULT environment variable, if set.
  std::string fault;
};

class Handle {
 public:
  explicit Handle(HandleOptions options);  // throws ArgError (bad option) or IoError (engine unavailable)
  ~Handle();
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  // `length` bytes between memory at `buf` and `path` at `offset`; `expect`: the identity the file at `path`
  // must have (see OpenFile). `staged`: the O_DIRECT part goes through the workers' huge-page bounce buffers even
  // when the memory is aligned (as misaligned memory always does): on some virtual disks DMA into small pages is
  // much slower than into the buffers plus the copy (request.h).
  std::shared_ptr<Request> submit(Op op, uintptr_t buf, int64_t length, const std::string& path, int64_t offset,
                                  bool record_latency, std::optional<FileIdentity> expect = std::nullopt,
                                  bool staged = false);
  // Benchmarks: `count` block-sized pieces at random block-aligned offsets below `span`, cycling through
  // the block-sized slots of buf[0, buf_len).
  std::shared_ptr<Request> submit_random(Op op, uintptr_t buf, int64_t buf_len, const std::string& path,
                                         int64_t span, int64_t count, uint64_t seed, bool record_latency);
  void close();
  bool closed();  // also true in a child process after fork(): the workers live only in the parent
  const std::string& engine() const { return engine_; }
  const HandleOptions& options() const { return opt_; }

 private:
  void dispatch(const std::shared_ptr<Request>& req, const std::vector<int64_t>& bounds);
  void check_usable();  // throws ArgError if closed or inherited through fork()
  HandleOptions opt_;
  pid_t pid_;  // the process whose threads run this handle
  std::string engine_;
  std::mutex mu_;  // guards workers_ against a concurrent close()
  std::vector<std::unique_ptr<Worker>> workers_;
  std::atomic<uint64_t> next_worker_{0};
};

}  // namespace swapio::io
