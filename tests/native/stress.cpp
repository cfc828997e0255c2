// engines: uring aio psync
// Several threads share one handle for random round trips (sizes, file offsets and memory alignments drawn
// at random, reads and writes in flight together) and every byte read back is checked. Runs for
// SWAPIO_STRESS_SECONDS (default 3) and prints the bytes verified.
#include <atomic>
#include <chrono>
#include <random>
#include <thread>

#include "helpers.h"

using namespace swapio::io;

int main(int argc, char** argv) {
  return t::per_engine_main(argc, argv, [](const std::string& engine) {
    t::ScratchDir dir;
    const char* env = std::getenv("SWAPIO_STRESS_SECONDS");
    const double seconds = env ? std::atof(env) : 3.0;
    const auto stop = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    constexpr int kThreads = 4;
    constexpr int64_t kRegion = 8 << 20;  // each thread's own part of the shared file
    Handle h(t::options(engine, 128 << 10, 16, 3));
    const std::string path = dir.file("shared");
    std::atomic<int64_t> verified{0};
    std::atomic<bool> ok{true};
    std::vector<std::thread> threads;
    for (int th = 0; th < kThreads; th++) {
      threads.emplace_back([&, th] {
        std::mt19937_64 rng(static_cast<uint64_t>(th) * 7919 + 1);
        std::vector<uint8_t> src_store(kRegion + 8192), dst_store(kRegion + 8192);
        while (ok && std::chrono::steady_clock::now() < stop) {
          // Up to 4 requests in flight per thread, each on its own slice of the thread's region.
          struct Io { int64_t off, len; size_t shift; std::shared_ptr<Request> req; };
          std::vector<Io> ios;
          int64_t used = 0;
          for (int k = 0; k < 4; k++) {
            const int64_t len = 1 + static_cast<int64_t>(rng() % (kRegion / 4 - 8192));
            const int64_t gap = static_cast<int64_t>(rng() % 8192);
            const size_t shift = (rng() % 2) ? 0 : rng() % 4096;
            ios.push_back({th * kRegion + used + gap, len, shift, nullptr});
            used += gap + len;
          }
          const uint32_t seed = static_cast<uint32_t>(rng());
          size_t mem = 0;
          for (auto& io : ios) {
            auto bytes = t::pattern(static_cast<size_t>(io.len), seed + static_cast<uint32_t>(io.off));
            std::memcpy(src_store.data() + mem + io.shift, bytes.data(), bytes.size());
            io.req = h.submit(Op::write, t::addr(src_store.data() + mem + io.shift), io.len, path, io.off, false);
            mem += static_cast<size_t>(io.len) + 4096;
          }
          for (auto& io : ios) ok = ok && io.req->result() == io.len;
          mem = 0;
          for (auto& io : ios) {
            io.req = h.submit(Op::read, t::addr(dst_store.data() + mem + io.shift), io.len, path, io.off, false);
            mem += static_cast<size_t>(io.len) + 4096;
          }
          mem = 0;
          for (auto& io : ios) {
            ok = ok && io.req->result() == io.len;
            auto bytes = t::pattern(static_cast<size_t>(io.len), seed + static_cast<uint32_t>(io.off));
            ok = ok && std::memcmp(dst_store.data() + mem + io.shift, bytes.data(), bytes.size()) == 0;
            verified += io.len;
            mem += static_cast<size_t>(io.len) + 4096;
          }
        }
      });
    }
    for (auto& t : threads) t.join();
    CHECK(ok);
    std::printf("%s: %.1f MiB written, read back and verified by %d threads\n", engine.c_str(),
                static_cast<double>(verified.load()) / (1 << 20), kThreads);
    return t::kPass;
  });
}
