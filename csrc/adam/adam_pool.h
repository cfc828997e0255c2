#pragma once
// The Adam kernel's own thread pool: persistent workers, started lazily and only as many as asked for;
// work is cut into tiles handed out through an atomic counter, and the calling thread works too.
//
// One job runs at a time (a second caller waits for the first). Workers are joined by a static destructor
// at process exit; a call after that, or in a child after fork(), runs on the calling thread (a forked child
// starts a fresh pool on its next parallel call; the parent's workers do not exist there).
#include <cstdint>

namespace swapio {
namespace adam {

using TileFn = void (*)(const void* ctx, int64_t begin, int64_t end);

// Runs fn(ctx, b, e) over [0, n) in tiles of `tile` elements on up to `threads` threads (the caller is one).
// Returns when every tile is done; the tiles' writes are visible to the caller then.
void parallel_for(int64_t n, int64_t tile, int threads, TileFn fn, const void* ctx);

// Worker threads started so far (not counting callers).
int pool_workers();

}  // namespace adam
}  // namespace swapio
