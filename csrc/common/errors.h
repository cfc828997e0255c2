#pragma once
// The two error kinds the native core throws. Engines never throw (they return -errno); the handle turns a
// failed request into IoError at wait(), and bindings.cpp maps IoError -> OSError, ArgError -> ValueError.
#include <cstdint>
#include <stdexcept>
#include <string>

namespace swapio {

class IoError : public std::runtime_error {
 public:
  IoError(int err, std::string what, std::string path, int64_t offset)
      : std::runtime_error(std::move(what)), err_(err), path_(std::move(path)), offset_(offset) {}
  int err() const { return err_; }
  const std::string& path() const { return path_; }
  int64_t offset() const { return offset_; }

 private:
  int err_;
  std::string path_;
  int64_t offset_;
};

class ArgError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace swapio
