#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "server/common/mutex.h"
#include "absl/strings/str_cat.h"
#include "kvtier/client.h"

namespace kvtier {

SegmentMap::~SegmentMap() {
  MutexLock lock(&mu_);
  for (auto& [id, m] : maps_) munmap(const_cast<uint8_t*>(m.data), m.size);
}

absl::StatusOr<SegmentMap::Mapping> SegmentMap::Find(Client& client, uint64_t segment_id) {
  {
    MutexLock lock(&mu_);
    if (auto it = maps_.find(segment_id); it != maps_.end()) return it->second;
  }
  auto list = client.ListSegments();
  if (!list.ok()) return list.status();
  for (const v1::Segment& seg : list->segments()) {
    if (seg.segment_id() != segment_id) continue;
    int fd = shm_open(seg.shm_name().c_str(), O_RDONLY, 0);
    if (fd < 0) {
      return absl::NotFoundError(
          absl::StrCat("shm_open ", seg.shm_name(), ": ", std::strerror(errno)));
    }
    void* p = mmap(nullptr, seg.size_bytes(), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
      return absl::InternalError(absl::StrCat("mmap ", seg.shm_name(), ": ", std::strerror(errno)));
    }
    Mapping m{static_cast<const uint8_t*>(p), seg.size_bytes()};
    MutexLock lock(&mu_);
    auto [it, inserted] = maps_.emplace(segment_id, m);
    if (!inserted) munmap(p, m.size);  // another thread mapped it meanwhile
    return it->second;
  }
  return absl::NotFoundError(absl::StrCat("segment_id: ", segment_id, " is not listed by the daemon"));
}

absl::StatusOr<ChunkView> SegmentMap::View(Client& client, const v1::BlockHandle& h) {
  auto m = Find(client, h.segment_id());
  if (!m.ok()) return m.status();
  if (h.offset() + h.length() > m->size || h.length() % 4 != 0) {
    return absl::OutOfRangeError(absl::StrCat("handle: offset ", h.offset(), " + length ",
                                              h.length(), " exceeds segment ", h.segment_id()));
  }
  const uint64_t half = h.length() / 2;
  const uint16_t* base = reinterpret_cast<const uint16_t*>(m->data + h.offset());
  return ChunkView{{base, half / 2}, {base + half / 2, half / 2}};
}

}  // namespace kvtier
