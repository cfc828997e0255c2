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
namespace {

// Only regular files and block devices take positioned I/O. A FIFO would block the open (and then fail
// every pread), a character device or socket does something else entirely: refuse them by name.
void check_file_type(mode_t mode, const std::string& path) {
  if (S_ISREG(mode) || S_ISBLK(mode)) return;
  if (S_ISDIR(mode)) throw IoError(EISDIR, std::string("cannot open: ") + std::strerror(EISDIR), path, 0);
  const char* kind = S_ISFIFO(mode) ? "a FIFO" : S_ISSOCK(mode) ? "a socket" : S_ISCHR(mode) ? "a character device"
                                                                                              : "not a file";
  throw IoError(EINVAL, std::string("cannot open: it is ") + kind + ", not a regular file or block device", path,
                0);
}

}  // namespace

uint64_t birth_ns(int fd) {
  struct statx stx;
  std::memset(&stx, 0, sizeof(stx));
  if (syscall(SYS_statx, fd, "", AT_EMPTY_PATH, STATX_BTIME, &stx) != 0 || !(stx.stx_mask & STATX_BTIME)) return 0;
  return static_cast<uint64_t>(stx.stx_btime.tv_sec) * 1000000000u + stx.stx_btime.tv_nsec;
}

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

OpenFile::OpenFile(const std::string& path, Op op, DirectMode mode, std::optional<FileIdentity> expect)
    : path_(path), op_(op), expect_(expect) {
  if (path.empty()) throw ArgError("path must not be empty");
  if (path.find('\0') != std::string::npos) throw ArgError("path must not contain NUL bytes");
  // Checked before opening: O_DIRECT opens of a directory fail with EINVAL on some file systems (ext4),
  // which would read as "no O_DIRECT support", and a write must not create anything next to a FIFO.
  // open_fd() checks again on the descriptor, for a path swapped in between.
  struct stat st;
  if ((expect_ ? ::lstat(path.c_str(), &st) : ::stat(path.c_str(), &st)) == 0 && !S_ISLNK(st.st_mode))
    check_file_type(st.st_mode, path);
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
  // O_NONBLOCK: opening a FIFO must not wait for its other end; it is cleared once fstat says it is a file.
  int flags = O_CLOEXEC | O_NONBLOCK | (op_ == Op::read ? O_RDONLY : O_WRONLY);
  if (op_ == Op::write && !expect_) flags |= O_CREAT;  // an expected file must exist: never create another
  if (direct) flags |= O_DIRECT;
  if (expect_) flags |= O_NOFOLLOW;
  int fd;
  do {
    fd = ::open(path_.c_str(), flags, 0644);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0 && expect_ && errno == ELOOP)
    throw IoError(ELOOP, "a symlink replaced the file expected here (swapio does not follow it)",
                  path_, 0);
  if (fd < 0) return fd;
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    errno = err;
    return -1;
  }
  if (!(S_ISREG(st.st_mode) || S_ISBLK(st.st_mode))) {
    ::close(fd);
    check_file_type(st.st_mode, path_);  // throws
  }
  if (expect_ && (static_cast<uint64_t>(st.st_dev) != expect_->dev ||
                  static_cast<uint64_t>(st.st_ino) != expect_->ino ||
                  (expect_->birth_ns != 0 && birth_ns(fd) != expect_->birth_ns))) {
    ::close(fd);
    throw IoError(ESTALE, "another file replaced the file expected here", path_, 0);
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

void OpenFile::ensure_buffered_fd() {
  if (buffered_fd_ >= 0) return;
  buffered_fd_ = open_fd(false);
  if (buffered_fd_ < 0) throw IoError(errno, std::string("cannot open: ") + std::strerror(errno), path_, 0);
}

}  // namespace swapio::io
