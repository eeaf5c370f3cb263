// A shared-memory object mapped into this process: a named POSIX object (/dev/shm/<name>) or
// an unnamed memfd that no other process can open by any path. Move-only; the destructor
// unmaps, and the creating side also unlinks a name, so nothing is left in /dev/shm.
#ifndef KVTIER_SERVER_TIER_SHM_SEGMENT_H_
#define KVTIER_SERVER_TIER_SHM_SEGMENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvtier {

class ShmSegment {
 public:
  enum class Naming {
    kNamed,  // /dev/shm/<name>, mode 0600: the daemon's uid may open it by name
    kMemfd,  // unnamed (memfd_create): only descriptors reach it, and it dies with them
    // Unnamed like kMemfd, but every holder of a writable descriptor may write it (a worker's
    // staging area): only its size is sealed.
    kMemfdShared,
  };

  // Creates `name` ("/kvtier-..."), sized `size` bytes (sparse: nothing is committed until
  // Reserve), mapped read-write. kNamed: mode 0600 (only the daemon's uid opens it by name;
  // other workers get read-only descriptors, OpenReadOnlyFd), and a stale object of that name
  // is replaced. kMemfd: `name` only labels it (/proc/<pid>/fd shows "memfd:kvtier-..."); its
  // size is sealed, and so is any later writable mapping (F_SEAL_FUTURE_WRITE): only this
  // process's own mapping writes it. INTERNAL (with errno text) when the kernel refuses.
  static absl::StatusOr<ShmSegment> Create(const std::string& name, uint64_t size,
                                           Naming naming = Naming::kNamed);

  // Commits the pages of [offset, offset + length) before they are written (posix_fallocate),
  // so that a full /dev/shm is RESOURCE_EXHAUSTED here rather than a SIGBUS on first touch.
  // The creating side only.
  absl::Status Reserve(uint64_t offset, uint64_t length);
  // Maps the committed pages of [offset, offset + length) into this process ahead of their
  // first write (MADV_POPULATE_WRITE), so that filling them takes no page fault per page. Best
  // effort: a kernel without it leaves them to fault in as before.
  void Populate(uint64_t offset, uint64_t length);
  // Frees the pages of [offset, offset + length) (FALLOC_FL_PUNCH_HOLE: they read as zeros
  // after), whoever else holds the object: a worker's descriptor then keeps the object alive,
  // not its memory. The creating side only; INTERNAL with errno text when the kernel refuses
  // (a segment sealed against writes).
  absl::Status Release(uint64_t offset, uint64_t length);

  // Maps an existing object read-only, as a worker does. NOT_FOUND if it does not exist.
  static absl::StatusOr<ShmSegment> OpenReadOnly(const std::string& name);

  // Removes every object in /dev/shm named `prefix` followed by digits only (a crashed
  // daemon's segments: "/kvtier-<instance>-<tier>-" and the segment id, so that instance "a"
  // never matches instance "a-host"'s). Returns how many were removed. One pass over
  // /dev/shm for all the prefixes (a directory of thousands of names is read once).
  static int RemoveStale(const std::string& prefix);
  static int RemoveStale(const std::vector<std::string>& prefixes);

  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  // A new descriptor of this object opened read-only (the caller closes it). INTERNAL with
  // errno text when the kernel refuses.
  absl::StatusOr<int> OpenReadOnlyFd() const;
  // The same, read-write (kMemfdShared: its holder writes the object).
  absl::StatusOr<int> OpenWritableFd() const;

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  // The creating name; for a memfd segment a label only, which nothing can open.
  const std::string& name() const { return name_; }
  bool named() const { return named_; }

 private:
  ShmSegment(std::string name, bool named, uint8_t* data, uint64_t size, bool owner, int fd)
      : name_(std::move(name)), named_(named), data_(data), size_(size), owner_(owner), fd_(fd) {}
  void Reset();
  absl::StatusOr<int> Reopen(int flags) const;

  std::string name_;
  bool named_ = true;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  bool owner_ = false;
  int fd_ = -1;  // the creating side's descriptor, for Reserve
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_TIER_SHM_SEGMENT_H_
