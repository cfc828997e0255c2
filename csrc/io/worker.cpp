#include "io/worker.h"

#include "io/copy.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <system_error>

#include <sys/mman.h>

#include "common/errors.h"

namespace swapio::io {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::atomic<size_t> g_bounce_bytes{0};

const char* op_name(Op op) { return op == Op::read ? "read" : "write"; }

// EINTR/EAGAIN completions are resubmitted this many times in a row, then the piece fails with them.
constexpr int kMaxRetries = 16;
// reap() failing this many times in a row (about 0.5 s with the back-off) means the engine is broken.
constexpr int kMaxReapFailures = 50;

std::string describe(const Piece& p, const char* what) {
  return std::string(op_name(p.op)) + " of " + std::to_string(p.len) + " bytes at offset " +
         std::to_string(p.offset) + " " + what;
}

}  // namespace

size_t bounce_bytes_held() { return g_bounce_bytes.load(); }

int64_t random_piece_offset(uint64_t seed, int64_t i, int64_t span, int64_t block) {
  uint64_t x = seed + static_cast<uint64_t>(i) + 0x9e3779b97f4a7c15ULL;  // splitmix64(seed + i)
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return static_cast<int64_t>(x % static_cast<uint64_t>(span / block)) * block;
}

Worker::Worker(const EngineOps& ops, void* ctx, unsigned depth, unsigned batch, size_t slot_bytes)
    : ops_(ops), ctx_(ctx), depth_(depth), batch_(ops.sync ? 1 : batch),
      slot_bytes_((slot_bytes + 4095) & ~size_t(4095)), slots_(2 * size_t(depth)), done_(depth) {
  for (auto& s : slots_) free_.push_back(&s);
  try {
    thread_ = std::thread([this] { run(); });
  } catch (const std::system_error& e) {  // (std::thread's refusal was a bare RuntimeError naming nothing)
    const int err = e.code().value();
    throw IoError(err,
                  std::string("cannot start an I/O worker thread: ") + std::strerror(err) +
                      " (the process's thread limit, ulimit -u or a container's pids.max, or no memory for its stack?)",
                  "", 0);
  }
}

Worker::~Worker() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  thread_.join();
  if (ctx_) ops_.cleanup(ctx_);
  for (auto& s : slots_)
    if (s.bounce_owned && s.bounce) {
      std::free(s.bounce);
      g_bounce_bytes -= s.bounce_size;
    }
  if (arena_map_) {
    munmap(arena_map_, arena_map_bytes_);
    g_bounce_bytes -= arena_map_bytes_;
  }
}

char* Worker::arena() {
  if (arena_ || arena_failed_) return arena_;
  // One region for all slots, 2 MiB aligned and marked for huge pages: copies into and out of it (and the
  // device's DMA) touch a few large pages instead of thousands of small ones. Measured: bounced reads went
  // from 0.6x to parity with zero-copy reads from pinned memory.
  constexpr size_t huge = size_t(2) << 20;
  const size_t bytes = slots_.size() * slot_bytes_;
  arena_map_bytes_ = (bytes + huge - 1) / huge * huge + huge;
  void* p = mmap(nullptr, arena_map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    arena_failed_ = true;
    return nullptr;
  }
  arena_map_ = p;
  g_bounce_bytes += arena_map_bytes_;
  arena_ = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + huge - 1) & ~uintptr_t(huge - 1));
  madvise(arena_, bytes, MADV_HUGEPAGE);  // a hint: without THP the arena still works with small pages
  return arena_;
}

void Worker::enqueue(std::unique_ptr<Task> task) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    incoming_.push_back(std::move(task));
    has_incoming_.store(true, std::memory_order_release);
  }
  cv_.notify_one();
}

void Worker::take_incoming() {
  while (!incoming_.empty()) {
    active_.push_back(std::move(incoming_.front()));
    incoming_.pop_front();
  }
  has_incoming_.store(false, std::memory_order_relaxed);
}

void Worker::run() {
  std::vector<Piece*> batch;
  batch.reserve(depth_);
  for (;;) {
    if (active_.empty() && inflight_ == 0 && retry_.empty() && drain_.empty()) {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !incoming_.empty(); });
      if (incoming_.empty()) return;  // stopped, and every queued task is finished
      take_incoming();
    } else if (has_incoming_.load(std::memory_order_acquire)) {  // busy: lock only when there is news
      std::lock_guard<std::mutex> lk(mu_);
      take_incoming();
    }
    batch.clear();
    if (fill(batch)) submit(batch);
    // Collect what is done; then copy while the device works; block only when there is nothing to do.
    if (!(inflight_ > 0 && reap(0) > 0) && !copy_aside() && !can_fill() && inflight_ > 0) reap(1);
    retire_finished_tasks();
  }
}

bool Worker::can_fill() {
  if (inflight_ >= static_cast<int>(depth_)) return false;
  return !retry_.empty() || !staged_.empty() || (!free_.empty() && next_task() != nullptr);
}

Task* Worker::next_task() {
  for (auto& t : active_) {
    if (t->req->failed()) t->cursor = t->end;  // stop issuing pieces of a failed request
    if (t->cursor < t->end) return t.get();
  }
  return nullptr;
}

// Bounce copies kept off the submission path: with the queue full, the next write pieces are copied into
// spare slots (staged), and finished reads are copied out of theirs (drained), while the device works.
// Done inline before a submit or after a reap, the copies left the device idle: bounced writes ran at
// about 0.55x of zero-copy ones.
bool Worker::copy_aside() {
  if (!drain_.empty()) {
    Slot& s = *drain_.back();
    drain_.pop_back();
    copy_streaming(s.user, s.bounce, s.total);
    s.task->req->add_bytes(static_cast<int64_t>(s.total));
    release(s);
    return true;
  }
  if (inflight_ < static_cast<int>(depth_) || free_.empty() || staged_.size() >= depth_) return false;
  Task* t = next_task();
  if (!t || !will_bounce_write(*t)) return false;
  Slot* s = free_.back();
  free_.pop_back();
  prepare(*s, *t);
  if (s->task) staged_.push_back(s);
  return true;
}

bool Worker::will_bounce_write(const Task& t) {
  const RequestLayout& L = t.req->layout();
  return L.op == Op::write && !L.random && L.bounce_middle && t.req->file().direct() && t.cursor >= L.head_end &&
         t.cursor < L.tail_start;
}

bool Worker::fill(std::vector<Piece*>& batch) {
  const size_t room = inflight_ < static_cast<int>(depth_) ? depth_ - static_cast<size_t>(inflight_) : 0;
  const size_t cap = std::min<size_t>(batch_, room);
  while (!retry_.empty() && batch.size() < cap) {
    batch.push_back(retry_.back());
    retry_.pop_back();
  }
  while (!staged_.empty() && batch.size() < cap) {
    Slot* s = staged_.front();
    staged_.pop_front();
    if (s->task->req->failed()) {
      release(*s);
    } else {
      if (s->task->req->layout().record_latency) s->start_ns = now_ns();  // latency counts from submission
      batch.push_back(s);
    }
  }
  while (batch.size() < cap && !free_.empty()) {
    Task* t = next_task();
    if (!t) break;
    Slot* s = free_.back();
    free_.pop_back();
    prepare(*s, *t);
    if (s->task) batch.push_back(s);
  }
  return !batch.empty();
}

void Worker::prepare(Slot& s, Task& t) {
  const RequestLayout& L = t.req->layout();
  OpenFile& f = t.req->file();
  int64_t pos, end;
  bool direct;
  if (L.random) {
    int64_t i = t.cursor++;
    pos = random_piece_offset(L.seed, i, L.span, L.block);
    end = pos + L.block;
    s.user = L.buf + (i % L.slots) * L.block;
    direct = f.direct();
  } else {
    pos = t.cursor;
    if (!f.direct()) {
      end = pos + std::min<int64_t>(L.block, t.end - pos);
      direct = false;
    } else if (pos < L.head_end) {
      end = std::min(L.head_end, t.end);
      direct = false;
    } else if (pos >= L.tail_start) {
      end = t.end;
      direct = false;
    } else {
      end = pos + std::min<int64_t>({static_cast<int64_t>(L.block), L.tail_start - pos, t.end - pos});
      direct = true;
    }
    s.user = L.buf + (pos - L.offset);
    t.cursor = end;
  }
  s.fd = direct ? f.direct_fd() : f.buffered_fd();
  s.op = L.op;
  s.offset = pos;
  s.total = s.len = static_cast<size_t>(end - pos);
  s.moved = 0;
  s.retries = 0;
  s.direct = direct;
  s.bounced = direct && !L.random && L.bounce_middle;
  s.task = &t;
  t.inflight++;
  s.buf = s.user;
  if (s.bounced) {
    if (s.bounce_size < s.total && s.total <= slot_bytes_ && arena()) {
      s.bounce = arena_ + static_cast<size_t>(&s - slots_.data()) * slot_bytes_;
      s.bounce_size = slot_bytes_;
      s.bounce_owned = false;
    }
    if (s.bounce_size < s.total) {  // a piece larger than a slot (alignment above block_size): own buffer
      if (s.bounce_owned && s.bounce) {
        std::free(s.bounce);
        g_bounce_bytes -= s.bounce_size;
      }
      s.bounce_owned = true;
      s.bounce_size = 0;
      size_t size = (s.total + 4095) & ~size_t(4095);
      if (posix_memalign(reinterpret_cast<void**>(&s.bounce), 4096, size) != 0) {
        s.bounce = nullptr;
        t.req->fail(ENOMEM, pos, "allocating a bounce buffer for " + describe(s, "failed"));
        release(s);
        return;
      }
      s.bounce_size = size;
      g_bounce_bytes += size;
    }
    if (s.op == Op::write) copy_streaming(s.bounce, s.user, s.total);
    s.buf = s.bounce;
  }
  if (L.record_latency) s.start_ns = now_ns();
}

void Worker::submit(std::vector<Piece*>& batch) {
  size_t i = 0;
  int idle_tries = 0;
  while (i < batch.size()) {
    if (broken_) {  // given up, maybe by the reap below
      for (; i < batch.size(); i++) {
        auto& s = static_cast<Slot&>(*batch[i]);
        s.task->req->fail(broken_, s.offset,
                          describe(s, "not started: this handle's I/O engine stopped working (collecting "
                                      "completions kept failing); make a new handle"));
        release(s);
      }
      return;
    }
    int rc = ops_.submit(ctx_, &batch[i], static_cast<int>(batch.size() - i));
    if (rc > 0) {
      for (int k = 0; k < rc; k++) static_cast<Slot*>(batch[i + static_cast<size_t>(k)])->in_engine = true;
      inflight_ += rc;
      i += static_cast<size_t>(rc);
      idle_tries = 0;
    } else if (rc == 0 && inflight_ > 0) {
      reap(1);  // the queue is full: make room
    } else if (rc == 0 && ++idle_tries < 1000) {
      std::this_thread::yield();  // kernel out of resources with nothing of ours in flight: retry a while
    } else {
      // The engine refused this piece outright (e.g. EINVAL from io_submit): it fails alone.
      auto& s = static_cast<Slot&>(*batch[i++]);
      s.result = rc < 0 && rc != -EAGAIN ? rc : -EBUSY;  // not -EAGAIN: that would be retried forever
      complete(s);
      idle_tries = 0;
    }
  }
}

int Worker::reap(int min_wait) {
  if (broken_) return 0;
  int n = ops_.reap(ctx_, done_.data(), static_cast<int>(depth_), min_wait);
  if (n < 0) {
    // The engine itself failed (not one request): fail everything queued here; in-flight pieces are
    // still collected if it recovers. If it does not, give it up rather than wait forever (close() would hang).
    for (auto& t : active_) t->req->fail(-n, t->cursor, std::string("collecting completions failed"));
    if (++reap_failures_ >= kMaxReapFailures) {
      give_up_engine(-n);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(reap_failures_, 20)));
    }
    return 0;
  }
  reap_failures_ = 0;
  inflight_ -= n;
  for (int i = 0; i < n; i++) {
    static_cast<Slot*>(done_[i])->in_engine = false;
    complete(static_cast<Slot&>(*done_[i]));
  }
  return n;
}

void Worker::give_up_engine(int err) {
  broken_ = err;
  // Cleanup first: it ends or waits out what the kernel still holds (io_destroy waits for AIO; the fault
  // engine drains its inner one), so the slots are free before their requests complete.
  ops_.cleanup(ctx_);
  ctx_ = nullptr;
  for (auto& s : slots_) {
    if (!s.in_engine) continue;
    s.in_engine = false;
    inflight_--;
    s.task->req->fail(err, s.offset, describe(s, "abandoned: collecting completions kept failing"));
    release(s);
  }
}

void Worker::complete(Slot& s) {
  Task& t = *s.task;
  Request& r = *t.req;
  const int64_t res = s.result;
  const bool transient = res == -EINTR || res == -EAGAIN;
  if (transient && !r.failed() && ++s.retries <= kMaxRetries) {
    retry_.push_back(&s);
    return;
  }
  if (res < 0) {
    std::string what = "failed";
    if (transient && s.retries > kMaxRetries)
      what = "failed " + std::to_string(kMaxRetries + 1) + " times in a row";
    if (res == -EFAULT)
      what = s.op == Op::read ? "failed: the destination memory is not writable (a read-only mapping?)"
                              : "failed: the source memory is not readable";
    if (res == -EINVAL && s.direct)
      what = "failed (O_DIRECT needs buffer, offset and length aligned to " +
             std::to_string(r.file().alignment().offset) + " bytes; does the file system support it?)";
    r.fail(static_cast<int>(-res), s.offset, describe(s, what.c_str()));
    release(s);
    return;
  }
  s.moved += static_cast<size_t>(res);
  if (s.moved < s.total) {
    bool misaligned = s.direct && (s.moved % r.file().alignment().offset) != 0;
    if (res == 0 || misaligned) {
      // A read that stops short ran into the end of the file; a write that stops short hit a full disk.
      if (s.op == Op::read)
        r.fail(ENODATA, s.offset, describe(s, "ran past the end of the file"));
      else
        r.fail(ENOSPC, s.offset, describe(s, "stopped short"));
      release(s);
      return;
    }
    s.buf = static_cast<char*>(s.buf) + res;
    s.offset += res;
    s.len -= static_cast<size_t>(res);
    retry_.push_back(&s);
    return;
  }
  if (r.layout().record_latency) t.latencies.push_back(static_cast<uint64_t>(now_ns() - s.start_ns));
  if (s.bounced && s.op == Op::read) {
    drain_.push_back(&s);  // copied out by copy_aside(), keeping its slot until then
    return;
  }
  r.add_bytes(static_cast<int64_t>(s.total));
  release(s);
}

void Worker::release(Slot& s) {
  s.task->inflight--;
  s.task = nullptr;
  free_.push_back(&s);
}

void Worker::retire_finished_tasks() {
  for (auto it = active_.begin(); it != active_.end();) {
    Task& t = **it;
    if (t.req->failed()) t.cursor = t.end;
    if (t.cursor >= t.end && t.inflight == 0) {
      t.req->task_finished(std::move(t.latencies));
      it = active_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace swapio::io
