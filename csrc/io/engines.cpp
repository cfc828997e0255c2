#include "io/engine.h"

#include <cstdlib>

#include "common/errors.h"

namespace swapio::io {

const std::vector<const EngineOps*>& all_engines() {
  static const std::vector<const EngineOps*> all = {&uring_engine, &aio_engine, &psync_engine, &null_engine};
  return all;
}

const EngineOps* find_engine(const std::string& name) {
  for (const EngineOps* ops : all_engines())
    if (name == ops->name) return ops;
  return nullptr;
}

const std::vector<const EngineOps*>& auto_engine_order() {
  static const std::vector<const EngineOps*> order = {&uring_engine, &aio_engine, &psync_engine};
  return order;
}

// An unknown SWAPIO_ENGINE is an ArgError naming the variable: the caller asked for "auto", so "unknown engine"
// alone pointed at an argument nobody gave (and swapio.info() reported the unknown name as auto's pick).
std::string resolve_engine_request(const std::string& requested) {
  if (requested != "auto") return requested;
  const char* forced = std::getenv("SWAPIO_ENGINE");
  if (!forced || !*forced) return requested;
  const std::string name(forced);
  if (name != "auto" && !find_engine(name)) {
    std::string names;
    for (const EngineOps* e : all_engines()) names += (names.empty() ? "" : ", ") + std::string(e->name);
    throw ArgError("SWAPIO_ENGINE='" + name + "' names no engine (set it to one of " + names + ", or unset it)");
  }
  return name;
}

int probe_engine(const EngineOps& ops) {
  void* ctx = nullptr;
  int rc = ops.init(8, &ctx);
  if (rc == 0) ops.cleanup(ctx);
  return rc;
}

}  // namespace swapio::io
