// Bad options and arguments throw ArgError or IoError with errno and path; nothing aborts.
#include "helpers.h"

using namespace swapio::io;

template <class E, class F>
bool throws(F f) {
  try {
    f();
  } catch (const E&) {
    return true;
  }
  return false;
}

int main() {
  t::ScratchDir dir;
  CHECK(throws<swapio::ArgError>([] { Handle h(t::options("auto", 0)); }));
  CHECK(throws<swapio::ArgError>([] { Handle h(t::options("auto", 4096, 0)); }));
  CHECK(throws<swapio::ArgError>([] { Handle h(t::options("auto", 4096, 4, 0)); }));
  CHECK(throws<swapio::ArgError>([] { Handle h(t::options("nope")); }));
  Handle h(t::options("auto"));
  char buf[16] = {};
  CHECK(throws<swapio::ArgError>([&] { h.submit(Op::read, t::addr(buf), 16, dir.file("x"), -1, false); }));
  CHECK(throws<swapio::ArgError>([&] { h.submit(Op::read, t::addr(buf), -1, dir.file("x"), 0, false); }));
  CHECK(throws<swapio::ArgError>([&] { h.submit(Op::read, 0, 16, dir.file("x"), 0, false); }));
  CHECK(throws<swapio::ArgError>([&] { h.submit(Op::read, t::addr(buf), 16, "", 0, false); }));
  bool enoent = false;
  try {
    h.submit(Op::read, t::addr(buf), 16, dir.file("missing"), 0, false);
  } catch (const swapio::IoError& e) {
    enoent = e.err() == ENOENT && e.path() == dir.file("missing");
  }
  CHECK(enoent);
  bool eisdir = false;
  try {
    h.submit(Op::write, t::addr(buf), 16, dir.path, 0, false);
  } catch (const swapio::IoError& e) {
    eisdir = e.err() == EISDIR;
  }
  CHECK(eisdir);
  return t::kPass;
}
