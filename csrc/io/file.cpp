#include "io/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <linux/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/errors.h"

namespace swapio::io {

Alignment query_alignment(int fd) {
  Alignment a;
  struct statx stx;
  std::memset(&stx, 0, sizeof(stx));
  if (syscall(SYS_statx, fd, "", AT_EMPTY_PATH, STATX_DIOALIGN | STATX_BASIC_STATS, &stx) != 0) return a;
  if ((stx.stx_mask & STATX_DIOALIGN) && stx.stx_dio_mem_align > 0 && stx.stx_dio_offset_align > 0) {
    a.mem = stx.stx_dio_mem_align;
    a.offset = stx.stx_dio_offset_align;
    a.from_statx = true;
  }
  const uint32_t page = static_cast<uint32_t>(sysconf(_SC_PAGESIZE));
  a.edge = std::max({a.offset, page, stx.stx_blksize});
  if (a.edge % a.offset != 0) a.edge = a.offset * ((a.edge + a.offset - 1) / a.offset);
  return a;
}

OpenFile::OpenFile(const std::string& path, Op op, DirectMode mode) : path_(path), op_(op) {
  if (path.empty()) throw ArgError("path must not be empty");
  if (path.find('\0') != std::string::npos) throw ArgError("path must not contain NUL bytes");
  // O_DIRECT opens of a directory fail with EINVAL on some file systems (ext4), which would read as
  // "no O_DIRECT support": name the real problem first.
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
    throw IoError(EISDIR, std::string("cannot open: ") + std::strerror(EISDIR), path, 0);
  if (mode == DirectMode::off) {
    buffered_fd_ = open_fd(false);
    if (buffered_fd_ < 0) throw IoError(errno, std::string("cannot open: ") + std::strerror(errno), path, 0);
    return;
  }
  direct_fd_ = open_fd(true);
  if (direct_fd_ >= 0) {
    align_ = query_alignment(direct_fd_);
    return;
  }
  int err = errno;
  // EINVAL at open means the file system refuses O_DIRECT (ramfs, some FUSE and network file systems).
  if (err != EINVAL) throw IoError(err, std::string("cannot open: ") + std::strerror(err), path, 0);
  if (mode == DirectMode::on)
    throw IoError(EINVAL,
                  "the file system refuses O_DIRECT (use direct=False, or direct=None to fall back to "
                  "buffered I/O)",
                  path, 0);
  fell_back_ = true;
  buffered_fd_ = open_fd(false);
  if (buffered_fd_ < 0) throw IoError(errno, std::string("cannot open: ") + std::strerror(errno), path, 0);
}

OpenFile::~OpenFile() {
  if (direct_fd_ >= 0) ::close(direct_fd_);
  if (buffered_fd_ >= 0) ::close(buffered_fd_);
}

int OpenFile::open_fd(bool direct) {
  int flags = O_CLOEXEC | (op_ == Op::read ? O_RDONLY : (O_WRONLY | O_CREAT));
  if (direct) flags |= O_DIRECT;
  int fd;
  do {
    fd = ::open(path_.c_str(), flags, 0644);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

void OpenFile::ensure_buffered_fd() {
  if (buffered_fd_ >= 0) return;
  buffered_fd_ = open_fd(false);
  if (buffered_fd_ < 0) throw IoError(errno, std::string("cannot open: ") + std::strerror(errno), path_, 0);
}

}  // namespace swapio::io
