// I/O that expects a file identity (device, inode) reaches that file or fails at submit: ELOOP for a symlink
// at the path (never followed), ESTALE for another file there (on the O_DIRECT descriptor and on the buffered
// one alike), ENOENT for none (a write never creates it). Without an identity a symlink is followed, as open()
// does.
#include <sys/stat.h>
#include <unistd.h>

#include "helpers.h"

using namespace swapio::io;

namespace {

int submit_error(Handle& h, std::vector<uint8_t>& buf, const std::string& path, FileIdentity id,
                 Op op = Op::read) {
  try {
    h.submit(op, t::addr(buf.data()), static_cast<int64_t>(buf.size()), path, 0, false, id)->result();
  } catch (const swapio::IoError& e) {
    return e.path() == path ? e.err() : -1;
  }
  return 0;
}

}  // namespace

int main() {
  t::ScratchDir dir;
  const std::string path = dir.file("data"), other = dir.file("other"), link = dir.file("link");
  std::vector<uint8_t> data = t::pattern(10000, 7);  // 10000: an aligned head and a buffered tail
  Handle h(t::options("psync", 4096, 4, 1));
  CHECK(h.submit(Op::write, t::addr(data.data()), static_cast<int64_t>(data.size()), path, 0, false)->result() ==
        10000);
  struct stat st;
  CHECK(::stat(path.c_str(), &st) == 0);
  const FileIdentity id{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};

  std::vector<uint8_t> buf(data.size());
  CHECK(submit_error(h, buf, path, id) == 0);
  CHECK(buf == data);
  CHECK(submit_error(h, buf, path, FileIdentity{id.dev, id.ino + 1}) == ESTALE);

  CHECK(::symlink("data", link.c_str()) == 0);  // relative to the link's directory
  CHECK(submit_error(h, buf, link, id) == ELOOP);
  std::fill(buf.begin(), buf.end(), 0);
  CHECK(h.submit(Op::read, t::addr(buf.data()), static_cast<int64_t>(buf.size()), link, 0, false)->result() == 10000);
  CHECK(buf == data);

  // the same bytes in a new file moved over the old one: not the file that was written
  CHECK(h.submit(Op::write, t::addr(data.data()), static_cast<int64_t>(data.size()), other, 0, false)->result() ==
        10000);
  CHECK(::rename(other.c_str(), path.c_str()) == 0);
  CHECK(submit_error(h, buf, path, id) == ESTALE);
  CHECK(submit_error(h, buf, path, id, Op::write) == ESTALE);

  swapio::io::HandleOptions buffered = t::options("psync", 4096, 4, 1);
  buffered.direct = DirectMode::off;  // the buffered descriptor alone
  Handle hb(buffered);
  CHECK(submit_error(hb, buf, path, id) == ESTALE);
  CHECK(submit_error(hb, buf, link, id) == ELOOP);

  const std::string missing = dir.file("missing");
  CHECK(submit_error(h, buf, missing, id, Op::write) == ENOENT);
  CHECK(::access(missing.c_str(), F_OK) != 0);  // not created
  return t::kPass;
}
