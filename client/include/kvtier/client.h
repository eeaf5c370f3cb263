// kvtier C++ client: typed calls to kvtierd, and a map of its shared-memory segments so a
// worker reads a BlockHandle's K and V in place.
//
//   auto client = kvtier::Client::Connect("unix:/tmp/kvtier.sock");
//   auto session = (*client)->CreateSession(request);
//   ...
//   auto sel = (*client)->Select(select_request);
//   kvtier::SegmentMap segments;
//   for (const auto& head : sel->heads())
//     for (const auto& block : head.blocks()) {
//       auto view = segments.View(**client, block);   // spans over the daemon's memory
//       ...  attend over view->keys, view->values ...
//     }
//   (*client)->Release(sel->lease_id());
//
// Every call returns absl::Status with the server's code and message.
#ifndef KVTIER_CLIENT_H_
#define KVTIER_CLIENT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvtier/v1/kvtier.grpc.pb.h"

namespace kvtier {

struct ClientOptions {
  // Sent as x-kvtier-tenant on every call; empty: the tenant the credentials give ("default"
  // for a caller of the daemon's own uid).
  std::string tenant;
  // A bearer token, sent as `authorization: Bearer <token>` on every call (the daemon's
  // auth.tokens); empty: none (on the Unix socket the peer's uid speaks for it).
  std::string token;
  // TLS to a TCP listener: the CA that signed the daemon's certificate (PEM file; set: TLS),
  // and for mTLS this client's certificate chain and key (both or neither).
  std::string tls_ca_file, tls_cert_file, tls_key_file;
  // Largest message either way; match the daemon's max_message_size.
  int max_message_bytes = 64 << 20;
  // Deadline of each call (of each part's wait in MoveSession).
  absl::Duration timeout = absl::Seconds(60);
  // From the first Select on, hold an Attach stream open and name it in every Select and
  // BatchSelect (SelectRequest.worker_id), so that this client's leases end as soon as it
  // goes away (its process dies, its connection drops) instead of at their TTL. A request
  // that names a worker_id of its own keeps it. Against a daemon with no Attach: TTL only.
  bool attach = true;
};

class StagingBuffer;
class SelectChannel;
class AppendWriter;
namespace internal {
struct MoveCalls;
}  // namespace internal

class Client {
 public:
  // "unix:PATH" or "HOST:PORT". Connects lazily: the first call reports an unreachable daemon
  // (UNAVAILABLE).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& address,
                                                         ClientOptions options = {});
  // Ends the Attach stream, so the daemon ends this client's leases. Waits for the calls of
  // this client's moves that gRPC still holds (a stalled daemon's), at most the timeout (5 s
  // when it is longer).
  ~Client();

  absl::StatusOr<v1::CreateSessionResponse> CreateSession(const v1::CreateSessionRequest& req);
  // One client stream carrying `requests` in order; returns tokens stored in every layer.
  absl::StatusOr<uint64_t> AppendKV(const std::vector<v1::AppendKVRequest>& requests);
  // An AppendKV stream left open, each message sent as its bytes are ready: a prefill's
  // layers as they are computed, or (staged) each layer's K and V written into the staging
  // area just before its message, so that the daemon stores one while the next is written.
  std::unique_ptr<AppendWriter> OpenAppend();
  absl::StatusOr<v1::SelectResponse> Select(const v1::SelectRequest& req);
  // The same into `out`, cleared first: a decode loop that passes one response call after
  // call reuses its handles' memory instead of allocating and freeing them every call.
  absl::Status Select(const v1::SelectRequest& req, v1::SelectResponse* out);
  absl::StatusOr<v1::BatchSelectResponse> BatchSelect(const v1::BatchSelectRequest& req);
  absl::Status Release(const std::string& lease_id);
  absl::StatusOr<std::vector<v1::BlockHandle>> ReadChunks(const std::string& session_id,
                                                          const std::vector<uint64_t>& chunk_ids);
  absl::StatusOr<v1::CreateSessionResponse> ForkSession(const v1::ForkSessionRequest& req);
  // Idempotent: false when there was no such session.
  absl::StatusOr<bool> CloseSession(const std::string& session_id);
  // A copy of the session moved to the daemon `to` talks to (prefill here, decode there):
  // ExportSession's parts relayed into ImportSession there one at a time, as `new_session_id`
  // (empty: the same id). The session here stays until closed. The first failure on either
  // side ends both calls and is returned; nothing is imported then. `carrier`: how the chunks'
  // bytes go (v1::ChunkCarrier; NCCL: GPU to GPU, daemon to daemon, with only the parts'
  // sizes and checksums through this client). The timeout (the shorter of the two clients')
  // bounds the wait for each part, not the whole move, whose length grows with the session:
  // DEADLINE_EXCEEDED when nothing moved for that long. `progress`, when set, is called after
  // each part is handed to `to`, with the parts and bytes moved so far.
  using MoveProgress = std::function<void(uint64_t parts, uint64_t bytes)>;
  absl::StatusOr<v1::CreateSessionResponse> MoveSession(
      const std::string& session_id, Client& to, const std::string& new_session_id = "",
      v1::ChunkCarrier carrier = v1::CHUNK_CARRIER_PARTS, const MoveProgress& progress = nullptr);

  absl::StatusOr<v1::ListSessionsResponse> ListSessions();
  absl::StatusOr<v1::DescribeSessionResponse> DescribeSession(const std::string& session_id);
  absl::StatusOr<v1::ListChunksResponse> ListChunks(const v1::ListChunksRequest& req);
  absl::StatusOr<v1::GetTierStatsResponse> GetTierStats();
  absl::StatusOr<v1::ListSegmentsResponse> ListSegments();
  // Live leases (the caller's tenant's; an admin's: all), of one session when it is named.
  absl::StatusOr<v1::ListLeasesResponse> ListLeases(const std::string& session_id = "",
                                                    uint32_t limit = 0);
  // Read-only descriptors of this tenant's segments `ids` (empty: all), collected from the
  // daemon's descriptor socket (this client's socket path + ".fds") with the ticket of an
  // OpenSegments call; each is paired with the segment it is, and the caller closes them.
  // FAILED_PRECONDITION over TCP; a refusal on the socket is PERMISSION_DENIED with its
  // reason, a descriptor count other than the segments' FAILED_PRECONDITION (none kept).
  struct SegmentFd {
    v1::Segment segment;
    int fd;
  };
  absl::StatusOr<std::vector<SegmentFd>> OpenSegments(const std::vector<uint64_t>& ids);
  // A staging area of session `session_id` (OpenStaging), mapped read-write here: write K and
  // V into it and name them in AppendKVRequest.staged, so that the bytes never pass through
  // gRPC. It replaces the session's previous area. FAILED_PRECONDITION over TCP.
  absl::StatusOr<std::unique_ptr<StagingBuffer>> OpenStaging(const std::string& session_id,
                                                             uint64_t size_bytes);
  // A shared-memory Select channel (OpenChannel) for this thread's decode loop: Select,
  // BatchSelect and Release without gRPC, as this client's tenant. `size_bytes` 0: 4 MiB.
  // FAILED_PRECONDITION over TCP.
  absl::StatusOr<std::unique_ptr<SelectChannel>> OpenChannel(uint64_t size_bytes = 0);
  absl::StatusOr<uint64_t> Evict(const std::string& session_id, v1::Tier tier);
  absl::StatusOr<v1::SessionPolicy> SetPolicy(const std::string& session_id,
                                              const v1::SessionPolicy& policy);
  absl::StatusOr<uint32_t> Drain();
  absl::StatusOr<std::string> Echo(const std::string& payload, uint32_t response_bytes = 0);
  // grpc.health.v1.Health/Check for the whole server: true when SERVING.
  absl::StatusOr<bool> Health();

  // This client's worker id: its Attach stream's, attaching first when there is none or the
  // last one ended. Empty when ClientOptions::attach is off or the daemon has no Attach;
  // the stream's error when it could not attach.
  absl::StatusOr<std::string> WorkerId();

  v1::KvTier::Stub& stub() { return *stub_; }
  const ClientOptions& options() const { return options_; }

 private:
  Client(std::string address, std::shared_ptr<grpc::Channel> channel, ClientOptions options);
  void Prepare(grpc::ClientContext* ctx) const;
  // The tenant and token metadata of every call (Prepare, the Attach stream).
  static void AddCredentials(const ClientOptions& options, grpc::ClientContext* ctx);
  // Runs `call` with `req` naming this client's worker (unless it names one); once more
  // after attaching anew when the daemon no longer knows the worker (it restarted).
  template <typename Req, typename Call>
  auto WithWorker(const Req& req, Call&& call) -> decltype(call(req));
  // WorkerId, which looks whether the Attach stream has ended first only with `recheck`.
  absl::StatusOr<std::string> AttachedWorker(bool recheck);
  class Attachment;
  // The `want` descriptors of an OpenSegments or OpenStaging ticket, from this client's
  // socket path + ".fds"; none kept on an error.
  absl::StatusOr<std::vector<int>> CollectFds(const std::string& ticket, size_t want);

  const std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  // The calls of moves from or to this client that gRPC holds (MoveSession); shared with them.
  std::shared_ptr<internal::MoveCalls> moves_;
  std::unique_ptr<v1::KvTier::Stub> stub_;
  ClientOptions options_;
  std::mutex attach_mu_;                    // never held across a unary call
  std::unique_ptr<Attachment> attachment_;  // guarded by attach_mu_
  bool attach_unsupported_ = false;         // guarded by attach_mu_
};

// The server status as an absl::Status (codes agree).
absl::Status FromGrpcStatus(const grpc::Status& s);

// One open AppendKV stream (Client::OpenAppend); not thread-safe. Its deadline is the
// client's timeout, from the open. A step the daemon does not take by then and a second (a
// write into a connection whose daemon stopped reading ends only when it reads, whatever the
// deadline) is given up: the stream is cancelled and left to gRPC, and Finish answers
// DEADLINE_EXCEEDED.
class AppendWriter {
 public:
  ~AppendWriter();  // unfinished: cancels the stream (what the daemon stored stays stored)
  AppendWriter(const AppendWriter&) = delete;
  AppendWriter& operator=(const AppendWriter&) = delete;

  // Sends one message; false once the stream has ended (the daemon refused a message, or it
  // is gone): Finish says why.
  bool Write(const v1::AppendKVRequest& request);
  // Ends the stream: the tokens now stored in every layer, or the daemon's refusal.
  absl::StatusOr<uint64_t> Finish();

 private:
  friend class Client;
  AppendWriter();
  struct Call;
  // Cancels the call and hands it to a thread that waits for gRPC to be done with it.
  void GiveUp();
  std::unique_ptr<Call> call_;  // null once given up
  bool finished_ = false;
  bool ended_ = false;  // a step failed: the stream has ended, Finish says why
};

// A session's staging area mapped read-write in this process; unmapped when destroyed.
class StagingBuffer {
 public:
  ~StagingBuffer();
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;
  uint64_t id() const { return id_; }  // for StagedKV.staging_id
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  friend class Client;
  StagingBuffer(uint64_t id, uint8_t* data, uint64_t size) : id_(id), data_(data), size_(size) {}
  const uint64_t id_;
  uint8_t* const data_;
  const uint64_t size_;
};

// A Select channel's memory and descriptors in this process (Client::OpenChannel). One call at
// a time (a second thread waits for the first); each call waits at most the client's timeout,
// after which the channel is unusable (FAILED_PRECONDITION). Destroying it closes the channel:
// the daemon ends the leases of its Selects.
class SelectChannel {
 public:
  ~SelectChannel();
  SelectChannel(const SelectChannel&) = delete;
  SelectChannel& operator=(const SelectChannel&) = delete;

  // As the RPCs of the same names. A Select naming no worker_id gets the channel's.
  absl::StatusOr<v1::SelectResponse> Select(const v1::SelectRequest& req);
  // The same into `out`, cleared first (whatever the outcome). A decode loop that passes the
  // same response every step (or one on an arena) parses without allocating: a cleared
  // message keeps its handles' memory for the next answer.
  absl::Status Select(const v1::SelectRequest& req, v1::SelectResponse* out);
  absl::StatusOr<v1::BatchSelectResponse> BatchSelect(const v1::BatchSelectRequest& req);
  absl::Status Release(const std::string& lease_id);
  // One append (its bytes inline or staged), as an AppendKV stream of that one message: a
  // decode loop's layer appends without a gRPC call each. Returns the tokens stored in every
  // layer.
  absl::StatusOr<uint64_t> AppendKV(const v1::AppendKVRequest& req);

  uint64_t id() const { return id_; }
  const std::string& worker_id() const { return worker_; }

 private:
  friend class Client;
  SelectChannel() = default;
  // Writes `op`'s request, rings, waits for the answer and parses it into `resp`.
  absl::Status Call(uint32_t op, const google::protobuf::Message& req,
                    google::protobuf::Message* resp);

  uint64_t id_ = 0;
  std::string worker_;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  uint64_t request_offset_ = 0, request_capacity_ = 0;
  uint64_t response_offset_ = 0, response_capacity_ = 0;
  int fds_[4] = {-1, -1, -1, -1};  // memory, request doorbell, response doorbell, socket
  absl::Duration timeout_;
  std::mutex mu_;
  uint64_t seq_ = 0;     // guarded by mu_
  bool broken_ = false;  // guarded by mu_: a call timed out, or the daemon hung up
};

// K and V of one handle, in the daemon's memory (or in the handle's inline bytes).
struct ChunkView {
  std::span<const uint16_t> keys;    // [num_tokens][head_dim] fp16/bf16 bit patterns
  std::span<const uint16_t> values;  // [num_tokens][head_dim]
};

// Where a handle on a GPU device tier lies: an allocation of another process (the daemon's),
// opened with cudaIpcOpenMemHandle (kvtier/cuda_segments.h does, and caches it), and the
// range of the handle's K then V in it. `stamp` tells one segment of this id from another.
struct DeviceChunk {
  uint64_t segment_id;
  uint64_t stamp;
  std::string cuda_ipc_handle;  // cudaIpcMemHandle_t, 64 bytes
  int device;                   // the daemon's CUDA ordinal
  uint64_t offset, length;      // K [n][d] then V [n][d], 2-byte values
};

// Read-only mappings of a daemon's segments, by segment id. Thread-safe.
class SegmentMap {
 public:
  SegmentMap() = default;
  ~SegmentMap();
  SegmentMap(const SegmentMap&) = delete;
  SegmentMap& operator=(const SegmentMap&) = delete;

  // Maps the segment of `handle` (asking `client` for segment names when it is new) and
  // returns spans over its bytes. NOT_FOUND when the daemon lists no such segment;
  // OUT_OF_RANGE when the handle does not fit inside it; ABORTED when the slot no longer
  // holds the handle's generation (a stale handle). A mapping made before that does not hold
  // the handle's generation (its segment retired, or the daemon restarted and reused the id)
  // is never used for it: it is set aside and the segment mapped anew, once.
  absl::StatusOr<ChunkView> View(Client& client, const v1::BlockHandle& handle);

  // After reading through a view: OK when the slot still holds the handle's generation, so
  // what was read is what the handle named; ABORTED when it was freed or reused meanwhile
  // (the copy must be thrown away). NOT_FOUND when the segment was never mapped.
  absl::Status Recheck(const v1::BlockHandle& handle);

  // For a handle whose segment is GPU memory (Segment.cuda_ipc_handle): where it lies, once its
  // generation is checked in the segment's table (host shared memory, mapped here); Recheck
  // after reading. FAILED_PRECONDITION for a host segment (use View); OUT_OF_RANGE for a range
  // the allocation does not hold; ABORTED for a stale handle.
  absl::StatusOr<DeviceChunk> DeviceView(Client& client, const v1::BlockHandle& handle);

  // View, copy K and V out (each num_tokens * head_dim elements), then Recheck.
  absl::Status CopyOut(Client& client, const v1::BlockHandle& handle, std::span<uint16_t> keys,
                       std::span<uint16_t> values);

  // Unmaps what the daemon no longer lists as it was mapped (a segment retired, or every one of
  // a daemon since restarted: their memory stays allocated while a worker maps it), and every
  // mapping View set aside; returns how many. Views made of them must no longer be read:
  // call it where none is in use (between decode steps, after a restart). Errors are
  // ListSegments', and then nothing is unmapped.
  absl::StatusOr<size_t> Prune(Client& client);

 private:
  struct Mapping {
    const uint8_t* data;
    uint64_t size;
    uint64_t slot_bytes;
    uint64_t table_offset;  // the segment's generation table
    uint64_t stamp;         // the segment's, as listed when it was mapped
    // A GPU segment: data maps its table alone; its slots are this allocation of the daemon's.
    std::string cuda_ipc_handle;
    int device = -1;
    uint64_t device_bytes = 0;
  };
  // The mapping of `handle`'s segment holding its generation: mapped anew, once, when the one
  // held maps what the id named before (Outdated).
  absl::StatusOr<Mapping> Current(Client& client, const v1::BlockHandle& handle);
  // Whether the daemon lists `segment_id` with another stamp than `m`'s (or not at all): `m`
  // maps what the id named before.
  static bool Outdated(Client& client, uint64_t segment_id, const Mapping& m);
  static absl::Status CheckGeneration(const Mapping& m, const v1::BlockHandle& handle);
  absl::StatusOr<Mapping> Find(Client& client, uint64_t segment_id);
  // Maps `fd` (closed here) as segment `seg`, once its real size is checked.
  absl::StatusOr<Mapping> Map(uint64_t segment_id, const v1::Segment& seg, int fd);
  // Whether `fd` holds the segment's stamp (the daemon's file of that name, not another's).
  static bool StampMatches(int fd, const v1::Segment& seg);

  // A std::mutex, which ThreadSanitizer sees through pthreads; never held across a call to
  // the daemon.
  std::mutex mu_;
  std::map<uint64_t, Mapping> maps_;  // guarded by mu_
  // Mappings set aside (views made of them may still be read); unmapped by Prune or with this
  // map.
  std::vector<Mapping> retired_;  // guarded by mu_
};

// A handle's inline bytes (include_data) as spans. INVALID_ARGUMENT if they are missing.
absl::StatusOr<ChunkView> InlineView(const v1::BlockHandle& handle);

}  // namespace kvtier

#endif  // KVTIER_CLIENT_H_
