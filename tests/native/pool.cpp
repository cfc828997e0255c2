// The Adam kernel's thread pool (adam/adam_pool.h): every element of a parallel_for is done exactly once, its
// writes are visible to the caller on return, and callers on several threads at once (one job at a time, the
// others wait) each get their own job done. Under ThreadSanitizer this checks the pool's hand-off: job
// publication, tile counter, completion and the wait for late workers before the job goes out of scope.
#include <thread>

#include "adam/adam_pool.h"
#include "helpers.h"

using swapio::adam::parallel_for;

namespace {

struct Visits {
  std::vector<int>* counts;
  int mark;
};

void visit(const void* ctx, int64_t begin, int64_t end) {
  const auto& v = *static_cast<const Visits*>(ctx);
  for (int64_t i = begin; i < end; i++) {
    for (volatile int spin = 0; spin < 200; spin = spin + 1) {
    }  // a little work per element, so that the workers take tiles before the caller has done them all
    (*v.counts)[static_cast<size_t>(i)] += v.mark;
  }
}

// Runs one parallel_for over n elements and checks that each was visited once.
bool covers_once(int64_t n, int64_t tile, int threads, int mark) {
  std::vector<int> counts(static_cast<size_t>(n), 0);
  Visits v{&counts, mark};
  parallel_for(n, tile, threads, visit, &v);
  for (int c : counts)
    if (c != mark) return false;
  return true;
}

}  // namespace

int main() {
  for (int threads : {2, 3, 4})
    for (int64_t n : {1, 7, 64, 1000, 4097})
      for (int64_t tile : {1, 3, 64, 5000}) CHECK(covers_once(n, tile, threads, 1));
  CHECK(swapio::adam::pool_workers() >= 1 && swapio::adam::pool_workers() <= 3);

  std::atomic<bool> ok{true};
  std::vector<std::thread> callers;
  for (int c = 0; c < 3; c++)
    callers.emplace_back([&ok, c] {
      for (int round = 0; round < 100 && ok; round++)
        if (!covers_once(257 + 31 * round, 16, 2 + (round + c) % 3, c + 1)) ok = false;
    });
  for (auto& c : callers) c.join();
  CHECK(ok);
  return t::kPass;
}
