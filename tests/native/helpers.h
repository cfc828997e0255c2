// Helpers for the native test programs (liburing style: each program proves one behaviour;
// exit 0 = pass, 1 = fail, 77 = skip).
#pragma once
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/errors.h"
#include "io/handle.h"

namespace t {

constexpr int kPass = 0, kFail = 1, kSkip = 77;

#define CHECK(cond)                                                                   \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(t::kFail);                                                            \
    }                                                                                 \
  } while (0)

// A scratch directory in the working directory (a real disk: /tmp may be tmpfs), removed at exit.
struct ScratchDir {
  std::string path;
  ScratchDir() {
    char tmpl[] = "./swapio-native-XXXXXX";
    char* p = mkdtemp(tmpl);
    CHECK(p != nullptr);
    path = p;
  }
  ~ScratchDir() { std::system(("rm -rf '" + path + "'").c_str()); }
  std::string file(const std::string& name) const { return path + "/" + name; }
};

inline std::vector<uint8_t> pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<uint8_t>(x);
  }
  return v;
}

inline swapio::io::HandleOptions options(const std::string& engine, int64_t block = 1 << 20, int64_t depth = 32,
                                         int64_t threads = 1) {
  swapio::io::HandleOptions o;
  o.engine = engine;
  o.block_size = block;
  o.queue_depth = depth;
  o.threads = threads;
  return o;
}

// Engines usable on this kernel (io_uring may be disabled by sysctl or seccomp).
inline std::vector<std::string> usable_engines() {
  std::vector<std::string> out;
  for (const char* name : {"uring", "aio", "psync"})
    if (swapio::io::probe_engine(*swapio::io::find_engine(name)) == 0) out.push_back(name);
  return out;
}

inline uintptr_t addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }

}  // namespace t
