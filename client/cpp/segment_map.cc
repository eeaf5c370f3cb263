#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <string>
#include <string_view>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "kvtier/client.h"

namespace kvtier {

namespace {

// "/kvtier-" then letters, digits, '.', '_' or '-' (no other '/'): one file of /dev/shm.
bool IsSegmentName(const std::string& name) {
  constexpr std::string_view kPrefix = "/kvtier-";
  if (name.size() <= kPrefix.size() || name.compare(0, kPrefix.size(), kPrefix) != 0) return false;
  for (size_t i = 1; i < name.size(); ++i) {
    const char c = name[i];
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return false;
    }
  }
  return true;
}

}  // namespace

SegmentMap::~SegmentMap() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, m] : maps_) munmap(const_cast<uint8_t*>(m.data), m.size);
  for (const Mapping& m : retired_) munmap(const_cast<uint8_t*>(m.data), m.size);
}

absl::StatusOr<size_t> SegmentMap::Prune(Client& client) {
  auto list = client.ListSegments();
  if (!list.ok()) return list.status();
  std::map<uint64_t, uint64_t> listed;  // id -> stamp
  for (const v1::Segment& seg : list->segments()) listed[seg.segment_id()] = seg.stamp();
  std::vector<Mapping> drop;
  {
    std::lock_guard<std::mutex> lock(mu_);
    drop.swap(retired_);
    for (auto it = maps_.begin(); it != maps_.end();) {
      const auto l = listed.find(it->first);
      if (l != listed.end() && l->second == it->second.stamp) {
        ++it;
        continue;
      }
      drop.push_back(it->second);
      it = maps_.erase(it);
    }
  }
  for (const Mapping& m : drop) munmap(const_cast<uint8_t*>(m.data), m.size);
  return drop.size();
}

bool SegmentMap::StampMatches(int fd, const v1::Segment& seg) {
  if (seg.stamp_offset() == 0) return true;  // a daemon that writes none
  uint64_t stamp = 0;
  const ssize_t n = pread(fd, &stamp, sizeof stamp, static_cast<off_t>(seg.stamp_offset()));
  return n == static_cast<ssize_t>(sizeof stamp) && stamp == seg.stamp();
}

absl::StatusOr<SegmentMap::Mapping> SegmentMap::Find(Client& client, uint64_t segment_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = maps_.find(segment_id); it != maps_.end()) return it->second;
  }
  auto list = client.ListSegments();
  if (!list.ok()) return list.status();
  const v1::Segment* listed = nullptr;
  for (const v1::Segment& seg : list->segments()) {
    if (seg.segment_id() == segment_id) listed = &seg;
  }
  if (listed == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("segment_id: ", segment_id, " is not listed by the daemon"));
  }
  // Nothing the daemon says is trusted: a name must be one kvtier segment file (no path;
  // shm_open does not follow a link). A segment this process may not open by name (another
  // uid's: they are mode 0600) comes as a read-only descriptor instead.
  v1::Segment seg = *listed;
  int fd = -1;
  if (!seg.shm_name().empty()) {
    if (!IsSegmentName(seg.shm_name())) {
      return absl::FailedPreconditionError(absl::StrCat("segment ", segment_id, ": shm_name \"",
                                                        absl::CEscape(seg.shm_name()),
                                                        "\" is not a kvtier segment name"));
    }
    fd = shm_open(seg.shm_name().c_str(), O_RDONLY | O_NOFOLLOW, 0);
    if (fd < 0 && errno != EACCES && errno != ENOENT) {
      return absl::NotFoundError(absl::StrCat("segment ", segment_id, ": shm_open ", seg.shm_name(),
                                              ": ", std::strerror(errno)));
    }
    if (fd >= 0 && !StampMatches(fd, seg)) {
      close(fd);
      fd = -1;
    }
  }
  if (fd < 0) {
    auto opened = client.OpenSegments({segment_id});  // checked: one, of this id
    if (!opened.ok()) return opened.status();
    seg = opened->front().segment;
    fd = opened->front().fd;
  }
  return Map(segment_id, seg, fd);
}

absl::StatusOr<SegmentMap::Mapping> SegmentMap::Map(uint64_t segment_id, const v1::Segment& seg,
                                                    int fd) {
  // The file must hold the bytes the daemon claims (a map past a file's end faults when read).
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return absl::InternalError(
        absl::StrCat("segment ", segment_id, ": fstat: ", std::strerror(err)));
  }
  // A GPU segment's host memory is its generation table and stamp alone.
  const bool gpu = !seg.cuda_ipc_handle().empty();
  const uint64_t host_bytes = gpu ? seg.stamp_offset() + 8 : seg.size_bytes();
  if (seg.segment_id() != segment_id || seg.size_bytes() == 0 ||
      host_bytes > static_cast<uint64_t>(st.st_size)) {
    close(fd);
    return absl::FailedPreconditionError(absl::StrCat("segment ", segment_id, ": size_bytes ",
                                                      seg.size_bytes(), " but its memory holds ",
                                                      st.st_size, " bytes"));
  }
  void* p = mmap(nullptr, host_bytes, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    return absl::InternalError(
        absl::StrCat("segment ", segment_id, ": mmap: ", std::strerror(errno)));
  }
  Mapping m;
  m.data = static_cast<const uint8_t*>(p);
  m.size = host_bytes;
  m.slot_bytes = seg.slot_bytes();
  m.table_offset = seg.generation_table_offset();
  m.stamp = seg.stamp();
  if (gpu) {
    m.cuda_ipc_handle = seg.cuda_ipc_handle();
    m.device = seg.device();
    m.device_bytes = seg.size_bytes();
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = maps_.emplace(segment_id, m);
  if (!inserted) munmap(p, m.size);  // another thread mapped it meanwhile
  return it->second;
}

absl::StatusOr<SegmentMap::Mapping> SegmentMap::Current(Client& client, const v1::BlockHandle& h) {
  auto m = Find(client, h.segment_id());
  if (!m.ok()) return m.status();
  if (CheckGeneration(*m, h).ok() || !Outdated(client, h.segment_id(), *m)) return m;
  // A mapping of what the id named before (a retired segment, a daemon since restarted): set
  // aside, and what the daemon lists now mapped, once.
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = maps_.find(h.segment_id()); it != maps_.end() && it->second.data == m->data) {
      retired_.push_back(it->second);
      maps_.erase(it);
    }
  }
  return Find(client, h.segment_id());
}

absl::StatusOr<ChunkView> SegmentMap::View(Client& client, const v1::BlockHandle& h) {
  auto m = Current(client, h);
  if (!m.ok()) return m.status();
  if (m->device >= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "segment ", h.segment_id(), " is memory of CUDA device ", m->device,
        ": read it through DeviceView (kvtier/cuda_segments.h), or Select with include_data"));
  }
  if (h.length() > m->size || h.offset() > m->size - h.length() || h.length() % 4 != 0) {
    return absl::OutOfRangeError(absl::StrCat("handle: offset ", h.offset(), " + length ",
                                              h.length(), " exceeds segment ", h.segment_id()));
  }
  if (absl::Status s = CheckGeneration(*m, h); !s.ok()) return s;
  const uint64_t half = h.length() / 2;
  const uint16_t* base = reinterpret_cast<const uint16_t*>(m->data + h.offset());
  return ChunkView{{base, half / 2}, {base + half / 2, half / 2}};
}

absl::StatusOr<DeviceChunk> SegmentMap::DeviceView(Client& client, const v1::BlockHandle& h) {
  auto m = Current(client, h);
  if (!m.ok()) return m.status();
  if (m->device < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("segment ", h.segment_id(), " is host memory: read it through View"));
  }
  if (h.length() > m->device_bytes || h.offset() > m->device_bytes - h.length() ||
      h.length() % 4 != 0) {
    return absl::OutOfRangeError(absl::StrCat("handle: offset ", h.offset(), " + length ",
                                              h.length(), " exceeds segment ", h.segment_id()));
  }
  if (absl::Status s = CheckGeneration(*m, h); !s.ok()) return s;
  return DeviceChunk{h.segment_id(), m->stamp,   m->cuda_ipc_handle,
                     m->device,      h.offset(), h.length()};
}

bool SegmentMap::Outdated(Client& client, uint64_t segment_id, const Mapping& m) {
  auto list = client.ListSegments();
  if (!list.ok()) return false;  // the handle's own check then answers
  for (const v1::Segment& seg : list->segments()) {
    if (seg.segment_id() == segment_id) return seg.stamp() != m.stamp;
  }
  return true;
}

absl::Status SegmentMap::CheckGeneration(const Mapping& m, const v1::BlockHandle& h) {
  if (m.slot_bytes == 0) return absl::OkStatus();  // a daemon without generation tables
  // The table's place and the cell's index are the daemon's word: checked without wrapping,
  // and the cell 8-byte aligned (it is read atomically).
  const uint64_t index = h.offset() / m.slot_bytes;
  if (m.table_offset > m.size || m.size - m.table_offset < 8 || m.table_offset % 8 != 0 ||
      index > (m.size - m.table_offset - 8) / 8) {
    return absl::OutOfRangeError(absl::StrCat(
        "handle: offset ", h.offset(), " has no generation cell in segment ", h.segment_id()));
  }
  const uint64_t cell = m.table_offset + 8 * index;
  const uint64_t now =
      std::atomic_ref<const uint64_t>(*reinterpret_cast<const uint64_t*>(m.data + cell))
          .load(std::memory_order_acquire);
  if (now != h.generation()) {
    return absl::AbortedError(absl::StrCat(
        "stale handle: chunk ", h.chunk_id(), " (segment ", h.segment_id(), ", offset ", h.offset(),
        ") names generation ", h.generation(), " but the slot now holds ",
        now == 0 ? std::string("nothing (freed)") : absl::StrCat("generation ", now),
        "; its bytes are not the chunk's"));
  }
  return absl::OkStatus();
}

absl::Status SegmentMap::Recheck(const v1::BlockHandle& h) {
  Mapping m;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = maps_.find(h.segment_id());
    if (it == maps_.end()) {
      return absl::NotFoundError(absl::StrCat("segment_id: ", h.segment_id(), " is not mapped"));
    }
    m = it->second;
  }
#ifndef __SANITIZE_THREAD__  // TSAN does not model fences (-Wtsan); its builds only test the logic
  std::atomic_thread_fence(std::memory_order_acquire);  // the copy happened before the check
#endif
  return CheckGeneration(m, h);
}

absl::Status SegmentMap::CopyOut(Client& client, const v1::BlockHandle& h, std::span<uint16_t> keys,
                                 std::span<uint16_t> values) {
  auto view = View(client, h);
  if (!view.ok()) return view.status();
  if (keys.size() != view->keys.size() || values.size() != view->values.size()) {
    return absl::InvalidArgumentError(absl::StrCat("keys/values: ", keys.size(), "/", values.size(),
                                                   " elements for a handle of ",
                                                   view->keys.size()));
  }
  std::memcpy(keys.data(), view->keys.data(), keys.size_bytes());
  std::memcpy(values.data(), view->values.data(), values.size_bytes());
  return Recheck(h);
}

}  // namespace kvtier
