// Linux native AIO through raw system calls (no libaio): io_setup / io_submit / io_getevents.
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <vector>

#include "io/engine.h"

namespace swapio::io {
namespace {

static_assert(sizeof(iocb) <= sizeof(Piece::engine_data), "iocb must fit a piece's scratch space");

struct AioContext {
  aio_context_t ctx = 0;
  std::vector<io_event> events;
};

int aio_init(unsigned depth, void** out) {
  auto* c = new (std::nothrow) AioContext;
  if (!c) return -ENOMEM;
  if (syscall(SYS_io_setup, depth, &c->ctx) < 0) {
    int err = errno;
    delete c;
    return -err;
  }
  c->events.resize(depth);
  *out = c;
  return 0;
}

int aio_submit(void* ctx, Piece** pieces, int n) {
  auto* c = static_cast<AioContext*>(ctx);
  iocb* cbs[256];
  if (n > 256) n = 256;
  for (int i = 0; i < n; i++) {
    Piece* p = pieces[i];
    auto* cb = reinterpret_cast<iocb*>(p->engine_data);
    std::memset(cb, 0, sizeof(*cb));
    cb->aio_lio_opcode = p->op == Op::read ? IOCB_CMD_PREAD : IOCB_CMD_PWRITE;
    cb->aio_fildes = static_cast<uint32_t>(p->fd);
    cb->aio_buf = reinterpret_cast<uint64_t>(p->buf);
    cb->aio_nbytes = p->len;
    cb->aio_offset = p->offset;
    cb->aio_data = reinterpret_cast<uint64_t>(p);
    cbs[i] = cb;
  }
  long rc = syscall(SYS_io_submit, c->ctx, static_cast<long>(n), cbs);
  if (rc >= 0) return static_cast<int>(rc);
  return errno == EAGAIN ? 0 : -errno;
}

int aio_reap(void* ctx, Piece** done, int max, int min_wait) {
  auto* c = static_cast<AioContext*>(ctx);
  if (max > static_cast<int>(c->events.size())) max = static_cast<int>(c->events.size());
  long rc;
  do {
    rc = syscall(SYS_io_getevents, c->ctx, static_cast<long>(min_wait), static_cast<long>(max),
                 c->events.data(), nullptr);
  } while (rc < 0 && errno == EINTR);
  if (rc < 0) return -errno;
  for (long i = 0; i < rc; i++) {
    auto* p = reinterpret_cast<Piece*>(c->events[i].data);
    p->result = c->events[i].res;  // bytes moved, or -errno
    done[i] = p;
  }
  return static_cast<int>(rc);
}

void aio_cleanup(void* ctx) {
  auto* c = static_cast<AioContext*>(ctx);
  syscall(SYS_io_destroy, c->ctx);
  delete c;
}

}  // namespace

const EngineOps aio_engine = {"aio", false, true, aio_init, aio_submit, aio_reap, aio_cleanup};

}  // namespace swapio::io
