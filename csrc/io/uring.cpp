// io_uring through raw system calls (no liburing): one ring per worker, IORING_OP_READ/WRITE.
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

#include "io/engine.h"

namespace swapio::io {
namespace {

struct Ring {
  int fd = -1;
  void* sq_map = MAP_FAILED;
  size_t sq_map_size = 0;
  void* cq_map = MAP_FAILED;
  size_t cq_map_size = 0;
  io_uring_sqe* sqes = static_cast<io_uring_sqe*>(MAP_FAILED);
  size_t sqes_size = 0;
  unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, sq_entries;
  unsigned *cq_head, *cq_tail, *cq_mask;
  io_uring_cqe* cqes;
  unsigned unsubmitted = 0;  // SQEs placed in the ring but not yet taken by the kernel
};

unsigned load_acquire(const unsigned* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store_release(unsigned* p, unsigned v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

int enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  long rc = syscall(SYS_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0);
  return rc < 0 ? -errno : static_cast<int>(rc);
}

void unmap(Ring* r) {
  if (r->sqes != MAP_FAILED) munmap(r->sqes, r->sqes_size);
  if (r->cq_map != MAP_FAILED && r->cq_map != r->sq_map) munmap(r->cq_map, r->cq_map_size);
  if (r->sq_map != MAP_FAILED) munmap(r->sq_map, r->sq_map_size);
  if (r->fd >= 0) close(r->fd);
}

int uring_init(unsigned depth, void** out) {
  auto* r = new (std::nothrow) Ring;
  if (!r) return -ENOMEM;
  io_uring_params p;
  std::memset(&p, 0, sizeof(p));
  long fd = syscall(SYS_io_uring_setup, depth, &p);
  if (fd < 0) {
    int err = errno;
    delete r;
    return -err;
  }
  r->fd = static_cast<int>(fd);
  r->sq_map_size = p.sq_off.array + p.sq_entries * sizeof(unsigned);
  r->cq_map_size = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
  bool single_map = p.features & IORING_FEAT_SINGLE_MMAP;
  if (single_map) r->sq_map_size = r->cq_map_size = std::max(r->sq_map_size, r->cq_map_size);
  r->sq_map = mmap(nullptr, r->sq_map_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                   IORING_OFF_SQ_RING);
  if (r->sq_map != MAP_FAILED)
    r->cq_map = single_map ? r->sq_map
                           : mmap(nullptr, r->cq_map_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                                  r->fd, IORING_OFF_CQ_RING);
  r->sqes_size = p.sq_entries * sizeof(io_uring_sqe);
  if (r->cq_map != MAP_FAILED)
    r->sqes = static_cast<io_uring_sqe*>(mmap(nullptr, r->sqes_size, PROT_READ | PROT_WRITE,
                                              MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES));
  if (r->sqes == MAP_FAILED) {
    int err = errno;
    unmap(r);
    delete r;
    return -err;
  }
  auto* sq = static_cast<char*>(r->sq_map);
  auto* cq = static_cast<char*>(r->cq_map);
  r->sq_head = reinterpret_cast<unsigned*>(sq + p.sq_off.head);
  r->sq_tail = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
  r->sq_mask = reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
  r->sq_array = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
  r->sq_entries = p.sq_entries;
  r->cq_head = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
  r->cq_tail = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
  r->cq_mask = reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
  r->cqes = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
  *out = r;
  return 0;
}

// Hands placed SQEs to the kernel; a busy ring keeps them queued for the next enter (from reap).
int flush(Ring* r, unsigned min_complete, unsigned flags) {
  for (;;) {
    int rc = enter(r->fd, r->unsubmitted, min_complete, flags);
    if (rc >= 0) {
      r->unsubmitted -= static_cast<unsigned>(rc) < r->unsubmitted ? static_cast<unsigned>(rc) : r->unsubmitted;
      return 0;
    }
    if (rc == -EINTR) continue;
    if (rc == -EAGAIN || rc == -EBUSY) return 0;
    return rc;
  }
}

int uring_submit(void* ctx, Piece** pieces, int n) {
  auto* r = static_cast<Ring*>(ctx);
  unsigned tail = *r->sq_tail;
  unsigned space = r->sq_entries - (tail - load_acquire(r->sq_head));
  unsigned take = static_cast<unsigned>(n) < space ? static_cast<unsigned>(n) : space;
  for (unsigned i = 0; i < take; i++) {
    Piece* p = pieces[i];
    unsigned idx = tail & *r->sq_mask;
    io_uring_sqe* sqe = &r->sqes[idx];
    std::memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = p->op == Op::read ? IORING_OP_READ : IORING_OP_WRITE;
    sqe->fd = p->fd;
    sqe->addr = reinterpret_cast<uint64_t>(p->buf);
    sqe->len = static_cast<uint32_t>(p->len);
    sqe->off = static_cast<uint64_t>(p->offset);
    sqe->user_data = reinterpret_cast<uint64_t>(p);
    r->sq_array[idx] = idx;
    tail++;
  }
  store_release(r->sq_tail, tail);
  r->unsubmitted += take;
  int rc = flush(r, 0, 0);
  // Placed SQEs stay in the ring whatever enter() said: report them as taken (reap() flushes them again
  // and reports a lasting error), never as refused, or the worker would reuse slots the kernel still owns.
  return take > 0 ? static_cast<int>(take) : rc;
}

int uring_reap(void* ctx, Piece** done, int max, int min_wait) {
  auto* r = static_cast<Ring*>(ctx);
  unsigned head = *r->cq_head;
  if (head == load_acquire(r->cq_tail) && (min_wait > 0 || r->unsubmitted > 0)) {
    int rc = flush(r, static_cast<unsigned>(min_wait), min_wait > 0 ? IORING_ENTER_GETEVENTS : 0);
    if (rc < 0) return rc;
  }
  int n = 0;
  unsigned tail = load_acquire(r->cq_tail);
  while (head != tail && n < max) {
    io_uring_cqe* cqe = &r->cqes[head & *r->cq_mask];
    auto* p = reinterpret_cast<Piece*>(cqe->user_data);
    p->result = cqe->res;  // bytes moved, or -errno
    done[n++] = p;
    head++;
  }
  store_release(r->cq_head, head);
  return n;
}

void uring_cleanup(void* ctx) {
  auto* r = static_cast<Ring*>(ctx);
  unmap(r);
  delete r;
}

}  // namespace

const EngineOps uring_engine = {"uring", false, true, uring_init, uring_submit, uring_reap, uring_cleanup};

}  // namespace swapio::io
