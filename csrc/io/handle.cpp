#include "io/handle.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "common/errors.h"
#include "io/fault.h"
#include "mem/access.h"

namespace swapio::io {
namespace {

int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }
int64_t round_down(int64_t x, int64_t a) { return x / a * a; }

// Sets up one engine context per worker; all or nothing.
int create_contexts(const EngineOps& ops, unsigned depth, size_t n, std::vector<void*>& out) {
  for (size_t i = 0; i < n; i++) {
    void* ctx = nullptr;
    int rc = ops.init(depth, &ctx);
    if (rc < 0) {
      for (void* c : out) ops.cleanup(c);
      out.clear();
      return rc;
    }
    out.push_back(ctx);
  }
  return 0;
}

// Runs an open of the request's file: its error names the request's offset.
template <class Open>
auto at_offset(int64_t offset, Open open) {
  try {
    return open();
  } catch (const IoError& e) {
    throw IoError(e.err(), e.what(), e.path(), offset);
  }
}

std::shared_ptr<OpenFile> open_for(const std::string& path, Op op, DirectMode mode, int64_t offset,
                                   std::optional<FileIdentity> expect = std::nullopt) {
  return at_offset(offset, [&] { return std::make_shared<OpenFile>(path, op, mode, expect); });
}

// A bounce copy into (or out of) memory the process may not write (or read) would crash it: refuse first.
void check_memory(Op op, uintptr_t buf, int64_t length, const std::string& path, int64_t offset) {
  const bool read = op == Op::read;
  if (mem::check_access(reinterpret_cast<const void*>(buf), static_cast<size_t>(length),
                        read ? mem::Access::write : mem::Access::read) == 0)
    return;
  throw IoError(EFAULT,
                read ? "cannot read into this memory: it is not writable (a read-only mapping, such as a "
                       "read-only np.memmap?)"
                     : "cannot write from this memory: it is not readable",
                path, offset);
}

}  // namespace

Handle::Handle(HandleOptions options) : opt_(std::move(options)), pid_(getpid()) {
  if (opt_.block_size <= 0 || opt_.block_size > kMaxBlockSize)
    throw ArgError("block_size must be between 1 and 1 GiB, got " + std::to_string(opt_.block_size));
  if (opt_.queue_depth <= 0 || opt_.queue_depth > kMaxQueueDepth)
    throw ArgError("queue_depth must be between 1 and " + std::to_string(kMaxQueueDepth) + ", got " +
                   std::to_string(opt_.queue_depth));
  if (opt_.threads <= 0 || opt_.threads > kMaxThreads)
    throw ArgError("threads must be between 1 and " + std::to_string(kMaxThreads) + ", got " +
                   std::to_string(opt_.threads));
  if (opt_.submit_batch < 0)
    throw ArgError("submit_batch must be >= 0 (0: all ready pieces), got " + std::to_string(opt_.submit_batch));

  const std::string wanted = resolve_engine_request(opt_.engine);
  std::vector<const EngineOps*> candidates;
  if (wanted == "auto") {
    candidates = auto_engine_order();
  } else if (const EngineOps* ops = find_engine(wanted)) {
    candidates = {ops};
  } else {
    std::string names = "auto";
    for (const EngineOps* e : all_engines()) names += std::string(", ") + e->name;
    throw ArgError("unknown engine '" + wanted + "' (choose " + names + ")");
  }
  if (opt_.fault.empty()) {
    const char* env = std::getenv("SWAPIO_FAULT");
    if (env) opt_.fault = env;
  }
  const FaultSpec fault = parse_fault_spec(opt_.fault);
  const unsigned depth = static_cast<unsigned>(opt_.queue_depth);
  int last_rc = 0;
  for (const EngineOps* ops : candidates) {
    std::vector<void*> contexts;
    last_rc = create_contexts(*ops, depth, static_cast<size_t>(opt_.threads), contexts);
    if (last_rc < 0) continue;
    engine_ = ops->name;
    if (fault.kind != FaultSpec::Kind::none) {
      auto plan = std::make_shared<FaultPlan>(fault);
      for (void*& ctx : contexts) wrap_with_faults(*ops, ctx, plan, &ctx);  // cannot fail but for memory
      ops = &faulty_ops(*ops);
    }
    const unsigned batch = opt_.submit_batch > 0 ? static_cast<unsigned>(std::min<int64_t>(opt_.submit_batch, depth))
                                                 : depth;
    const size_t slot = static_cast<size_t>(std::max<int64_t>(opt_.block_size, 4096));
    // A worker that cannot be made (no thread for it) owns nothing: its context and the ones after it are
    // cleaned here, the workers already made by the members' destructor (each held an io_uring descriptor).
    for (size_t i = 0; i < contexts.size(); i++) {
      try {
        if (i == 0) workers_.reserve(contexts.size());  // (inside the try: a bad_alloc cleans the contexts too)
        workers_.push_back(std::make_unique<Worker>(*ops, contexts[i], depth, batch, slot));
      } catch (...) {
        for (size_t j = i; j < contexts.size(); j++) ops->cleanup(contexts[j]);
        throw;
      }
    }
    return;
  }
  throw IoError(-last_rc, "cannot set up I/O engine '" + wanted + "': " + std::strerror(-last_rc), "", 0);
}

Handle::~Handle() { close(); }

void Handle::close() {
  if (getpid() != pid_) {
    // A forked child: the workers' threads are not here and their locks may be held. Touching them would
    // hang or crash, so their memory is left alone (it is the parent's, copied).
    for (auto& w : workers_) static_cast<void>(w.release());
    workers_.clear();
    return;
  }
  std::vector<std::unique_ptr<Worker>> workers;
  {
    std::lock_guard<std::mutex> lk(mu_);
    workers.swap(workers_);
  }
  workers.clear();  // each worker finishes its queued work, then joins
}

bool Handle::closed() {
  if (getpid() != pid_) return true;
  std::lock_guard<std::mutex> lk(mu_);
  return workers_.empty();
}

std::shared_ptr<Request> Handle::submit(Op op, uintptr_t buf, int64_t length, const std::string& path,
                                        int64_t offset, bool record_latency, std::optional<FileIdentity> expect,
                                        bool staged) {
  if (offset < 0) throw ArgError("offset must be >= 0, got " + std::to_string(offset));
  if (length < 0) throw ArgError("length must be >= 0, got " + std::to_string(length));
  // Headroom for rounding to blocks and alignment, so no position computed from the request can overflow.
  if (offset > INT64_MAX - length - kMaxBlockSize) throw ArgError("offset + length overflows");
  if (buf == 0 && length > 0) throw ArgError("buffer pointer is null");
  check_usable();

  auto file = open_for(path, op, opt_.direct, offset, expect);
  RequestLayout L;
  L.op = op;
  L.buf = reinterpret_cast<char*>(buf);
  L.offset = offset;
  L.length = length;
  L.record_latency = record_latency;
  const int64_t end = offset + length;
  int64_t block = opt_.block_size;
  if (file->direct()) {
    const int64_t align = file->alignment().offset;
    const int64_t edge = file->alignment().edge;
    block = std::max(align, round_down(block, align));
    L.head_end = std::min(end, round_up(offset, edge));
    L.tail_start = std::max(L.head_end, round_down(end, edge));
    if (L.head_end > offset || L.tail_start < end) at_offset(offset, [&] { file->ensure_buffered_fd(); });
    L.bounce_middle = staged || (buf + static_cast<uintptr_t>(L.head_end - offset)) % file->alignment().mem != 0;
    if (L.bounce_middle) check_memory(op, buf, length, path, offset);
  } else {
    L.head_end = offset;
    L.tail_start = end;
  }
  L.block = static_cast<size_t>(block);

  // Stripes: the aligned middle is split into `threads` runs of whole blocks; the edges join the outer ones.
  const int64_t middle = L.tail_start - L.head_end;
  const int64_t blocks = (middle + block - 1) / block;
  const int64_t stripes = std::max<int64_t>(1, std::min<int64_t>(opt_.threads, blocks));
  const int64_t stripe_len = round_up((middle + stripes - 1) / stripes, block);
  std::vector<int64_t> bounds = {offset};
  for (int64_t i = 1; i < stripes; i++) {
    int64_t b = std::min(L.head_end + i * stripe_len, L.tail_start);
    if (b > bounds.back() && b < end) bounds.push_back(b);
  }
  bounds.push_back(end);

  auto req = std::make_shared<Request>(L, std::move(file), static_cast<int>(bounds.size() - 1));
  if (length == 0) {
    req->complete_now();
    return req;
  }
  dispatch(req, bounds);
  return req;
}

std::shared_ptr<Request> Handle::submit_random(Op op, uintptr_t buf, int64_t buf_len, const std::string& path,
                                               int64_t span, int64_t count, uint64_t seed,
                                               bool record_latency) {
  if (count <= 0) throw ArgError("count must be > 0");
  if (buf == 0 || buf_len < opt_.block_size)
    throw ArgError("the buffer must hold at least one block (" + std::to_string(opt_.block_size) + " bytes)");
  if (span < opt_.block_size) throw ArgError("span must hold at least one block");
  check_usable();
  auto file = open_for(path, op, opt_.direct, 0);
  if (file->direct()) {
    const Alignment& a = file->alignment();
    if (opt_.block_size % a.offset != 0 || buf % a.mem != 0)
      throw ArgError("random O_DIRECT I/O needs block_size a multiple of " + std::to_string(a.offset) +
                     " and a buffer aligned to " + std::to_string(a.mem));
  }
  RequestLayout L;
  L.op = op;
  L.buf = reinterpret_cast<char*>(buf);
  L.length = count * opt_.block_size;
  L.block = static_cast<size_t>(opt_.block_size);
  L.random = true;
  L.count = count;
  L.span = span;
  L.seed = seed;
  L.slots = buf_len / opt_.block_size;
  L.record_latency = record_latency;
  const int64_t stripes = std::min<int64_t>(opt_.threads, count);
  std::vector<int64_t> bounds;
  for (int64_t i = 0; i <= stripes; i++) bounds.push_back(count * i / stripes);
  auto req = std::make_shared<Request>(L, std::move(file), static_cast<int>(stripes));
  dispatch(req, bounds);
  return req;
}

void Handle::check_usable() {
  if (getpid() != pid_)
    throw ArgError("this handle was made in process " + std::to_string(pid_) +
                   " and does not work in a child after fork(): make a new handle in the child");
  if (closed()) throw ArgError("the handle is closed");
}

void Handle::dispatch(const std::shared_ptr<Request>& req, const std::vector<int64_t>& bounds) {
  std::lock_guard<std::mutex> lk(mu_);
  if (workers_.empty()) throw ArgError("the handle is closed");
  const uint64_t first = next_worker_.fetch_add(bounds.size() - 1);
  for (size_t i = 0; i + 1 < bounds.size(); i++) {
    auto task = std::make_unique<Task>();
    task->req = req;
    task->begin = task->cursor = bounds[i];
    task->end = bounds[i + 1];
    workers_[(first + i) % workers_.size()]->enqueue(std::move(task));
  }
}

}  // namespace swapio::io
