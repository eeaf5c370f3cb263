// Handles on a GPU device tier, read through CUDA IPC. Header-only and for workers built with
// CUDA: it calls the CUDA runtime the worker links (the client library itself does not).
//
//   kvtier::SegmentMap tables;             // host mappings of the segments' generation tables
//   kvtier::CudaSegments gpu(&tables);     // the daemon's allocations, opened on first use
//   auto chunk = gpu.View(client, handle); // device pointers of K [n][d] and V [n][d]
//   ... kernels read chunk->keys / chunk->values ...
//   tables.Recheck(handle);                // after reading: the slot still held that chunk
//
// Each allocation is opened once (cudaIpcOpenMemHandle on the current device). One the daemon
// lists with another stamp (retired, or the daemon restarted and reused the id) is set aside
// when a handle names the new one, since pointers of it may still be in use (by another thread,
// or a kernel queued); Prune closes those and the allocations of segments no longer listed, and
// so does destroying this object.
#ifndef KVTIER_CUDA_SEGMENTS_H_
#define KVTIER_CUDA_SEGMENTS_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kvtier/client.h"

namespace kvtier {

struct CudaChunk {
  const void* keys;    // device memory: [num_tokens][head_dim] 2-byte values
  const void* values;  // [num_tokens][head_dim]
  uint64_t bytes;      // of each
};

class CudaSegments {
 public:
  explicit CudaSegments(SegmentMap* tables) : tables_(tables) {}
  ~CudaSegments() {
    for (auto& [id, open] : open_) (void)cudaIpcCloseMemHandle(open.base);
    for (uint8_t* base : retired_) (void)cudaIpcCloseMemHandle(base);
  }
  CudaSegments(const CudaSegments&) = delete;
  CudaSegments& operator=(const CudaSegments&) = delete;

  // The device pointers of a handle on a GPU segment, its generation checked first.
  absl::StatusOr<CudaChunk> View(Client& client, const v1::BlockHandle& handle) {
    absl::StatusOr<DeviceChunk> d = tables_->DeviceView(client, handle);
    if (!d.ok()) return d.status();
    std::lock_guard<std::mutex> lock(mu_);
    auto it = open_.find(d->segment_id);
    if (it != open_.end() && it->second.stamp != d->stamp) {  // what the id named before
      retired_.push_back(it->second.base);                    // closed by Prune
      open_.erase(it);
      it = open_.end();
    }
    if (it == open_.end()) {
      cudaIpcMemHandle_t h;
      if (d->cuda_ipc_handle.size() != sizeof h) {
        return absl::FailedPreconditionError(
            absl::StrCat("segment ", d->segment_id, ": cuda_ipc_handle of ",
                         d->cuda_ipc_handle.size(), " bytes, not ", sizeof h));
      }
      std::memcpy(&h, d->cuda_ipc_handle.data(), sizeof h);
      void* base = nullptr;
      const cudaError_t e = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
      if (e != cudaSuccess) {
        return absl::UnavailableError(absl::StrCat("segment ", d->segment_id,
                                                   ": cudaIpcOpenMemHandle: ", cudaGetErrorName(e),
                                                   " (", cudaGetErrorString(e), ")"));
      }
      it = open_.emplace(d->segment_id, Open{static_cast<uint8_t*>(base), d->stamp}).first;
    }
    const uint64_t half = d->length / 2;
    return CudaChunk{it->second.base + d->offset, it->second.base + d->offset + half, half};
  }

  // Closes the allocations of segments the daemon no longer lists as opened, and those set
  // aside. Pointers of them must no longer be used: call it where none is (between decode
  // steps, after a restart), with the kernels that read them finished.
  absl::Status Prune(Client& client) {
    absl::StatusOr<v1::ListSegmentsResponse> list = client.ListSegments();
    if (!list.ok()) return list.status();
    std::map<uint64_t, uint64_t> listed;
    for (const v1::Segment& s : list->segments()) listed[s.segment_id()] = s.stamp();
    std::lock_guard<std::mutex> lock(mu_);
    for (uint8_t* base : retired_) (void)cudaIpcCloseMemHandle(base);
    retired_.clear();
    for (auto it = open_.begin(); it != open_.end();) {
      auto l = listed.find(it->first);
      if (l != listed.end() && l->second == it->second.stamp) {
        ++it;
        continue;
      }
      (void)cudaIpcCloseMemHandle(it->second.base);
      it = open_.erase(it);
    }
    return absl::OkStatus();
  }

  size_t open() const {
    std::lock_guard<std::mutex> lock(mu_);
    return open_.size();
  }

 private:
  struct Open {
    uint8_t* base;
    uint64_t stamp;
  };
  SegmentMap* const tables_;
  mutable std::mutex mu_;
  std::map<uint64_t, Open> open_;  // by segment id; guarded by mu_
  std::vector<uint8_t*> retired_;  // set aside by View, closed by Prune; guarded by mu_
};

}  // namespace kvtier

#endif  // KVTIER_CUDA_SEGMENTS_H_
