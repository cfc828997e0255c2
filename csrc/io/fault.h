#pragma once
// Fault injection, a testing aid: a handle made with a fault spec (HandleOptions::fault, else the
// SWAPIO_FAULT environment variable, read when the handle is created) wraps its engine so that chosen pieces
// fail, complete short, or make reap() fail. Tests use it to drive every engine through its error paths.
//
// Spec: comma-separated key=value, e.g. "piece=3,errno=EIO,count=2".
//   errno = EIO | ENOSPC | EINTR | EAGAIN | EFAULT  the piece completes with -errno
//         | short                                   the piece completes with about half its bytes
//         | reap                                    collecting completions fails with EIO
//   piece = N      the first piece (1-based, counted across the handle's workers) to fault; default 1
//   count = K|all  how many pieces fault (for reap: how many reap calls fail); default 1
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "io/engine.h"

namespace swapio::io {

struct FaultSpec {
  enum class Kind { none, error, short_transfer, reap };
  Kind kind = Kind::none;
  int err = 0;          // Kind::error: the errno pieces complete with
  int64_t piece = 1;
  int64_t count = 1;    // -1: every one from `piece` on
};

FaultSpec parse_fault_spec(const std::string& text);  // "" -> Kind::none; throws ArgError naming the problem

// What a handle's engine contexts share: the spec and the counters.
struct FaultPlan {
  explicit FaultPlan(FaultSpec s) : spec(s), left(s.count) {}
  FaultSpec spec;
  std::atomic<int64_t> pieces{0};  // pieces handed to the engine so far
  std::atomic<int64_t> left;       // faults still to inject (-1: no limit)
  std::atomic<bool> reap_armed{false};
  bool take();                     // consumes one fault if any is left
};

// The ops table that runs `inner` under a plan; the engine name stays inner's.
const EngineOps& faulty_ops(const EngineOps& inner);
// Wraps a context of `inner` (taking ownership); the result is a context of faulty_ops(inner).
int wrap_with_faults(const EngineOps& inner, void* inner_ctx, std::shared_ptr<FaultPlan> plan, void** out);

}  // namespace swapio::io
