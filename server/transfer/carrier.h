// The chunk bytes of a session moved between two daemons, carried beside its parts instead of
// inside them (server/session/transfer.h): the exporting daemon offers a carrier and puts its
// bootstrap in the transfer's header; the importing daemon joins with that bootstrap when the
// header reaches it through the caller. Then each chunks part that passes through the caller
// holds only the sizes and a checksum of its bytes, and the bytes go daemon to daemon:
//
//   NCCL    GPU to GPU (ncclSend / ncclRecv on a two-rank communicator whose ncclUniqueId is
//           the bootstrap), both daemons on CUDA devices; libnccl.so.2 is loaded when first
//           used, so a daemon without it refuses the carrier and runs on.
//   socket  a TCP connection on 127.0.0.1 that the importer opens to the exporter with a
//           one-time token: the same protocol on a machine without a GPU (the NCCL carrier's
//           CPU twin), for two daemons on one host.
//
// The exporter sends at most kCarrierDepth parts' bytes ahead of what the importer has taken,
// so neither side holds more than that. Every wait is bounded by the carrier's timeout
// (DEADLINE_EXCEEDED naming what was awaited), after which the connection or communicator is
// aborted: a peer that died or never joined costs its transfer an error, never a hang. The
// importer acknowledges the last bytes once it has checked them all, and the exporter counts
// the move done only after that acknowledgement.
#ifndef KVTIER_SERVER_TRANSFER_CARRIER_H_
#define KVTIER_SERVER_TRANSFER_CARRIER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvtier {

enum class CarrierKind { kSocket, kNccl };

inline constexpr int kCarrierDepth = 2;

struct CarrierOptions {
  // The CUDA device of this daemon (NCCL); -1: none.
  int gpu = -1;
  // Each wait for the peer: to join, to take bytes, to send them, to acknowledge.
  absl::Duration timeout = absl::Seconds(60);
  // Set (by the call the carrier serves, when its caller cancels it): every wait ends within
  // about 100 ms with CANCELLED. Outlives the carrier.
  const std::atomic<bool>* cancelled = nullptr;
};

class ByteCarrier {
 public:
  virtual ~ByteCarrier() = default;
  // Exporter: `bytes` for the peer, after every earlier Send's. Returns once they are on their
  // way (waits while kCarrierDepth sends are ahead of the peer).
  virtual absl::Status Send(std::string bytes) = 0;
  // Importer: the next `n` bytes the peer sent.
  virtual absl::StatusOr<std::string> Recv(uint64_t n) = 0;
  // Exporter: waits until the importer acknowledged every byte. Importer: acknowledges them.
  virtual absl::Status Finish() = 0;
};

// The exporting side: a carrier waiting for its peer, and the bootstrap the peer joins with.
struct OfferedCarrier {
  std::unique_ptr<ByteCarrier> carrier;
  std::string bootstrap;
};
absl::StatusOr<OfferedCarrier> OfferCarrier(CarrierKind kind, const CarrierOptions& options);

// The importing side, joining the carrier a header's bootstrap names. INVALID_ARGUMENT for a
// bootstrap that is not one; FAILED_PRECONDITION where this daemon cannot use the kind.
absl::StatusOr<std::unique_ptr<ByteCarrier>> JoinCarrier(CarrierKind kind,
                                                         absl::string_view bootstrap,
                                                         const CarrierOptions& options);

// The NCCL carrier's two sides (carrier_nccl.cc in a CUDA build; elsewhere FAILED_PRECONDITION).
absl::StatusOr<OfferedCarrier> OfferNcclCarrier(const CarrierOptions& options);
absl::StatusOr<std::unique_ptr<ByteCarrier>> JoinNcclCarrier(absl::string_view bootstrap,
                                                             const CarrierOptions& options);

}  // namespace kvtier

#endif  // KVTIER_SERVER_TRANSFER_CARRIER_H_
