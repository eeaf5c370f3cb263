// The shared-memory Select channel (OpenChannel): its memory's layout and its descriptors, as
// the daemon and every client read them. Besides Select, BatchSelect and Release it carries a
// decode loop's per-layer appends (Op). Part of the API: a client in another language
// follows this file.
//
// The channel is one memory object (an unnamed memfd, read-write) and three more descriptors,
// handed in this order by the ticket of the OpenChannel call on the descriptor socket:
//   0  the memory: a Header at offset 0, the request area and the response area after it
//   1  the request doorbell, an eventfd the worker adds 1 to once a request is written
//   2  the response doorbell, an eventfd the daemon adds 1 to once the answer is written
//   3  the worker's end of a socket pair: nothing travels on it; it closes when either side
//      goes away, so the daemon ends the channel (and the leases of its Selects) when the
//      worker dies, and the worker sees a daemon that exits or drains
// One call at a time per channel: the worker writes the request's bytes (the serialized
// message of `op`) at request_offset, then op and request_bytes, then a new seq, last and as
// one aligned 8-byte store (the daemon may be watching seq, and serves what it sees when seq
// changes), then rings the request doorbell (unless daemon_watching, below, says the daemon
// watches); it waits for the response doorbell (and the socket) until answered_seq is its seq, then
// reads code and response_bytes: the serialized response when code is 0, else the error's message
// (code is an absl/gRPC status code). Fields are little-endian.
#ifndef KVTIER_CHANNEL_LAYOUT_H_
#define KVTIER_CHANNEL_LAYOUT_H_

#include <cstddef>
#include <cstdint>

namespace kvtier::channel {

constexpr uint32_t kMagic = 0x4843564bu;  // "KVCH"
constexpr uint32_t kVersion = 1;

enum Op : uint32_t {
  kSelect = 1,       // SelectRequest -> SelectResponse
  kBatchSelect = 2,  // BatchSelectRequest -> BatchSelectResponse
  kRelease = 3,      // ReleaseRequest -> ReleaseResponse
  // AppendKVRequest -> AppendKVResponse: one append, as an AppendKV stream of that one message
  // (bytes inline or staged); num_tokens is then the tokens stored in every layer. A daemon
  // older than this op answers INVALID_ARGUMENT naming op.
  kAppendKV = 4,
};

struct Header {
  // Written by the daemon when it opens the channel.
  uint32_t magic;
  uint32_t version;
  uint64_t request_offset;
  uint64_t request_capacity;
  uint64_t response_offset;
  uint64_t response_capacity;
  // Written by the worker, per call, before it rings.
  uint32_t op;
  uint32_t request_bytes;
  uint64_t seq;
  // Written by the daemon, per answer, before it rings.
  uint64_t answered_seq;
  int32_t code;
  uint32_t response_bytes;
  // Optional, written by the worker per call before seq: 1 + the CPU its calling thread runs on
  // (0: not said). A daemon that co-locates (--channel_colocate) holds the channel's thread on
  // that CPU between calls, and says so in serving_cpu (1 + that CPU; 0: its thread may run
  // anywhere). A worker calling from that very CPU should then not spin for the answer but
  // give the CPU up (sched_yield) until it comes: the call is served on its CPU, with no
  // wake-up of another core in either direction. A worker that says nothing is served as before.
  uint32_t worker_cpu;
  uint32_t serving_cpu;
  // Optional, to spare a doorbell nobody sleeps on (0 where a side does not know them: it is
  // rung as before). Each side sets its flag to 1 while it watches for the other's next store
  // (seq for the daemon, answered_seq for the worker) without sleeping, and to 0 before it
  // sleeps on its doorbell, then, after a full fence, looks at that store once more before it
  // sleeps. The other side, after its store and a full fence, rings only when the flag reads 0.
  // A flag only spares its own side a wake-up: a worker that writes a wrong one delays itself.
  uint32_t daemon_watching;  // written by the daemon
  uint32_t worker_watching;  // written by the worker
};

// The areas start here (a page), so the header never shares a page with them.
constexpr size_t kHeaderBytes = 4096;
// Descriptors a channel's ticket hands over, in the order above.
constexpr size_t kDescriptors = 4;

}  // namespace kvtier::channel

#endif  // KVTIER_CHANNEL_LAYOUT_H_
