#include "server/tier/shm_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace kvtier {
namespace {

// linux/memfd.h's MFD_NOEXEC_SEAL (Linux 6.3), which Debian 12's C library does not name.
#ifdef MFD_NOEXEC_SEAL
constexpr unsigned kMfdNoexecSeal = MFD_NOEXEC_SEAL;
#else
constexpr unsigned kMfdNoexecSeal = 0x0008U;
#endif

absl::Status Errno(absl::string_view what, const std::string& name) {
  int e = errno;
  std::string msg = absl::StrCat(what, " ", name, ": ", std::strerror(e));
  return e == ENOENT ? absl::NotFoundError(msg) : absl::InternalError(msg);
}

}  // namespace

absl::StatusOr<ShmSegment> ShmSegment::Create(const std::string& name, uint64_t size,
                                              Naming naming) {
  const bool named = naming == Naming::kNamed;
  int fd;
  if (named) {
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 && errno == EEXIST) {
      shm_unlink(name.c_str());
      fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    }
    if (fd < 0) return Errno("shm_open", name);
  } else {
    const std::string label = name.starts_with("/") ? name.substr(1) : name;
    constexpr unsigned kFlags = MFD_CLOEXEC | MFD_ALLOW_SEALING;
    // Linux 6.3 and later: never executable (vm.memfd_noexec=2 refuses a memfd without it);
    // older kernels do not know the flag.
    fd = memfd_create(label.c_str(), kFlags | kMfdNoexecSeal);
    if (fd < 0 && errno == EINVAL) fd = memfd_create(label.c_str(), kFlags);
    if (fd < 0) return Errno("memfd_create", name);
  }
  // Undoes what was made when a later step fails.
  auto fail = [&](absl::string_view what) {
    absl::Status s = Errno(what, name);
    close(fd);
    if (named) shm_unlink(name.c_str());
    return s;
  };
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) return fail("ftruncate");
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return fail("mmap");
  // A memfd's size is fixed, and no mapping made after this one can write: not through a
  // descriptor that leaks, nor through one reopened from /proc. Reserve's fallocate within
  // the size is still allowed.
  // A shared memfd seals its size only.
  const int seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL |
                    (naming == Naming::kMemfd ? F_SEAL_FUTURE_WRITE : 0);
  if (!named && fcntl(fd, F_ADD_SEALS, seals) != 0) {
    munmap(p, size);
    return fail("seal");
  }
  return ShmSegment(name, named, static_cast<uint8_t*>(p), size, /*owner=*/true, fd);
}

absl::StatusOr<int> ShmSegment::Reopen(int flags) const {
  // Through this process's own descriptor, not the name: what is opened is this object.
  const std::string self = absl::StrCat("/proc/self/fd/", fd_);
  const int fd = open(self.c_str(), flags | O_CLOEXEC);
  if (fd < 0) return Errno(flags == O_RDONLY ? "open read-only" : "open read-write", name_);
  return fd;
}

absl::StatusOr<int> ShmSegment::OpenReadOnlyFd() const { return Reopen(O_RDONLY); }

absl::StatusOr<int> ShmSegment::OpenWritableFd() const { return Reopen(O_RDWR); }

absl::Status ShmSegment::Release(uint64_t offset, uint64_t length) {
  if (length == 0) return absl::OkStatus();
  if (fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                static_cast<off_t>(length)) == 0) {
    return absl::OkStatus();
  }
  return absl::InternalError(absl::StrCat("shared memory: ", name_, " cannot free ", length,
                                          " bytes at ", offset, ": ", std::strerror(errno)));
}

absl::Status ShmSegment::Reserve(uint64_t offset, uint64_t length) {
  if (length == 0) return absl::OkStatus();
  const int e = posix_fallocate(fd_, static_cast<off_t>(offset), static_cast<off_t>(length));
  if (e == 0) return absl::OkStatus();
  const std::string msg = absl::StrCat("shared memory: ", name_, " cannot commit ", length,
                                       " bytes at ", offset, ": ", std::strerror(e));
  // A full /dev/shm (or its size= limit), or no memory left for an unnamed segment, is like a
  // full tier: the caller may make room.
  if (e == ENOSPC || e == ENOMEM) {
    return absl::ResourceExhaustedError(
        absl::StrCat(msg, named_ ? " (/dev/shm is full)" : " (out of shared memory)"));
  }
  return absl::InternalError(msg);
}

void ShmSegment::Populate(uint64_t offset, uint64_t length) {
#ifdef MADV_POPULATE_WRITE
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t from = offset / page * page;
  if (data_ == nullptr || length == 0 || from >= size_) return;
  const uint64_t to = std::min(size_, offset + length);
  (void)madvise(data_ + from, to - from, MADV_POPULATE_WRITE);
#else
  (void)offset;
  (void)length;
#endif
}

absl::StatusOr<ShmSegment> ShmSegment::OpenReadOnly(const std::string& name) {
  int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return Errno("shm_open", name);
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    absl::Status s = Errno("fstat", name);
    close(fd);
    return s;
  }
  void* p = mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return Errno("mmap", name);
  return ShmSegment(name, /*named=*/true, static_cast<uint8_t*>(p), st.st_size, /*owner=*/false,
                    -1);
}

int ShmSegment::RemoveStale(const std::string& prefix) {
  return RemoveStale(std::vector<std::string>{prefix});
}

int ShmSegment::RemoveStale(const std::vector<std::string>& prefixes) {
  if (prefixes.empty()) return 0;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  while (dirent* e = readdir(dir)) {
    const absl::string_view name(e->d_name);
    for (const std::string& prefix : prefixes) {
      const absl::string_view bare = absl::StripPrefix(prefix, "/");
      if (!absl::StartsWith(name, bare) || name.size() == bare.size()) continue;
      const absl::string_view id = name.substr(bare.size());
      if (!std::all_of(id.begin(), id.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
      if (shm_unlink(absl::StrCat("/", name).c_str()) == 0) ++removed;
      break;
    }
  }
  closedir(dir);
  return removed;
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept { *this = std::move(other); }

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    named_ = other.named_;
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    owner_ = std::exchange(other.owner_, false);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

ShmSegment::~ShmSegment() { Reset(); }

void ShmSegment::Reset() {
  if (data_ != nullptr) munmap(data_, size_);
  if (owner_ && named_) shm_unlink(name_.c_str());
  if (fd_ >= 0) close(fd_);
  data_ = nullptr;
  owner_ = false;
  fd_ = -1;
}

}  // namespace kvtier
