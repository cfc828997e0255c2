#include "io/inline_engine.h"

#include <cerrno>
#include <new>
#include <vector>

namespace swapio::io {
namespace {

struct InlineContext {
  std::vector<Piece*> finished;  // completed in submit(), handed out by reap()
};

}  // namespace

int inline_init(unsigned depth, void** out) {
  auto* c = new (std::nothrow) InlineContext;
  if (!c) return -ENOMEM;
  c->finished.reserve(depth);
  *out = c;
  return 0;
}

void inline_finished(void* ctx, Piece* piece) { static_cast<InlineContext*>(ctx)->finished.push_back(piece); }

int inline_reap(void* ctx, Piece** done, int max, int) {
  auto* c = static_cast<InlineContext*>(ctx);
  int n = 0;
  while (n < max && !c->finished.empty()) {
    done[n++] = c->finished.back();
    c->finished.pop_back();
  }
  return n;
}

void inline_cleanup(void* ctx) { delete static_cast<InlineContext*>(ctx); }

}  // namespace swapio::io
