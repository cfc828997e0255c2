// Helpers for the native test programs (liburing style: each program proves one behaviour;
// exit 0 = pass, 1 = fail, 77 = skip).
#pragma once
#include <dirent.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/errors.h"
#include "io/handle.h"
#include "io/worker.h"

namespace t {

constexpr int kPass = 0, kFail = 1, kSkip = 77;

#define CHECK(cond)                                                                   \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(t::kFail);                                                            \
    }                                                                                 \
  } while (0)

// A scratch directory under build/ (a real disk: /tmp may be tmpfs, where O_DIRECT fails; and ignored by git),
// removed by its destructor, or at exit when a failed CHECK exits past the destructor (in the process that made
// it: a forked child's exit leaves its parent's directories alone).
struct ScratchDir {
  std::string path;
  ScratchDir() {
    CHECK(std::system("mkdir -p build/scratch") == 0);
    char tmpl[] = "build/scratch/swapio-native-XXXXXX";
    char* p = mkdtemp(tmpl);
    CHECK(p != nullptr);
    path = p;
    live().push_back(path);
    owner() = getpid();
    static const bool registered = std::atexit(remove_live) == 0;
    (void)registered;
  }
  ~ScratchDir() {
    remove(path);
    auto& l = live();
    l.erase(std::remove(l.begin(), l.end(), path), l.end());
  }
  std::string file(const std::string& name) const { return path + "/" + name; }

 private:
  static std::vector<std::string>& live() {
    static std::vector<std::string> dirs;
    return dirs;
  }
  static void remove(const std::string& dir) { std::system(("rm -rf '" + dir + "'").c_str()); }
  static pid_t& owner() {
    static pid_t pid = 0;
    return pid;
  }
  static void remove_live() {
    if (getpid() != owner()) return;
    for (const auto& dir : live()) remove(dir);
  }
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

// Programs that take an engine (a `// engines: ...` line tells run.sh which) start here: `prog ENGINE`. An
// engine this kernel cannot set up (io_uring disabled by sysctl or seccomp, aio-max-nr reached) is a skip
// with the reason, never a silent pass.
template <class Body>
int per_engine_main(int argc, char** argv, Body body) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s ENGINE\n", argv[0]);
    return kFail;
  }
  const std::string engine = argv[1];
  const swapio::io::EngineOps* ops = swapio::io::find_engine(engine);
  CHECK(ops != nullptr);
  const int rc = swapio::io::probe_engine(*ops);
  if (rc != 0) {
    std::printf("engine %s unavailable here: %s\n", engine.c_str(), std::strerror(-rc));
    return kSkip;
  }
  return body(engine);
}

// What a handle may hold of the process: descriptors (files, io_uring rings), threads, kernel I/O rings mapped
// into it (io_uring, AIO), and all mappings (bounce arenas too; counted only without a sanitizer, whose
// shadow memory grows on its own). Equal before a handle is made and after it is gone: nothing leaked.
struct Resources {
  int fds = 0, threads = 0, rings = 0, maps = 0;
  size_t bounce = 0;  // bytes of bounce buffers held (swapio's own count: exact under sanitizers too)
  bool operator==(const Resources& o) const {
    return fds == o.fds && threads == o.threads && rings == o.rings && maps == o.maps && bounce == o.bounce;
  }
};

inline int count_entries(const char* dir) {
  int n = 0;
  if (DIR* d = opendir(dir)) {
    while (readdir(d)) n++;
    closedir(d);
  }
  return n;
}

// The fields of /proc/self/task/TID/stat after the thread's name (which may hold spaces and parentheses),
// starting with its state letter; "" if there is no such thread.
inline std::string thread_stat(const std::string& tid) {
  std::ifstream stat("/proc/self/task/" + tid + "/stat");
  std::string line;
  const size_t name_end = std::getline(stat, line) ? line.rfind(") ") : std::string::npos;
  return name_end == std::string::npos ? "" : line.substr(name_end + 2);
}

// Threads of this process that have not begun to exit. pthread_join() returns once the kernel has cleared the
// thread's id, and the thread is still listed in /proc/self/task for a moment after that (counted, it made
// the leak checks fail now and then on a loaded machine); but the kernel marks a thread exiting (PF_EXITING in
// the flags field of its stat) before it clears the id, so a joined thread is never counted here.
inline int live_threads() {
  constexpr unsigned long kExiting = 0x4;  // PF_EXITING, include/linux/sched.h
  int n = 0;
  DIR* d = opendir("/proc/self/task");
  if (!d) return -1;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::istringstream fields(thread_stat(e->d_name));  // state ppid pgrp session tty_nr tpgid flags ...
    std::string state;
    long skipped;
    unsigned long flags = 0;
    fields >> state >> skipped >> skipped >> skipped >> skipped >> skipped >> flags;
    if (fields && !(flags & kExiting)) n++;  // (empty: the thread is gone meanwhile)
  }
  closedir(d);
  return n;
}

// Call once a handle of the same shape was made and destroyed: the C library keeps per-thread malloc arenas
// mapped after their threads exit, and reuses them.
inline Resources resources() {
  Resources r;
  r.bounce = swapio::io::bounce_bytes_held();
  r.fds = count_entries("/proc/self/fd");
  r.threads = live_threads();
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find("io_uring") != std::string::npos || line.find("[aio]") != std::string::npos) r.rings++;
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
    r.maps++;
#endif
  }
  return r;
}

// True if nothing is held beyond `before`; prints both counts otherwise. Waits up to a second for what the
// kernel tears down after the fact (an io_uring worker thread signals its ring's owner, then exits).
inline bool released(const Resources& before) {
  Resources now = resources();
  for (int i = 0; i < 100 && !(now == before); i++) {
    usleep(10000);
    now = resources();
  }
  if (now == before) return true;
  std::fprintf(stderr, "fds %d -> %d, threads %d -> %d, rings %d -> %d, mappings %d -> %d, bounce bytes %zu -> %zu\n",
               before.fds, now.fds, before.threads, now.threads, before.rings, now.rings, before.maps, now.maps,
               before.bounce, now.bounce);
  return false;
}

inline uintptr_t addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }

// Writes n pattern bytes from memory `mem_shift` bytes past a page boundary to `path` at `off`, reads them
// back into memory with the same shift, and checks every byte.
inline void round_trip(swapio::io::Handle& h, const std::string& path, size_t n, int64_t off, size_t mem_shift,
                       bool staged = false) {
  using swapio::io::Op;
  std::vector<uint8_t> src_store(n + 4096 * 2), dst_store(n + 4096 * 2);
  uint8_t* src = src_store.data() + (4096 - addr(src_store.data()) % 4096) + mem_shift;
  uint8_t* dst = dst_store.data() + (4096 - addr(dst_store.data()) % 4096) + mem_shift;
  auto data = pattern(n, static_cast<uint32_t>(n + static_cast<size_t>(off) + mem_shift));
  std::memcpy(src, data.data(), n);
  const auto len = static_cast<int64_t>(n);
  CHECK(h.submit(Op::write, addr(src), len, path, off, false, std::nullopt, staged)->result() == len);
  CHECK(h.submit(Op::read, addr(dst), len, path, off, false, std::nullopt, staged)->result() == len);
  CHECK(std::memcmp(dst, data.data(), n) == 0);
  unlink(path.c_str());
}

}  // namespace t
