// engines: uring aio psync null
// When collecting completions keeps failing, the worker gives its engine up after a bounded time: every
// request fails with the error (none hangs), later ones fail at once, the handle closes, nothing leaks.
// A reap that fails a few times and recovers fails only the requests then running.
#include "helpers.h"

using namespace swapio::io;

int main(int argc, char** argv) {
  return t::per_engine_main(argc, argv, [](const std::string& engine) {
    t::ScratchDir dir;
    std::vector<uint8_t> data = t::pattern(1 << 20, 4);
    const int64_t n = static_cast<int64_t>(data.size());
    auto fails_with = [](const std::shared_ptr<Request>& r, int err) {
      try {
        r->result();
      } catch (const swapio::IoError& e) {
        return e.err() == err;
      }
      return false;
    };
    {  // warm-up (see t::resources)
      Handle warm(t::options(engine, 64 << 10, 4, 2));
      warm.submit(Op::write, t::addr(data.data()), n, dir.file("warm"), 1, false)->result();
    }
    const t::Resources before = t::resources();
    {
      HandleOptions o = t::options(engine, 64 << 10, 4, 2);
      o.fault = "piece=3,errno=reap,count=all";
      Handle h(o);
      std::vector<std::shared_ptr<Request>> reqs;
      for (int i = 0; i < 4; i++)
        reqs.push_back(h.submit(Op::write, t::addr(data.data()), n, dir.file("f" + std::to_string(i)), 0, false));
      for (auto& r : reqs) CHECK(fails_with(r, EIO));
      CHECK(fails_with(h.submit(Op::write, t::addr(data.data()), n, dir.file("later"), 0, false), EIO));
    }  // the destructor returns
    CHECK(t::released(before));
    HandleOptions o = t::options(engine, 64 << 10, 4);
    o.fault = "piece=1,errno=reap,count=3";
    Handle h(o);
    CHECK(fails_with(h.submit(Op::write, t::addr(data.data()), n, dir.file("first"), 0, false), EIO));
    CHECK(h.submit(Op::write, t::addr(data.data()), n, dir.file("second"), 0, false)->result() == n);
    return t::kPass;
  });
}
