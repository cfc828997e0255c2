// Portable engine: plain pread/pwrite, done inside submit() (like fio's sync engine). Parallelism comes from
// the handle's worker threads. Also the engine for file systems without O_DIRECT (ramfs, some FUSE).
#include <unistd.h>

#include <cerrno>

#include "io/inline_engine.h"

namespace swapio::io {
namespace {

int64_t transfer(const Piece& p) {
  ssize_t rc;
  do {
    rc = p.op == Op::read ? ::pread(p.fd, p.buf, p.len, p.offset) : ::pwrite(p.fd, p.buf, p.len, p.offset);
  } while (rc < 0 && errno == EINTR);
  return rc < 0 ? -errno : rc;
}

int psync_submit(void* ctx, Piece** pieces, int n) {
  for (int i = 0; i < n; i++) {
    pieces[i]->result = transfer(*pieces[i]);
    inline_finished(ctx, pieces[i]);
  }
  return n;
}

}  // namespace

const EngineOps psync_engine = {"psync", true, true, inline_init, psync_submit, inline_reap, inline_cleanup};

}  // namespace swapio::io
