#include "io/request.h"

#include <unistd.h>

#include <chrono>
#include <cstring>

#include "common/errors.h"

namespace swapio::io {

Request::Request(RequestLayout layout, std::shared_ptr<OpenFile> file, int tasks)
    : layout_(layout), file_(std::move(file)), path_(file_->path()), fell_back_(file_->fell_back()),
      pid_(getpid()), tasks_left_(tasks) {}

bool Request::wait_for(double timeout_s) {
  if (done()) return true;
  if (getpid() != pid_)  // its workers are in the parent; its lock may have been held at fork()
    throw ArgError("this request was made in process " + std::to_string(pid_) +
                   " and was not finished at fork(): it cannot be waited for in the child");
  std::unique_lock<std::mutex> lk(mu_);
  auto is_done = [&] { return done(); };
  // Negative, NaN or beyond any real wait (a huge duration would overflow the clock): no limit.
  if (!(timeout_s >= 0) || timeout_s > 1e9) {
    cv_.wait(lk, is_done);
    return true;
  }
  return cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), is_done);
}

int64_t Request::result() {
  wait_for(-1);
  if (failed()) {
    std::string msg = err_detail_ + ": " + std::strerror(err_);
    throw IoError(err_, msg, path_, err_offset_);
  }
  return bytes_.load();
}

std::vector<uint64_t> Request::latencies_ns() {
  wait_for(-1);
  return latencies_;
}

void Request::fail(int err, int64_t offset, std::string detail) {
  std::lock_guard<std::mutex> lk(mu_);
  if (failed_.load()) return;  // the first error wins
  err_ = err;
  err_offset_ = offset;
  err_detail_ = std::move(detail);
  failed_.store(true, std::memory_order_release);
}

void Request::task_finished(std::vector<uint64_t>&& latencies) {
  if (!latencies.empty()) {
    std::lock_guard<std::mutex> lk(mu_);
    latencies_.insert(latencies_.end(), latencies.begin(), latencies.end());
  }
  if (tasks_left_.fetch_sub(1, std::memory_order_acq_rel) == 1) finish();
}

void Request::complete_now() { finish(); }

void Request::finish() {
  file_.reset();  // close the descriptors now, not when the last Python reference goes
  {
    std::lock_guard<std::mutex> lk(mu_);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

}  // namespace swapio::io
