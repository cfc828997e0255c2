// engines: uring aio psync null
// EINTR and EAGAIN completions are resubmitted, a bounded number of times: a few are invisible (the bytes
// arrive intact), an endless stream fails the request with that errno instead of spinning forever. Short
// completions resume where they stopped.
#include "helpers.h"

using namespace swapio::io;

int main(int argc, char** argv) {
  return t::per_engine_main(argc, argv, [](const std::string& engine) {
    t::ScratchDir dir;
    const int64_t block = 64 << 10;
    std::vector<uint8_t> data = t::pattern(8 * block, 3), back(data.size());
    const int64_t n = static_cast<int64_t>(data.size());
    for (const char* fault : {"piece=2,errno=EINTR,count=5", "piece=2,errno=EAGAIN,count=5",
                              "piece=1,errno=short,count=6"}) {
      HandleOptions o = t::options(engine, block, 4);
      o.fault = fault;
      Handle h(o);
      CHECK(h.submit(Op::write, t::addr(data.data()), n, dir.file("f"), 0, false)->result() == n);
      CHECK(h.submit(Op::read, t::addr(back.data()), n, dir.file("f"), 0, false)->result() == n);
      if (engine != "null") CHECK(back == data);
    }
    for (int err : {EINTR, EAGAIN}) {
      HandleOptions o = t::options(engine, block, 1);
      o.fault = std::string("piece=2,count=all,errno=") + (err == EINTR ? "EINTR" : "EAGAIN");
      Handle h(o);
      bool raised = false;
      try {
        h.submit(Op::write, t::addr(data.data()), n, dir.file("g"), 0, false)->result();
      } catch (const swapio::IoError& e) {
        raised = e.err() == err && e.offset() == block && std::strstr(e.what(), "times in a row") != nullptr;
      }
      CHECK(raised);
    }
    return t::kPass;
  });
}
