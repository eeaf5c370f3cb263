// A file descriptor closed with its holder.
#ifndef KVTIER_SERVER_COMMON_UNIQUE_FD_H_
#define KVTIER_SERVER_COMMON_UNIQUE_FD_H_

#include <unistd.h>

#include <utility>

namespace kvtier {

class UniqueFd {
 public:
  explicit UniqueFd(int fd = -1) : fd_(fd) {}
  ~UniqueFd() { Reset(); }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  // The descriptor, no longer closed here.
  int Release() { return std::exchange(fd_, -1); }
  // Closes the one held, then holds `fd`.
  void Reset(int fd = -1) {
    if (fd_ >= 0) close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_COMMON_UNIQUE_FD_H_
