#pragma once
// Opening a file for one request: the O_DIRECT descriptor (when the file system takes it), a buffered one for
// unaligned head/tail bytes, and the direct-I/O alignment the kernel reports for it.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "io/engine.h"

namespace swapio::io {

enum class DirectMode { automatic, on, off };  // automatic: O_DIRECT where the file system takes it

struct Alignment {
  uint32_t mem = 4096;     // buffer address alignment for O_DIRECT
  uint32_t offset = 4096;  // file offset and length alignment for O_DIRECT
  // Unaligned edges of a request go through the page cache; they are widened to whole file-system blocks
  // (and pages) so no block is ever touched by buffered and direct I/O at once (a dirty cached block
  // written back over direct-written bytes would corrupt them).
  uint32_t edge = 4096;
  bool from_statx = false;
};

// A file's identity as fstat gives it: a file swapio wrote earlier must still be that file when it is read
// back, and never a symlink planted at its name since. A file created after the old one was deleted often gets
// its inode number back (ext4 does so at once), so the birth time tells the two apart.
struct FileIdentity {
  uint64_t dev = 0;
  uint64_t ino = 0;
  uint64_t birth_ns = 0;  // statx btime in ns since the epoch; 0: not known (not checked)
};

// The birth time of an open file (statx STATX_BTIME) in ns since the epoch, or 0 where the file system keeps none.
uint64_t birth_ns(int fd);

// Descriptors stay open until the last piece of the request that opened them is done.
class OpenFile {
 public:
  // `expect`: opened without following a symlink, each descriptor checked on itself (no window between a
  // check and the open that does the I/O): ELOOP for a symlink, ESTALE for another file at the path.
  OpenFile(const std::string& path, Op op, DirectMode mode,
           std::optional<FileIdentity> expect = std::nullopt);  // throws IoError / ArgError
  ~OpenFile();
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;

  bool direct() const { return direct_fd_ >= 0; }
  bool fell_back() const { return fell_back_; }  // automatic mode, but the file system refused O_DIRECT
  int direct_fd() const { return direct_fd_; }
  int buffered_fd() const { return buffered_fd_; }
  void ensure_buffered_fd();  // opens it on first need (only unaligned requests have one); throws IoError
  const Alignment& alignment() const { return align_; }
  const std::string& path() const { return path_; }

 private:
  int open_fd(bool direct);
  std::string path_;
  Op op_;
  std::optional<FileIdentity> expect_;
  int direct_fd_ = -1;
  int buffered_fd_ = -1;
  bool fell_back_ = false;
  Alignment align_;
};

// Direct-I/O alignment for an open descriptor: statx(STATX_DIOALIGN) where the kernel has it, else 4096.
Alignment query_alignment(int fd);

}  // namespace swapio::io
