#pragma once
// One pread/pwrite call = one Request = one future. Workers run its pieces; the last stripe to finish
// completes it. Callers hold it by shared_ptr, so it may outlive the handle that made it.
#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "io/engine.h"
#include "io/file.h"

namespace swapio::io {

struct RequestLayout {
  Op op = Op::read;
  char* buf = nullptr;
  int64_t offset = 0;  // file offset of buf[0]
  int64_t length = 0;
  size_t block = 0;    // piece size for the aligned middle
  // Sequential requests: [offset, head_end) and [tail_start, end) are the unaligned edges, moved through the
  // buffered descriptor; the middle goes through O_DIRECT, via bounce buffers when memory is misaligned or the
  // caller asked (staged: measured on ext4 over virtio-blk under Firecracker, O_DIRECT reads into written
  // small-page memory ran at 0.63-0.81x of reads into huge pages, and through the buffers plus the copy at 1.0x).
  int64_t head_end = 0;
  int64_t tail_start = 0;
  bool bounce_middle = false;
  // Random requests (benchmarks): `count` block-sized pieces at random block-aligned offsets in [0, span).
  bool random = false;
  int64_t count = 0;
  int64_t span = 0;
  uint64_t seed = 0;
  int64_t slots = 1;  // pieces cycle through `slots` block-sized regions of buf
  bool record_latency = false;
};

class Request {
 public:
  Request(RequestLayout layout, std::shared_ptr<OpenFile> file, int tasks);

  // --- caller side
  // Negative: no limit; true once done. Throws ArgError in a child after fork() if not done before it.
  bool wait_for(double timeout_s);
  bool done() const { return done_.load(std::memory_order_acquire); }
  int64_t result();                 // waits; bytes moved, or throws IoError
  std::vector<uint64_t> latencies_ns();
  bool fell_back() const { return fell_back_; }
  int64_t length() const { return layout_.length; }

  // --- worker side
  const RequestLayout& layout() const { return layout_; }
  OpenFile& file() { return *file_; }
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  void fail(int err, int64_t offset, std::string detail);
  void add_bytes(int64_t n) { bytes_.fetch_add(n, std::memory_order_relaxed); }
  void task_finished(std::vector<uint64_t>&& latencies);
  void complete_now();  // nothing to move (zero length)

 private:
  void finish();
  RequestLayout layout_;
  std::shared_ptr<OpenFile> file_;
  std::string path_;
  bool fell_back_ = false;
  pid_t pid_;  // the process whose workers complete it
  std::atomic<int> tasks_left_;
  std::atomic<int64_t> bytes_{0};
  std::atomic<bool> failed_{false};
  std::atomic<bool> done_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  int err_ = 0;
  int64_t err_offset_ = 0;
  std::string err_detail_;
  std::vector<uint64_t> latencies_;
};

}  // namespace swapio::io
