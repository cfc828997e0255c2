#pragma once
// Shared plumbing of the engines that finish pieces inside submit() (psync, null): a list of finished
// pieces that reap() hands out. Defined in inline_engine.cpp.
#include "io/engine.h"

namespace swapio::io {

int inline_init(unsigned depth, void** ctx);
void inline_finished(void* ctx, Piece* piece);  // piece->result is set
int inline_reap(void* ctx, Piece** done, int max, int min_wait);
void inline_cleanup(void* ctx);

}  // namespace swapio::io
