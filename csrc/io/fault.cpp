#include "io/fault.h"

#include <algorithm>
#include <cerrno>
#include <new>
#include <sstream>
#include <vector>

#include "common/errors.h"

namespace swapio::io {
namespace {

struct FaultContext {
  const EngineOps* inner;
  void* inner_ctx;
  std::shared_ptr<FaultPlan> plan;
  std::vector<Piece*> failed;     // completed with an injected error, not yet reaped
  std::vector<Piece*> shortened;  // in the engine; their completion is cut short
  int64_t in_engine = 0;          // pieces the inner engine holds
};

int64_t parse_count(const std::string& key, const std::string& v, int64_t min) {
  if (key == "count" && v == "all") return -1;
  try {
    size_t used = 0;
    long long n = std::stoll(v, &used);
    if (used == v.size() && n >= min) return n;
  } catch (const std::exception&) {
  }
  throw ArgError("fault spec: " + key + " must be an integer >= " + std::to_string(min) +
                 (key == "count" ? " or 'all'" : "") + ", got '" + v + "'");
}

int fault_submit(void* c, Piece** pieces, int n) {
  auto* f = static_cast<FaultContext*>(c);
  FaultPlan& plan = *f->plan;
  int taken = 0;
  // One piece at a time, so that each is counted once, when the engine takes it.
  for (; taken < n; taken++) {
    Piece* p = pieces[taken];
    const int64_t k = plan.pieces.fetch_add(1) + 1;
    const bool reached = k >= plan.spec.piece;
    const bool fault = reached && plan.spec.kind != FaultSpec::Kind::reap && plan.take();
    if (fault && plan.spec.kind == FaultSpec::Kind::error) {
      p->result = -plan.spec.err;
      f->failed.push_back(p);
      continue;
    }
    int rc = f->inner->submit(f->inner_ctx, &p, 1);
    if (rc <= 0) {
      plan.pieces.fetch_sub(1);
      if (fault && plan.left.load() >= 0) plan.left.fetch_add(1);  // not injected after all
      return taken > 0 ? taken : rc;
    }
    f->in_engine++;
    if (fault && plan.spec.kind == FaultSpec::Kind::short_transfer) f->shortened.push_back(p);
    if (reached && plan.spec.kind == FaultSpec::Kind::reap) plan.reap_armed.store(true);
  }
  return taken;
}

// About half of the piece, in whole 4 KiB blocks where it can be, so an O_DIRECT piece can resume.
int64_t shortened_result(const Piece& p) {
  const int64_t half = static_cast<int64_t>(p.len / 2);
  return half >= 4096 ? half / 4096 * 4096 : half;
}

int fault_reap(void* c, Piece** done, int max, int min_wait) {
  auto* f = static_cast<FaultContext*>(c);
  FaultPlan& plan = *f->plan;
  if (plan.reap_armed.load() && plan.take()) return -EIO;
  int n = 0;
  while (n < max && !f->failed.empty()) {
    done[n++] = f->failed.back();
    f->failed.pop_back();
  }
  if (n == max) return n;
  int rc = f->inner->reap(f->inner_ctx, done + n, max - n, n > 0 ? 0 : min_wait);
  if (rc < 0) return n > 0 ? n : rc;
  f->in_engine -= rc;
  for (int i = n; i < n + rc; i++) {
    auto it = std::find(f->shortened.begin(), f->shortened.end(), done[i]);
    if (it == f->shortened.end()) continue;
    f->shortened.erase(it);
    if (done[i]->result > 0) done[i]->result = std::min(done[i]->result, shortened_result(*done[i]));
  }
  return n + rc;
}

void fault_cleanup(void* c) {
  auto* f = static_cast<FaultContext*>(c);
  // The worker gave these up (reap kept failing): let them finish before the memory they use goes.
  std::vector<Piece*> sink(64);
  while (f->in_engine > 0) {
    int rc = f->inner->reap(f->inner_ctx, sink.data(), static_cast<int>(sink.size()), 1);
    if (rc < 0) break;
    f->in_engine -= rc;
  }
  f->inner->cleanup(f->inner_ctx);
  delete f;
}

int fault_init(unsigned, void**) { return -EINVAL; }  // contexts come from wrap_with_faults

const EngineOps fault_sync = {"fault", true, true, fault_init, fault_submit, fault_reap, fault_cleanup};
const EngineOps fault_async = {"fault", false, true, fault_init, fault_submit, fault_reap, fault_cleanup};

}  // namespace

bool FaultPlan::take() {
  int64_t n = left.load();
  while (n != 0) {
    if (n < 0) return true;
    if (left.compare_exchange_weak(n, n - 1)) return true;
  }
  return false;
}

FaultSpec parse_fault_spec(const std::string& text) {
  FaultSpec spec;
  if (text.empty()) return spec;
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    const size_t eq = item.find('=');
    if (eq == std::string::npos) throw ArgError("fault spec: expected key=value, got '" + item + "'");
    const std::string key = item.substr(0, eq), v = item.substr(eq + 1);
    if (key == "piece") {
      spec.piece = parse_count(key, v, 1);
    } else if (key == "count") {
      spec.count = parse_count(key, v, 1);
    } else if (key == "errno") {
      static const struct { const char* name; int err; } kErrors[] = {
          {"EIO", EIO}, {"ENOSPC", ENOSPC}, {"EINTR", EINTR}, {"EAGAIN", EAGAIN}, {"EFAULT", EFAULT}};
      spec.kind = FaultSpec::Kind::none;
      for (const auto& e : kErrors)
        if (v == e.name) spec.kind = FaultSpec::Kind::error, spec.err = e.err;
      if (v == "short") spec.kind = FaultSpec::Kind::short_transfer;
      if (v == "reap") spec.kind = FaultSpec::Kind::reap;
      if (spec.kind == FaultSpec::Kind::none)
        throw ArgError("fault spec: errno must be EIO, ENOSPC, EINTR, EAGAIN, EFAULT, short or reap, got '" + v + "'");
    } else {
      throw ArgError("fault spec: unknown key '" + key + "' (known: piece, errno, count)");
    }
  }
  if (spec.kind == FaultSpec::Kind::none) throw ArgError("fault spec '" + text + "' names no errno=");
  return spec;
}

const EngineOps& faulty_ops(const EngineOps& inner) { return inner.sync ? fault_sync : fault_async; }

int wrap_with_faults(const EngineOps& inner, void* inner_ctx, std::shared_ptr<FaultPlan> plan, void** out) {
  auto* f = new (std::nothrow) FaultContext{&inner, inner_ctx, std::move(plan), {}, {}, 0};
  if (!f) return -ENOMEM;
  *out = f;
  return 0;
}

}  // namespace swapio::io
