// Portable engine: plain pread/pwrite, done inside submit() (like fio's sync engine). Parallelism comes from
// the handle's worker threads. Also the engine for file systems without O_DIRECT (ramfs, some FUSE).
#include <unistd.h>

#include <cerrno>
#include <new>
#include <vector>

#include "io/engine.h"

namespace swapio::io {
namespace {

struct SyncContext {
  std::vector<Piece*> finished;  // completed in submit(), handed out by reap()
};

int sync_init(unsigned depth, void** out) {
  auto* c = new (std::nothrow) SyncContext;
  if (!c) return -ENOMEM;
  c->finished.reserve(depth);
  *out = c;
  return 0;
}

int64_t transfer(const Piece& p) {
  ssize_t rc;
  do {
    rc = p.op == Op::read ? ::pread(p.fd, p.buf, p.len, p.offset) : ::pwrite(p.fd, p.buf, p.len, p.offset);
  } while (rc < 0 && errno == EINTR);
  return rc < 0 ? -errno : rc;
}

int sync_submit(void* ctx, Piece** pieces, int n) {
  auto* c = static_cast<SyncContext*>(ctx);
  for (int i = 0; i < n; i++) {
    pieces[i]->result = transfer(*pieces[i]);
    c->finished.push_back(pieces[i]);
  }
  return n;
}

int drain(void* ctx, Piece** done, int max, int) {
  auto* c = static_cast<SyncContext*>(ctx);
  int n = 0;
  while (n < max && !c->finished.empty()) {
    done[n++] = c->finished.back();
    c->finished.pop_back();
  }
  return n;
}

void sync_cleanup(void* ctx) { delete static_cast<SyncContext*>(ctx); }

// null: completes every piece at once with its full length; tests the handle's splitting and queueing
// without a disk (like fio's engines/null.c).
int null_submit(void* ctx, Piece** pieces, int n) {
  auto* c = static_cast<SyncContext*>(ctx);
  for (int i = 0; i < n; i++) {
    pieces[i]->result = static_cast<int64_t>(pieces[i]->len);
    c->finished.push_back(pieces[i]);
  }
  return n;
}

}  // namespace

const EngineOps psync_engine = {"psync", true, sync_init, sync_submit, drain, sync_cleanup};
const EngineOps null_engine = {"null", true, sync_init, null_submit, drain, sync_cleanup};

}  // namespace swapio::io
