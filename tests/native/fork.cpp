// engines: uring aio psync
// After fork(), the child's copy of a handle (with work queued in the parent) is dead: submitting is an
// ArgError, a request of the parent's cannot be waited for, destroying the copy neither hangs nor crashes,
// and a new handle in the child works.
#include <signal.h>
#include <sys/wait.h>

#include "helpers.h"

using namespace swapio::io;

namespace {

template <class F>
bool throws_arg_error(F f) {
  try {
    f();
  } catch (const swapio::ArgError&) {
    return true;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  return t::per_engine_main(argc, argv, [](const std::string& engine) {
    t::ScratchDir dir;
    std::vector<uint8_t> data = t::pattern(4 << 20, 5);
    const int64_t n = static_cast<int64_t>(data.size());
    auto* inherited = new Handle(t::options(engine, 4096, 1, 2));
    CHECK(inherited->submit(Op::write, t::addr(data.data()), n, dir.file("parent"), 0, false)->result() == n);
    std::shared_ptr<Request> busy;  // most likely still running at fork()
    for (int i = 0; i < 8; i++) busy = inherited->submit(Op::write, t::addr(data.data()), n, dir.file("busy"), 0, false);
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(60);  // a hang is a failure (SIGALRM), not a stuck test run
      if (!throws_arg_error([&] { inherited->submit(Op::read, t::addr(data.data()), n, dir.file("parent"), 0, false); }))
        _exit(t::kFail);
      if (!inherited->closed()) _exit(t::kFail);
      if (!busy->done() && !throws_arg_error([&] { busy->result(); })) _exit(t::kFail);
      delete inherited;
      std::vector<uint8_t> back(data.size());
      Handle mine(t::options(engine, 64 << 10, 4, 2));
      if (mine.submit(Op::read, t::addr(back.data()), n, dir.file("parent"), 0, false)->result() != n) _exit(t::kFail);
      _exit(back == data ? t::kPass : t::kFail);
    }
    CHECK(pid > 0);
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == t::kPass);
    CHECK(busy->result() == n);  // the parent's handle is unaffected
    delete inherited;
    return t::kPass;
  });
}
