// null: completes every piece at once with its full length and moves no data. It tests the handle's
// splitting, queueing and error paths without a disk, and measures swapio's own overhead (like fio's
// engines/null.c).
#include "io/inline_engine.h"

namespace swapio::io {
namespace {

int null_submit(void* ctx, Piece** pieces, int n) {
  for (int i = 0; i < n; i++) {
    pieces[i]->result = static_cast<int64_t>(pieces[i]->len);
    inline_finished(ctx, pieces[i]);
  }
  return n;
}

}  // namespace

const EngineOps null_engine = {"null", true, false, inline_init, null_submit, inline_reap, inline_cleanup};

}  // namespace swapio::io
