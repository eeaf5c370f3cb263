// A POSIX shared-memory object mapped into this process. Move-only; the destructor unmaps,
// and the creating side also unlinks the name, so nothing is left in /dev/shm.
#ifndef KVTIER_SERVER_TIER_SHM_SEGMENT_H_
#define KVTIER_SERVER_TIER_SHM_SEGMENT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace kvtier {

class ShmSegment {
 public:
  // Creates `name` ("/kvtier-..."), sized `size` bytes (sparse: nothing is committed until
  // Reserve), mode 0600 (only the daemon's uid opens it by name; other workers get read-only
  // descriptors, OpenReadOnlyFd), mapped read-write. A stale object of that name is replaced.
  // INTERNAL (with errno text) when the kernel refuses.
  static absl::StatusOr<ShmSegment> Create(const std::string& name, uint64_t size);

  // Commits the pages of [offset, offset + length) before they are written (posix_fallocate),
  // so that a full /dev/shm is RESOURCE_EXHAUSTED here rather than a SIGBUS on first touch.
  // The creating side only.
  absl::Status Reserve(uint64_t offset, uint64_t length);

  // Maps an existing object read-only, as a worker does. NOT_FOUND if it does not exist.
  static absl::StatusOr<ShmSegment> OpenReadOnly(const std::string& name);

  // Removes every object in /dev/shm named `prefix` followed by digits only (a crashed
  // daemon's segments: "/kvtier-<instance>-<tier>-" and the segment id, so that instance "a"
  // never matches instance "a-host"'s). Returns how many were removed.
  static int RemoveStale(const std::string& prefix);

  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  // A new descriptor of this object opened read-only (the caller closes it). INTERNAL with
  // errno text when the kernel refuses.
  absl::StatusOr<int> OpenReadOnlyFd() const;

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  ShmSegment(std::string name, uint8_t* data, uint64_t size, bool owner, int fd)
      : name_(std::move(name)), data_(data), size_(size), owner_(owner), fd_(fd) {}
  void Reset();

  std::string name_;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  bool owner_ = false;
  int fd_ = -1;  // the creating side's descriptor, for Reserve
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_TIER_SHM_SEGMENT_H_
