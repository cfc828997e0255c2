#include "io/engine.h"

namespace swapio::io {

const EngineOps* find_engine(const std::string& name) {
  for (const EngineOps* ops : {&aio_engine, &uring_engine, &psync_engine, &null_engine})
    if (name == ops->name) return ops;
  return nullptr;
}

const std::vector<const EngineOps*>& auto_engine_order() {
  static const std::vector<const EngineOps*> order = {&uring_engine, &aio_engine, &psync_engine};
  return order;
}

int probe_engine(const EngineOps& ops) {
  void* ctx = nullptr;
  int rc = ops.init(8, &ctx);
  if (rc == 0) ops.cleanup(ctx);
  return rc;
}

}  // namespace swapio::io
