#include "io/engine.h"

#include <cstdlib>

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

std::string resolve_engine_request(const std::string& requested) {
  if (requested != "auto") return requested;
  const char* forced = std::getenv("SWAPIO_ENGINE");
  return forced && *forced ? std::string(forced) : requested;
}

int probe_engine(const EngineOps& ops) {
  void* ctx = nullptr;
  int rc = ops.init(8, &ctx);
  if (rc == 0) ops.cleanup(ctx);
  return rc;
}

}  // namespace swapio::io
