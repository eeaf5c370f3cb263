// One sequence's KV cache: per (layer, KV head) stream, a list of chunks, each chunk's K and
// V in one slot of the host tier. How tokens become chunks is the policy's `chunking`:
//   CHUNKING_CONTIGUOUS  chunk_tokens consecutive tokens;
//   CHUNKING_BOUNDARY    consecutive tokens, a chunk ending after a delimiter token id once it
//                        holds chunk_tokens / 2, and at 2 * chunk_tokens in any case (the
//                        same cuts for every KV head of a layer);
//   CHUNKING_SEMANTIC    contiguous chunks while in the recent window; once a span of
//                        kSemanticSpanChunks of them has left it, each KV head's rows of the
//                        span are regrouped by balanced k-means into as many chunks of nearby
//                        keys, each row keeping its position (Chunk::offsets).
// Chunks of a stream are ordered by `first`, their first position (a regrouped span's chunks
// share the span's first position).
//
// Slot layout (what a BlockHandle points at), for a chunk of n tokens, head_dim d, and the
// session's 2-byte dtype:
//
//   offset 0            n*d*2            2*n*d*2        slot end (chunk_tokens*d*4)
//   +-------------------+----------------+---------------+
//   | K [n][d]          | V [n][d]       | unused        |
//   +-------------------+----------------+---------------+
//
// V starts right after the chunk's n key rows, so a partial chunk is still one contiguous
// K-then-V run. Growing a partial chunk moves its V rows; that happens in place only when
// nobody else holds the slot (no lease, no fork), and then the slot takes a new generation.
// Otherwise the chunk is copied to a fresh slot (copy on write).
//
// Thread safety: every public method locks the session's mutex. Lock order:
// SessionManager::mu_ -> Session::mu_ -> LeaseTable::mu_ -> Tier::mu_.
#ifndef KVTIER_SERVER_SESSION_SESSION_H_
#define KVTIER_SERVER_SESSION_SESSION_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvtier/v1/kvtier.pb.h"
#include "kvtier/v1/record.pb.h"
#include "kernels/quant_layout.h"
#include "server/common/clock.h"
#include "server/common/vec.h"
#include "server/index/cluster_index.h"
#include "server/session/lease_table.h"
#include "server/tier/promotion_cache.h"
#include "server/tier/tier.h"

namespace kvtier {

// What a session needs from the daemon; all outlive every session.
struct SessionEnv {
  Tier* host = nullptr;
  Tier* device = nullptr;
  // The fp16 copies Select makes: dequantized cold chunks on the host, any chunk on the
  // device. Over `host` and `device` respectively.
  PromotionCache* host_copies = nullptr;
  PromotionCache* device_copies = nullptr;
  LeaseTable* leases = nullptr;
  const Clock* clock = nullptr;
  // The remote tier (Redis), or null. The session manager demotes idle sessions to it.
  class RemoteStore* remote = nullptr;
  uint32_t lease_ttl_ms = 30'000;
  uint32_t max_lease_ms = 600'000;
};

// Semantic chunking regroups spans of this many aged-out chunks.
inline constexpr uint32_t kSemanticSpanChunks = 8;

// chunk_id = layer << 40 | kv_head << 28 | index: ReadChunks decodes it without a map.
struct ChunkAddress {
  uint32_t layer;
  uint32_t kv_head;
  uint32_t index;
};
uint64_t EncodeChunkId(const ChunkAddress& a);
ChunkAddress DecodeChunkId(uint64_t id);

// Checks a ModelShape and fills its defaults (dtype fp16). INVALID_ARGUMENT names the field.
absl::StatusOr<v1::ModelShape> ResolveShape(const v1::ModelShape& shape);

class Session {
 public:
  // `shape` and `policy` are resolved (see ResolveShape, ResolvePolicy).
  Session(std::string id, std::string tenant, v1::ModelShape shape, v1::SessionPolicy policy,
          std::map<std::string, std::string> labels, const SessionEnv& env);

  const std::string& id() const { return id_; }
  const std::string& tenant() const { return tenant_; }

  // Stores tokens [start_token, start_token + num_tokens) of one layer, all KV heads.
  // A repeat of stored tokens with the same bytes is a no-op; with other bytes
  // FAILED_PRECONDITION; a start past the stored tokens OUT_OF_RANGE; sizes, layer and
  // counts INVALID_ARGUMENT; a full host tier RESOURCE_EXHAUSTED, with nothing stored;
  // a closed session NOT_FOUND. Returns the tokens now stored in every layer.
  absl::StatusOr<uint64_t> Append(const v1::AppendKVRequest& req);

  // Chooses, per KV head, the sinks, the recent window and the best chunks within the
  // budget; pins them under a lease; fills `out`. INVALID_ARGUMENT for the query size, a
  // non-finite query, the layer, the placement, lease_ms, or a budget below the sink and
  // window chunks; RESOURCE_EXHAUSTED when the device tier cannot take a promotion.
  absl::Status Select(const v1::SelectRequest& req, v1::SelectResponse* out);

  // Promotes ahead, onto the request's placement tier, the chunks that `req` would choose
  // with a budget `extra_percent` larger (those it chose are cached already), so that the
  // next step's Select finds them. Returns the copies made. Errors as Select's; a full tier
  // is RESOURCE_EXHAUSTED and changes nothing.
  absl::StatusOr<uint64_t> Prefetch(const v1::SelectRequest& req, uint32_t extra_percent);

  // Handles with data for `chunk_ids`. NOT_FOUND names an id that is not in the session.
  absl::StatusOr<std::vector<v1::BlockHandle>> ReadChunks(const std::vector<uint64_t>& ids);

  // A new session sharing this one's chunks up to `num_tokens` (0: all tokens stored in
  // every layer). INVALID_ARGUMENT when a layer holds fewer; RESOURCE_EXHAUSTED when the
  // straddling chunks cannot be copied.
  absl::StatusOr<std::unique_ptr<Session>> Fork(std::string new_id, uint64_t num_tokens);

  // Drops promoted copies from the device tier. Returns the bytes released.
  // FAILED_PRECONDITION for the host tier (no remote tier below it), INVALID_ARGUMENT else.
  absl::StatusOr<uint64_t> Evict(v1::Tier tier);

  // Applies the non-zero fields of `policy`. FAILED_PRECONDITION when chunk_tokens or
  // chunking would change under stored tokens.
  absl::StatusOr<v1::SessionPolicy> SetPolicy(const v1::SessionPolicy& policy);

  // Frees every chunk not held by a lease or a fork; later calls get NOT_FOUND.
  void Close();

  // Remote tier. Demote: the whole session as a record, handed to `store` (which puts it in
  // Redis) under the session's lock, so no append is lost; once stored, the session closes
  // and later calls on this object get UNAVAILABLE (retry: the next lookup restores it).
  // FAILED_PRECONDITION while a lease holds any of its chunks. Returns the record's size.
  absl::StatusOr<uint64_t> Demote(const std::function<absl::Status(const v1::SessionRecord&)>& store);
  // A session rebuilt from a record (host slots allocated, statistics and index recomputed).
  // RESOURCE_EXHAUSTED when the host tier cannot hold it; INVALID_ARGUMENT for a record
  // whose contents do not fit its shape.
  static absl::StatusOr<std::unique_ptr<Session>> Import(const v1::SessionRecord& record,
                                                         const SessionEnv& env);
  bool demoted() const;
  int64_t last_access_ms() const;

  // Chunk metadata, of one layer or all, at most `limit` entries (`total` counts all).
  v1::ListChunksResponse ListChunks(std::optional<uint32_t> layer, uint32_t limit) const;

  v1::SessionInfo Info() const;
  std::vector<v1::LayerStats> Layers() const;

 private:
  struct Chunk {
    uint32_t num_tokens = 0;
    uint64_t first = 0;  // position of row 0; of the span for a regrouped chunk
    // A regrouped chunk's row positions, first + offsets[r], ascending; empty: contiguous
    std::vector<uint16_t> offsets;
    bool sealed = false;  // takes no more rows
    // How `host` holds the chunk: fp16/bf16 (the ChunkLayout) or int4/int8 (QuantLayout).
    v1::Precision precision = v1::PRECISION_FP16;
    SlotRef host;      // the stored bytes
    CopyRef promoted;  // a cold chunk dequantized to fp16 on the host tier, or null
    CopyRef device;    // an fp16 copy on the device tier, or null; dropped when the chunk changes
    bool cold() const {
      return precision == v1::PRECISION_INT4 || precision == v1::PRECISION_INT8;
    }
    uint64_t position(uint32_t r) const { return first + (offsets.empty() ? r : offsets[r]); }
    uint64_t end() const { return position(num_tokens - 1) + 1; }  // past the last row
  };
  // One (layer, KV head). The key sums sit in one contiguous array so a Select scans them
  // linearly. (Value means, for summaries only, are computed when asked for.)
  struct Stream {
    std::vector<Chunk> chunks;
    std::vector<float> key_sums;  // [chunks][head_dim]: sum of each chunk's keys
    // [chunks][head_dim]: each chunk's key farthest from its mean (RANKING_LSE_PEAK), as
    // attention reads it (dequantized for a cold chunk); set once the chunk leaves the window
    std::vector<float> peaks;
    // The chunks that left the recent window (sinks excepted), once their statistics are
    // final (after quantization); null until the first one.
    std::unique_ptr<ClusterIndex> index;
    ChunkArrays arrays() const { return {key_sums.data(), peaks.data()}; }
  };

  Session(const Session& parent, std::string new_id);  // Fork's shell: no chunks yet
  v1::SessionRecord Export() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Stream& stream(uint32_t layer, uint32_t head) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return streams_[static_cast<size_t>(layer) * shape_.num_kv_heads() + head];
  }
  const Stream& stream(uint32_t layer, uint32_t head) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return streams_[static_cast<size_t>(layer) * shape_.num_kv_heads() + head];
  }
  uint64_t row_bytes() const { return static_cast<uint64_t>(shape_.head_dim()) * 2; }
  // The most rows a chunk may hold: 2 * chunk_tokens for boundary chunking, else chunk_tokens.
  uint32_t chunk_capacity() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return policy_.chunk_tokens() * (policy_.chunking() == v1::CHUNKING_BOUNDARY ? 2 : 1);
  }
  uint64_t slot_bytes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return row_bytes() * chunk_capacity() * 2;
  }
  // Whether a chunk of `rows` rows whose last token has id `*id` (null: none given) ends.
  bool Seals(uint32_t rows, const int32_t* id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The chunk and row of stream `s` that hold position `t` (stored).
  std::pair<uint32_t, uint32_t> Locate(const Stream& s, uint64_t t) const;
  // The chunks [0, n) of `layer` whose rows are final: aged out, and regrouped when semantic.
  uint32_t FinalChunks(uint32_t layer) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Semantic chunking: regroups every whole span of aged-out chunks not yet regrouped. A span
  // whose slots cannot be had waits for the next append.
  void RegroupSpans(uint32_t layer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t MinTokens() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A Select's checks that need no lock; returns the query as floats.
  absl::StatusOr<std::vector<float>> CheckSelect(const v1::SelectRequest& req) const;
  // Per KV head, the chunks of `layer` a query chooses within `budget`: sinks, window, then
  // the best by the ranking (counted in the layer's stats when `record`). Returns whether the
  // whole layer was chosen (dense, or it fits).
  absl::StatusOr<bool> Choose(uint32_t layer, std::span<const float> q, uint64_t budget,
                              bool record, std::vector<std::vector<uint32_t>>* chosen)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static constexpr uint32_t kNoLayer = ~0u;
  // The best candidates (not `mandatory`) of one stream within `budget` tokens, as
  // SelectChunks ranks them, through the stream's cluster index; counts the work per layer
  // (none for kNoLayer).
  std::vector<uint32_t> RankCandidates(const Stream& s, std::span<const float> qh,
                                       uint32_t group, const std::vector<bool>& mandatory,
                                       uint64_t budget, uint32_t layer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The chunks [0, n) of `layer` that lie wholly before the recent window (and are sealed).
  uint32_t AgedOutChunks(uint32_t layer) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds to each head's cluster index the chunks of `layer` that left the recent window and
  // whose statistics are final (quantized when the policy quantizes).
  void IndexAgedOut(uint32_t layer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Recomputes chunk `index`'s peak from its n key rows (session dtype), after its sum.
  void UpdatePeak(Stream& s, size_t index, const uint8_t* k_rows, uint32_t n) const;
  absl::Status CheckOpen() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CompareStored(uint32_t layer, uint64_t start, uint64_t count,
                             const v1::AppendKVRequest& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds `rows` key rows into the key sum of chunk `index` (grown as needed).
  void AddToSums(Stream& s, size_t index, const uint8_t* k_rows, uint32_t rows) const;
  // Bits of cold chunks under the current policy: 4, 8, or 0 (keep fp16).
  uint32_t cold_bits() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Quantizes the chunks of `layer` that have wholly left the recent window (sinks stay
  // fp16). A chunk whose slot cannot be had stays fp16 and is retried on the next append.
  void QuantizeCold(uint32_t layer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The fp16-readable slot of each chunk of `chosen` ([kv_head] -> chunk indices of `layer`)
  // on the device (`to_device`) or the host, promoting the chunks that have none: all or
  // nothing (RESOURCE_EXHAUSTED when the cache cannot make room). `prefetch` marks the new
  // copies as promoted ahead; `promoted`, when given, receives how many were made.
  absl::StatusOr<std::vector<std::vector<SlotRef>>> Readable(
      uint32_t layer, const std::vector<std::vector<uint32_t>>& chosen, bool to_device,
      bool prefetch, size_t* promoted = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  PromotionCache* copies(bool to_device) const {
    return to_device ? env_.device_copies : env_.host_copies;
  }

  // The layout of a cold chunk's bytes.
  QuantLayout ColdLayout(const Chunk& c) const {
    return QuantLayout{shape_.head_dim(), c.num_tokens,
                       c.precision == v1::PRECISION_INT4 ? 4u : 8u};
  }
  // The bytes a chunk's host slot holds: K then V rows, or the quantized layout of a cold one.
  uint64_t StoredBytes(const Chunk& c) const {
    return c.cold() ? ColdLayout(c).Bytes() : 2 * c.num_tokens * row_bytes();
  }
  // Writes a chunk's K then V as 2-byte rows (ChunkLayout) at `dst`, dequantizing a cold one.
  void WriteFp16(const Chunk& c, uint8_t* dst) const;
  // The K and V of a chunk as fp16 rows, dequantizing a cold one into `scratch`.
  const uint16_t* Fp16Rows(const Chunk& c, std::vector<uint16_t>& scratch) const;
  HalfKind half_kind() const {
    return shape_.dtype() == v1::DTYPE_BF16 ? HalfKind::kBf16 : HalfKind::kFp16;
  }
  // A handle for chunk `c` read at `slot` (null: inline only, segment_id 0), with `fp16`
  // (its K then V rows) inline when `include_data`.
  void FillHandle(const Chunk& c, const Slot* slot, const uint8_t* fp16, uint64_t chunk_id,
                  bool include_data, v1::BlockHandle* h) const;

  const std::string id_;
  const std::string tenant_;
  const v1::ModelShape shape_;
  const std::map<std::string, std::string> labels_;
  const SessionEnv env_;
  int64_t created_ms_;  // set once, before the session is shared (Import restores it)
  mutable absl::Mutex mu_;
  v1::SessionPolicy policy_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool demoted_ ABSL_GUARDED_BY(mu_) = false;  // closed because it moved to the remote tier
  int64_t last_access_ms_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> layer_tokens_ ABSL_GUARDED_BY(mu_);  // [num_layers]
  std::vector<Stream> streams_ ABSL_GUARDED_BY(mu_);         // [num_layers * num_kv_heads]
  std::vector<uint32_t> cold_upto_ ABSL_GUARDED_BY(mu_);     // [num_layers]: chunks examined
  std::vector<uint32_t> indexed_upto_ ABSL_GUARDED_BY(mu_);  // [num_layers]: chunks examined
  std::vector<uint32_t> peaked_upto_ ABSL_GUARDED_BY(mu_);   // [num_layers]: chunks with peaks
  std::vector<uint32_t> regrouped_upto_ ABSL_GUARDED_BY(mu_);  // [num_layers]: semantic spans
  // [num_layers]: Select's candidate chunks and how many of them were scored, cumulative
  std::vector<uint64_t> select_candidates_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> select_scored_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_SESSION_H_
