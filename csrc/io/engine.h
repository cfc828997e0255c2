#pragma once
// One small ops table per I/O engine (like fio's engines/): the handle reaches an engine only through this.
// Engines never throw and never block beyond what reap() is asked to wait for; every call returns -errno.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace swapio::io {

enum class Op : uint8_t { read, write };

// One I/O in flight: at most block_size bytes at one file offset. The engine fills `result` on completion
// (bytes moved, or -errno) and may use `engine_data` as scratch (aio keeps its iocb there).
struct Piece {
  int fd = -1;
  Op op = Op::read;
  void* buf = nullptr;
  size_t len = 0;
  int64_t offset = 0;
  int64_t result = 0;
  alignas(8) unsigned char engine_data[64];
};

struct EngineOps {
  const char* name;
  // Completes pieces inside submit() (psync, null): the handle then submits one piece at a time, so each
  // piece's latency is its own (like fio's FIO_SYNCIO engines).
  bool sync;
  // Reads and writes the file's bytes (all but null, which completes pieces without touching them).
  bool moves_data;
  // Creates a context able to hold `depth` pieces in flight.
  int (*init)(unsigned depth, void** ctx);
  // Queues up to n pieces; returns how many were taken (0 = busy: reap first) or -errno.
  int (*submit)(void* ctx, Piece** pieces, int n);
  // Collects up to `max` finished pieces, blocking until at least `min_wait` are done; returns the count.
  int (*reap)(void* ctx, Piece** done, int max, int min_wait);
  void (*cleanup)(void* ctx);
};

extern const EngineOps aio_engine;
extern const EngineOps uring_engine;
extern const EngineOps psync_engine;
extern const EngineOps null_engine;

// Every engine, in the order swapio.info() lists them (the registry Python reads: swapio._C.ENGINES).
const std::vector<const EngineOps*>& all_engines();
// Engine by name ("uring", "aio", "psync", "null"); nullptr if unknown.
const EngineOps* find_engine(const std::string& name);
// Order that engine="auto" tries: fastest first (measured: see README).
const std::vector<const EngineOps*>& auto_engine_order();
// The engine a handle asked for `requested` uses: SWAPIO_ENGINE, when set, replaces "auto".
std::string resolve_engine_request(const std::string& requested);
// 0 if the engine can be set up on this kernel, else -errno (io_uring disabled, aio-max-nr reached, ...).
int probe_engine(const EngineOps& ops);

}  // namespace swapio::io
