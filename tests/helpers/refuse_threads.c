/* LD_PRELOAD shim for tests: pthread_create fails with EAGAIN, as at a process's thread limit (ulimit -u, a
 * container's pids.max), once refuse_threads_after(n) was called and n more threads have started; n < 0 lifts it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>

static atomic_int allowed = -1; /* threads that may still start; -1: no limit */

void refuse_threads_after(int n) { atomic_store(&allowed, n); }

int pthread_create(pthread_t *thread, const pthread_attr_t *attr, void *(*start)(void *), void *arg) {
  typedef int (*create_fn)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);
  static create_fn real;
  if (!real) real = (create_fn)dlsym(RTLD_NEXT, "pthread_create");
  int left = atomic_load(&allowed);
  while (left >= 0) {
    if (left == 0) return EAGAIN;
    if (atomic_compare_exchange_weak(&allowed, &left, left - 1)) break;
  }
  return real(thread, attr, start, arg);
}
