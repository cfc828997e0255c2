#pragma once
// A worker thread owns one engine context and keeps up to queue_depth pieces in flight, refilling as
// completions arrive, across every task queued to it (like a DeepSpeed aio thread, but never submit-and-wait-all).
// It has 2 x queue_depth slots: the spare ones let bounce copies run while the queue is full.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "io/engine.h"
#include "io/request.h"

namespace swapio::io {

// Piece i of a random request (Handle::submit_random): splitmix64(seed + i) picks one of the span / block
// block-aligned offsets. Exposed as swapio._C.random_offsets, so a benchmark can check what it read.
int64_t random_piece_offset(uint64_t seed, int64_t i, int64_t span, int64_t block);

// Bytes of bounce memory all workers hold (arenas and oversized buffers): 0 once every handle is closed.
size_t bounce_bytes_held();

// A contiguous stripe of one request: file positions [begin, end) (piece indices for random requests).
struct Task {
  std::shared_ptr<Request> req;
  int64_t begin = 0, end = 0, cursor = 0;
  int inflight = 0;
  std::vector<uint64_t> latencies;
};

class Worker {
 public:
  // Takes ownership of ctx (not when it throws: no thread for it); hands the engine at most `batch` pieces per
  // submit call; bounce buffers for misaligned memory are slot_bytes each.
  Worker(const EngineOps& ops, void* ctx, unsigned depth, unsigned batch, size_t slot_bytes);
  ~Worker();                                               // finishes queued work, then joins
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  void enqueue(std::unique_ptr<Task> task);

 private:
  // A piece plus what the worker needs to finish it.
  struct Slot : Piece {
    Task* task = nullptr;
    char* user = nullptr;      // caller memory for this piece
    size_t total = 0;          // bytes this piece must move
    size_t moved = 0;          // bytes moved so far (short transfers are resubmitted)
    bool bounced = false;      // through `bounce` because caller memory is misaligned
    bool in_engine = false;    // the engine holds it (submitted, not yet reaped)
    int retries = 0;           // EINTR/EAGAIN completions in a row
    bool direct = false;
    char* bounce = nullptr;    // aligned scratch: a slot of the arena, or owned when larger than a slot
    size_t bounce_size = 0;
    bool bounce_owned = false;
    int64_t start_ns = 0;
  };

  void run();
  void take_incoming();  // with mu_ held
  bool fill(std::vector<Piece*>& batch);
  void prepare(Slot& s, Task& t);
  void submit(std::vector<Piece*>& batch);
  int reap(int min_wait);  // pieces collected
  void give_up_engine(int err);  // reap keeps failing: drop the engine, fail what it held
  bool can_fill();
  Task* next_task();       // the first task with pieces left to issue
  bool copy_aside();       // one bounce copy off the submission path; false if there was none to do
  bool will_bounce_write(const Task& t);
  void complete(Slot& s);
  void release(Slot& s);
  void retire_finished_tasks();
  char* arena();  // bounce memory for every slot, mapped on first need; nullptr if it cannot be

  const EngineOps& ops_;
  void* ctx_;       // nullptr once the engine was given up
  int broken_ = 0;  // errno that made the worker give its engine up; later pieces fail with it
  int reap_failures_ = 0;  // in a row
  unsigned depth_;
  unsigned batch_;
  size_t slot_bytes_;
  char* arena_ = nullptr;
  void* arena_map_ = nullptr;
  size_t arena_map_bytes_ = 0;
  bool arena_failed_ = false;
  std::vector<Slot> slots_;
  std::vector<Slot*> free_;
  std::vector<Slot*> retry_;  // short or interrupted transfers to resubmit
  std::deque<Slot*> staged_;  // write pieces already copied into their bounce buffers, to submit next
  std::vector<Slot*> drain_;  // finished bounced reads whose data still has to be copied out
  std::vector<Piece*> done_;
  std::list<std::unique_ptr<Task>> active_;
  int inflight_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Task>> incoming_;
  std::atomic<bool> has_incoming_{false};
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace swapio::io
