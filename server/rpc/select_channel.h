// Shared-memory Select channels (OpenChannel; the layout is kvtier/channel_layout.h): a
// worker on this host calls Select, BatchSelect and Release through memory it shares with
// the daemon and two eventfd doorbells, without gRPC. Each channel is one tenant's, fixed
// when the authenticated OpenChannel call made it, and is a worker of that tenant's (its
// Selects' leases end with it); a thread of its own serves it, one call at a time. The
// request's bytes are copied out of the shared memory before they are parsed, so a worker
// writing meanwhile changes only what it sent. A channel ends when its worker's end of the
// socket pair closes (the worker exited or closed it), when its descriptors are not collected
// within kCollectWithin, or when the hub stops (the daemon drains): then the worker's socket
// end sees the hang-up.
//
// Co-location (--channel_colocate): a wake-up of a sleeping thread on another core costs tens
// of microseconds (far more in a virtual machine, whose idle core must be woken by its host),
// twice a call (the request, then the answer). A worker that writes the CPU it calls from gets
// the channel's thread held on that CPU between calls (sched_setaffinity of the thread alone;
// a CPU outside the daemon's own set is refused, and the thread runs anywhere). The worker
// then gives its CPU up until the answer comes rather than spinning, and the thread, woken on
// the same CPU, serves the call there and watches for the next one by yielding (a spin would
// hold the worker off its own CPU): each call is a hand-over on one core, with no other core
// woken. The thread follows the worker when it moves.
//
// Thread-safe. mu_ is lock order 19, a leaf.
#ifndef KVTIER_SERVER_RPC_SELECT_CHANNEL_H_
#define KVTIER_SERVER_RPC_SELECT_CHANNEL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/tier/shm_segment.h"

namespace kvtier {

class ChannelHub {
 public:
  static constexpr int kMaxChannels = 256, kMaxPerTenant = 64;
  static constexpr uint64_t kDefaultBytes = 4ull << 20, kMinBytes = 64ull << 10;
  static constexpr absl::Duration kCollectWithin = absl::Seconds(15);
  // After each answer a channel's thread watches for the next request this long before it
  // sleeps on the doorbell (each wake-up costs tens of microseconds on a busy host).
  static constexpr int kSpinUs = 100;

  struct Call {
    const std::string& tenant;
    const std::string& worker;  // the channel's own worker id
    uint32_t op;                // channel::Op
    absl::string_view request;  // the serialized request, a private copy
    uint64_t reply_limit;       // the response area's bytes: a larger reply is refused first
  };
  struct Hooks {
    // Serves one call: the serialized response into `out`, or an error.
    std::function<absl::Status(const Call& call, std::string* out)> serve;
    // A new worker of `tenant` for a channel, and its end.
    std::function<std::string(const std::string& tenant)> attach;
    std::function<void(const std::string& worker)> detach;
  };

  // colocate: each channel's thread waits for the next call on the CPU its worker says it
  // calls from (channel_layout.h: worker_cpu, serving_cpu), watching for it by yielding.
  ChannelHub(std::string label, Hooks hooks, bool colocate);
  ~ChannelHub();  // Stop()
  ChannelHub(const ChannelHub&) = delete;
  ChannelHub& operator=(const ChannelHub&) = delete;

  struct Opened {
    uint64_t id;
    uint64_t size_bytes;
    std::string worker_id;
  };
  // A channel of `tenant` whose memory holds `size_bytes` (0: kDefaultBytes; rounded up to
  // pages; at most `max_bytes`): INVALID_ARGUMENT naming size_bytes out of range,
  // RESOURCE_EXHAUSTED past kMaxChannels or kMaxPerTenant, UNAVAILABLE once stopping,
  // INTERNAL when the kernel refuses a descriptor.
  absl::StatusOr<Opened> Open(const std::string& tenant, uint64_t size_bytes, uint64_t max_bytes);
  // Descriptor `index` (channel_layout.h) of channel `id` of `tenant`, for the descriptor
  // socket, which closes it after sending. The worker's socket end is handed once (the
  // channel lets go of it); NOT_FOUND for no such live channel of this tenant.
  absl::StatusOr<int> OpenFd(uint64_t id, const std::string& tenant, size_t index);
  // Ends channel `id` now, its descriptors never to be handed (the ticket for them was
  // refused): its thread ends it at once, and it counts against the bounds until then.
  void Abandon(uint64_t id);
  // Ends every channel and joins their threads; Open is UNAVAILABLE from then on.
  void Stop();
  int open_channels() const;
  // Calls answered by the channels' threads, by where: on the CPU the calling worker named
  // (co-located), or anywhere else (no CPU named, co-location off or refused, or the worker
  // had moved since). Monotonic.
  struct Counters {
    uint64_t beside_worker = 0;
    uint64_t elsewhere = 0;
  };
  Counters counters() const {
    return {beside_worker_.load(std::memory_order_relaxed),
            elsewhere_.load(std::memory_order_relaxed)};
  }

 private:
  struct Channel;
  void Serve(Channel* c);                                // the channel's thread
  uint64_t Answer(Channel* c);                           // one call; returns the seq it answered
  void ReapLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);  // joins ended channels' threads

  const std::string label_;
  const Hooks hooks_;
  const bool colocate_;
  std::atomic<uint64_t> beside_worker_{0}, elsewhere_{0};
  int stop_fd_ = -1;  // an eventfd every channel's thread polls; written once by Stop
  // Set by Stop before it writes stop_fd_: a thread that answers call after call, and so never
  // polls, looks at it before each.
  std::atomic<bool> stop_requested_{false};
  mutable absl::Mutex mu_;  // lock order 19 (server/common/lock_order.h)
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, std::unique_ptr<Channel>> channels_ ABSL_GUARDED_BY(mu_);
  // Channels an Open is making (outside mu_), by tenant and in all: counted in the bounds.
  std::map<std::string, int> reserved_ ABSL_GUARDED_BY(mu_);
  size_t reserved_total_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_RPC_SELECT_CHANNEL_H_
