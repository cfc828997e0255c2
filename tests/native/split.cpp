// The null engine (no disk): a request is cut into block-sized pieces spread over the workers, and the
// future reports the summed bytes; many requests from several threads all complete.
// (Writes: they only read `buf`, so the threads share it without a data race.)
#include <thread>

#include "helpers.h"

using namespace swapio::io;

int main() {
  t::ScratchDir dir;
  std::string path = dir.file("null");
  std::vector<uint8_t> buf(1 << 22);
  {
    Handle h(t::options("null", 4096, 3, 4));
    CHECK(h.engine() == "null");
    CHECK(h.submit(Op::write, t::addr(buf.data()), buf.size(), path, 0, false)->result() == (1 << 22));
    auto req = h.submit(Op::write, t::addr(buf.data()) + 1, 12345, path, 7, true);
    CHECK(req->result() == 12345);
    CHECK(!req->latencies_ns().empty());
    std::vector<std::thread> threads;
    std::vector<std::shared_ptr<Request>> reqs(4 * 200);
    for (int th = 0; th < 4; th++)
      threads.emplace_back([&, th] {
        for (int i = 0; i < 200; i++)
          reqs[th * 200 + i] = h.submit(Op::write, t::addr(buf.data()), 1 + i * 1000, path, i, false);
      });
    for (auto& th : threads) th.join();
    for (int i = 0; i < 800; i++) CHECK(reqs[i]->result() == 1 + (i % 200) * 1000);
  }
  return t::kPass;
}
