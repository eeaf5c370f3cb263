// One sequence's KV cache: a Stream per (layer, KV head), coordinated. A session checks each
// request (requests.h), plans how appended tokens fall into chunks, and hands the work to its
// parts: the streams store rows and keep their chunk statistics and index (stream.h), the
// aging pipeline regroups, quantizes and indexes what leaves the recent window (aging.h), the
// stream ranker chooses chunks for a query (server/index/stream_ranker.h), promotion makes
// them readable on the requested tier (promotion.h), views fill handles and metadata
// (views.h), and records carry a whole session to the remote tier (session_record.h).
//
// How tokens become chunks is the policy's `chunking`:
//   CHUNKING_CONTIGUOUS  chunk_tokens consecutive tokens;
//   CHUNKING_BOUNDARY    consecutive tokens, a chunk ending after a delimiter token id once it
//                        holds chunk_tokens / 2, and at 2 * chunk_tokens in any case (the
//                        same cuts for every KV head of a layer);
//   CHUNKING_SEMANTIC    contiguous chunks while in the recent window; once a span of
//                        kSemanticSpanChunks of them has left it, each KV head's rows of the
//                        span are regrouped into as many chunks of nearby keys (aging.h).
//
// Thread safety: every public method locks the session's mutex (lock order:
// server/common/lock_order.h).
#ifndef KVTIER_SERVER_SESSION_SESSION_H_
#define KVTIER_SERVER_SESSION_SESSION_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvtier/v1/kvtier.pb.h"
#include "kvtier/v1/record.pb.h"
#include "server/common/clock.h"
#include "server/session/aging.h"
#include "server/session/layer_budget.h"
#include "server/session/lease_table.h"
#include "server/session/promotion.h"
#include "server/session/requests.h"
#include "server/session/selection.h"
#include "server/session/stream.h"
#include "server/session/task_pool.h"
#include "server/tier/promotion_cache.h"
#include "server/tier/staging.h"
#include "server/tier/tier.h"
#include "server/transfer/gpu.h"

namespace kvtier {

// What a session needs from the daemon; all outlive every session.
struct SessionEnv {
  Tier* host = nullptr;  // every chunk's stored bytes
  // The fp16 copies Select makes: dequantized cold chunks on the host, any chunk on the
  // device (over the host and the device tiers).
  PromotionCache* host_copies = nullptr;
  PromotionCache* device_copies = nullptr;
  LeaseTable* leases = nullptr;
  const Clock* clock = nullptr;
  uint32_t lease_ttl_ms = 30'000;
  uint32_t max_lease_ms = 600'000;
  uint32_t max_leases_per_tenant = 4096;
  // Runs aging off the append path; null: each append ages its layer before it returns.
  TaskPool* aging = nullptr;
  // With a pool: the un-aged tokens, summed over layers, past which an append waits for the
  // pool (aging_wait_ms at most, then RESOURCE_EXHAUSTED naming the backlog); 0: no bound.
  uint64_t max_aging_backlog_tokens = 0;
  uint32_t aging_wait_ms = 30'000;
  // Opens a worker's device memory by its CUDA IPC handle (AppendKVRequest.device); null: this
  // daemon runs no GPU, and such an append is FAILED_PRECONDITION.
  DeviceSourceOpener open_device_source;
};

// What a Select guesses the next step's Select of its layer will want beyond its own
// choice: per KV head, the chunks a larger budget would add, to promote ahead
// (Session::Prefetch).
struct PrefetchGuess {
  uint32_t layer = 0;
  bool to_device = false;                     // the Select's placement
  std::vector<std::vector<uint32_t>> chunks;  // [kv_head]: chunk indices, ascending
  bool empty() const {
    for (const auto& c : chunks) {
      if (!c.empty()) return false;
    }
    return true;
  }
};

// Held by a std::shared_ptr wherever aging runs in a pool (SessionManager's), whose tasks hold
// it weakly; a session owned otherwise ages on its append path.
class Session : public std::enable_shared_from_this<Session> {
 public:
  // `shape` and `policy` are resolved (see ResolveShape, ResolvePolicy). The session's
  // metadata is charged to the host tier: `charge`, grown by the caller by at least
  // CreationBytes (it keeps what the caller grew, for the work that follows); none: charged
  // now, unchecked.
  Session(std::string id, std::string tenant, v1::ModelShape shape, v1::SessionPolicy policy,
          std::map<std::string, std::string> labels, const SessionEnv& env,
          MetadataCharge charge = MetadataCharge());

  // The metadata bytes a new session of this shape holds before its first token: what
  // CreateSession checks against the host tier and the tenant's quota before any work.
  static uint64_t CreationBytes(const v1::ModelShape& shape,
                                const std::map<std::string, std::string>& labels,
                                const std::string& id, const std::string& tenant);
  // The metadata one more chunk of this format certainly adds to a stream (its record, its
  // slot's heap, its statistics), checked before the work; what arrays' growth and the index
  // add later is charged as measured once the work is done.
  static uint64_t ChunkBytesEstimate(const ChunkFormat& f);
  // The part of it that is the chunk's record: the entry, its slot's heap, its token count.
  static uint64_t ChunkRecordBytes();
  // The metadata bytes charged for this session now.
  uint64_t metadata_bytes() const;

  const std::string& id() const { return id_; }
  const std::string& tenant() const { return tenant_; }
  // Its live leases (the Selects' on it that have not ended).
  size_t live_leases() const { return leases_->live(); }

  // Stores tokens [start_token, start_token + num_tokens) of one layer, all KV heads.
  // A repeat of stored tokens with the same bytes is a no-op; with other bytes
  // FAILED_PRECONDITION; a start past the stored tokens OUT_OF_RANGE; sizes, layer and
  // counts INVALID_ARGUMENT; a full host tier RESOURCE_EXHAUSTED (ErrorReason kHostTierFull,
  // or kQuota), with nothing stored; a closed session NOT_FOUND; a demoted one UNAVAILABLE
  // (kSessionMoved). Returns the tokens now stored in every layer.
  // A non-finite key or value is INVALID_ARGUMENT naming it, before any other error the
  // request would get past its sizes (the bytes are checked as they are copied into their
  // slots; the error path looks again to name the value).
  // An append may name its bytes in the session's staging area (req.staged()): they are copied
  // from there straight into their slots and checked as bytes sent inline, the same errors
  // word for word (INVALID_ARGUMENT naming `staged`, nothing stored, when a value read as Inf
  // or NaN is finite when looked at again: the worker wrote the area meanwhile).
  // INVALID_ARGUMENT naming the field for bytes sent both ways or a range past the area;
  // NOT_FOUND for an area that is not this session's.
  // With an aging pool (SessionEnv::aging) it returns once the rows are stored in fp16 and the
  // peaks of the chunks they aged out are computed (Select ranks those exactly beside the
  // index), and the pool regroups, quantizes and indexes them; `wait_aged`, or no pool: the
  // layer is aged before it returns. Past max_aging_backlog_tokens an append first waits for
  // the pool, aging_wait_ms at most (RESOURCE_EXHAUSTED naming the backlog).
  absl::StatusOr<uint64_t> Append(const v1::AppendKVRequest& req);

  // Makes `area` this session's staging area, in place of the one it had (which ends with
  // its last holder). NOT_FOUND when closed; UNAVAILABLE when demoted.
  absl::Status SetStaging(std::shared_ptr<StagingArea> area);
  // For an append whose bytes are in the worker's device memory (req->device()): copies them
  // to req->keys and req->values through `sources` (the mappings of the caller's stream) and
  // clears `device`, so that Append checks and stores them as bytes sent inline. Errors name
  // the field: bytes sent two ways, a handle of the wrong size (INVALID_ARGUMENT), a daemon with
  // no GPU (FAILED_PRECONDITION), more bytes than `max_bytes` (the most one message carries,
  // --max_message_size: the host copy is bounded as the bytes it stands for would be;
  // RESOURCE_EXHAUSTED); a handle that cannot be opened or a failed copy, the device's error.
  // No-op without `device`.
  absl::Status Undevice(v1::AppendKVRequest* req, DeviceSources* sources, uint64_t max_bytes) const;

  // The pool's task for layer `l`, queued by an append that left it un-aged tokens: ages them
  // (and what arrives meanwhile), unless another pool thread is ageing that layer already.
  // One task per layer, so that the pool's threads age a session's layers side by side.
  void AgeQueuedLayer(uint32_t l);
  // Tokens appended but not yet aged, summed over layers (0 without a pool), for the metrics:
  // read without the session's lock, from the count every change of a layer's tokens or aged
  // tokens stores (NoteBacklogLocked), so that a scrape never stalls behind a call that holds
  // the session long (a demotion holds it across its Redis write).
  uint64_t aging_backlog_tokens() const;

  // Chooses, per KV head, the sinks, the recent window and the best chunks within the
  // budget; pins them under a lease; fills `out` (cleared first: a caller may pass the same
  // response call after call, as a decode loop does). INVALID_ARGUMENT for the query size, a
  // non-finite query, the layer, the placement, lease_ms, or a budget below the sink and
  // window chunks; RESOURCE_EXHAUSTED when the tier cannot take a promotion, or, with `room`,
  // when the reply's bound (ReplyBytesBound, taken from `room` under the lock the work runs
  // under) does not fit.
  // With `guess`, also the chunks a budget `extra_percent` larger would have chosen, found by
  // the same ranking (a deeper top-k, not a second one), into *guess for Prefetch: those that
  // need a copy made on the Select's placement (not a warm chunk for the host, nor one whose
  // copy is cached there, as PromotionCache::Held sees it), so an empty guess needs nothing.
  absl::Status Select(const v1::SelectRequest& req, v1::SelectResponse* out,
                      ReplyRoom* room = nullptr, PrefetchGuess* guess = nullptr,
                      uint32_t extra_percent = 0);

  // Promotes ahead, onto the placement tier of the Select that made `guess`, its chunks (those
  // that Select chose are cached already), so that the next step's Select finds them; only
  // lookups and copies run under the session's lock. Returns the copies made. A chunk index
  // that aging has renumbered since promotes another chunk, or none (past the end): a guess.
  // NOT_FOUND for a closed session; a full tier is RESOURCE_EXHAUSTED and changes nothing.
  absl::StatusOr<uint64_t> Prefetch(PrefetchGuess guess);

  // An upper bound on the serialized size of Select's reply to `req`, from the layer's tokens,
  // the budget and what the request asks for (data, summaries), computed before any work so
  // that a reply too large to send is refused before it takes a lease or a copy (Select with a
  // room computes it again under the lock of its work: appends grow it). 0 for a layer the
  // session does not have (Select refuses it).
  uint64_t ReplyBytesBound(const v1::SelectRequest& req) const;

  // Handles with data for `chunk_ids`. NOT_FOUND names an id that is not in the session.
  absl::StatusOr<std::vector<v1::BlockHandle>> ReadChunks(const std::vector<uint64_t>& ids);
  // NOT_FOUND as ReadChunks gives it, without reading anything.
  absl::Status CheckChunkIds(const std::vector<uint64_t>& ids) const;

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
  // and later calls on this object get UNAVAILABLE (kSessionMoved: the next lookup restores
  // it). FAILED_PRECONDITION while a lease holds any of its chunks. Returns the record's size.
  absl::StatusOr<uint64_t> Demote(
      const std::function<absl::Status(const v1::SessionRecord&)>& store);
  // The whole session as a record, as it is now (ExportSession); UNAVAILABLE once closed.
  absl::StatusOr<v1::SessionRecord> ExportRecord() const;
  // A session rebuilt from a record (host slots allocated, statistics and index recomputed).
  // RESOURCE_EXHAUSTED when the host tier cannot hold it; INVALID_ARGUMENT for a record
  // whose contents do not fit its shape.
  static absl::StatusOr<std::unique_ptr<Session>> Import(const v1::SessionRecord& record,
                                                         const SessionEnv& env);
  bool demoted() const;
  bool closed() const;
  int64_t last_access_ms() const;

  // Write-behind: the session as a record when it changed (appends, policy) since the last
  // snapshot marked persisted, with the change count it reflects; nullopt when nothing changed
  // or it is closed. Taken under the session's lock, handed over outside it.
  struct Snapshot {
    v1::SessionRecord record;
    uint64_t version = 0;
  };
  std::optional<Snapshot> SnapshotIfChanged() const;
  // The snapshot of `version` is stored: later calls skip it until the session changes.
  void MarkPersisted(uint64_t version);
  // The change count a snapshot taken now would carry.
  uint64_t version() const;
  // Restored from a record another call (or daemon) demoted, or from a snapshot of such a
  // session (SessionRecord.restored): its close leaves a tombstone.
  void MarkRestored() { restored_.store(true, std::memory_order_release); }
  bool restored() const { return restored_.load(std::memory_order_acquire); }

  // Chunk metadata, of one layer or all, at most `limit` entries (`total` counts all). The
  // errors of a closed or moved session (CheckOpen), as Layers'.
  absl::StatusOr<v1::ListChunksResponse> ListChunks(std::optional<uint32_t> layer,
                                                    uint32_t limit) const;

  v1::SessionInfo Info() const;
  absl::StatusOr<std::vector<v1::LayerStats>> Layers() const;

 private:
  // One layer: its tokens, its aging, and Select's work on it.
  struct Layer {
    uint64_t tokens = 0;        // stored in every KV head
    uint64_t aged_tokens = 0;   // tokens when the layer was last aged (AgeLayer)
    bool aging_busy = false;    // a pool thread is ageing it (another leaves it to that one)
    bool aging_queued = false;  // a pool task for it is queued (AgeQueuedLayer)
    // The pool's last run left nothing of the layer waiting (no chunk short of slots, no
    // policy changed since): until a chunk leaves the recent window, an append has nothing
    // for the pool, and marks its tokens aged itself rather than wake a thread for nothing
    // (a decode loop's append of one token a layer moves a chunk out once a chunk's tokens).
    bool aging_settled = false;
    AgingState aging;
    // Select's candidate chunks and how many of them were scored, cumulative.
    uint64_t select_candidates = 0;
    uint64_t select_scored = 0;
  };

  // Where an append's keys and values are: the request's own fields, or (`area` set, holding
  // it) a range of the staging area, which the worker may write while the daemon reads it.
  struct AppendBytes {
    const uint8_t* keys = nullptr;
    const uint8_t* values = nullptr;
    std::shared_ptr<const StagingArea> area;
  };
  // The append's bytes, staged or inline, their range checked against the area (errors as
  // Append's).
  absl::StatusOr<AppendBytes> BytesOf(const v1::AppendKVRequest& req) const;
  // Append past its size checks: stores the rows, checking each value finite as it is copied.
  absl::StatusOr<uint64_t> AppendSized(const v1::AppendKVRequest& req, const AppendBytes& bytes);

  // Fork's shell, made under the parent's lock: no chunks yet.
  Session(const Session& parent, std::string new_id, v1::SessionPolicy policy,
          MetadataCharge charge);
  // The metadata bytes held now: CreationBytes, and Stream::HeapBytes of every stream.
  uint64_t ReplyBound(const v1::SelectRequest& req) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t MeasureMetadata() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::SessionRecord Export() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::span<Stream> heads(uint32_t layer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return std::span<Stream>(streams_).subspan(static_cast<size_t>(layer) * shape_.num_kv_heads(),
                                               shape_.num_kv_heads());
  }
  const Stream& stream(uint32_t layer, uint32_t head) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return streams_[static_cast<size_t>(layer) * shape_.num_kv_heads() + head];
  }
  ChunkFormat format() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return FormatOf(shape_, policy_);
  }
  // Whether the policy refines Selects to rows (a pool of chunks, then their best rows).
  bool refines() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return policy_.refine_factor() > 1 || policy_.mass_target() > 0.f;
  }
  AgingContext aging() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return AgingContext{policy_, format(), host_account_};
  }
  PromotionTarget promotion(uint32_t layer, bool to_device) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return PromotionTarget{to_device ? env_.device_copies : env_.host_copies,
                           to_device,
                           to_device ? device_account_ : host_account_,
                           to_device ? device_copy_bytes_ : host_copy_bytes_,
                           format(),
                           layer};
  }
  uint64_t MinTokens() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t BacklogLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stores BacklogLocked() for aging_backlog_tokens: after every change of a layer's tokens or
  // aged_tokens.
  void NoteBacklogLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Layer `l` aged to its end: its aged_tokens set to its tokens, and the backlog noted.
  void MarkAgedLocked(uint32_t l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stream::HeapBytes over layer `l`'s KV heads: what its metadata charge follows.
  uint64_t LayerHeapBytes(uint32_t l) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The pool's work on layer `l` (marked aging_busy by the caller): semantic spans regrouped
  // and chunks quantized without the lock, peaks and the index under it a slice at a time,
  // until it holds no un-aged tokens.
  void AgeLayerInPool(uint32_t l);
  // Chunks of each KV head that one hold of the lock quantizes or indexes, at most.
  static constexpr uint32_t kAgingSlice = 4;
  // Semantic spans one time without the lock regroups, at most.
  static constexpr uint32_t kAgingSpans = 4;
  // And the time one hold indexes for: the chunk in hand when it passes is the slice's last.
  // (Counted alone, a slice's Adds held the lock for 100 us at the 90th percentile and 300 us
  // at the 99th, when their splits came together. At 50 us, a decode loop's index holds (a
  // chunk of each of three heads every 16 tokens) took 30 us at the median and 59 / 90 us at
  // the 90th / 99th percentiles, and its one-token appends waited up to that for the lock; at
  // 10 us, one or two Adds a hold: 12 / 22 / 70 us.)
  static constexpr absl::Duration kAgingSliceTime = absl::Microseconds(10);
  // Ages layer `l` now (regroup, quantize, index) and settles the metadata charge.
  void AgeLayerLocked(uint32_t l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ages every layer with un-aged tokens now (before a fork copies them).
  void AgeAllLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits, with the lock let go, while the backlog is at its bound. RESOURCE_EXHAUSTED after
  // aging_wait_ms; the session's own errors if it closed meanwhile.
  absl::Status WaitForBacklog() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckOpen() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What a closed session lets go of: taken under its lock (EndLocked), freed after it, so
  // that the slots go back to their tiers outside the session's lock.
  struct Holdings {
    std::vector<Stream> streams;
    GatherPool host_gathers, device_gathers;
    std::shared_ptr<StagingArea> staging;
  };
  // Marks the session closed (appends waiting on the backlog see it) and takes what it holds;
  // its metadata charge goes back at once. Close and Demote.
  Holdings EndLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckChunkId(uint64_t id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Per KV head, the chunks of `layer` a query chooses within `budget`: sinks, window, then
  // the best by the ranking (counted in the layer's stats when `record`) holding
  // `pool_factor` times the budget they leave (1: the selection itself; more: the candidate
  // pool that token-level refinement narrows). With LAYER_BUDGET_BY_NEED the budget is the
  // layers' average and the rows it leaves follow the layer's share (LayerNeeds).
  // INVALID_ARGUMENT when the sinks and the window do not fit the budget.
  // With extra_budget, LayerChoice::extra holds what that many more tokens of budget would
  // add (under refinement: to the pool).
  absl::StatusOr<LayerChoice> Choose(uint32_t layer, std::span<const float> q, uint64_t budget,
                                     uint32_t pool_factor, bool record, uint64_t extra_budget = 0)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string id_;
  const std::string tenant_;
  // The tenant's count of live leases (null without a lease table): Select checks
  // max_leases_per_tenant against it without a lock.
  const std::shared_ptr<LeaseTable::TenantLeases> tenant_leases_;
  // This session's live leases (its own count: a later session of its id has another).
  const std::shared_ptr<LeaseTable::SessionLeases> leases_ =
      std::make_shared<LeaseTable::SessionLeases>();
  const v1::ModelShape shape_;
  const std::map<std::string, std::string> labels_;
  const SessionEnv env_;
  // The tenant's accounts on the host tier and on the device copies' tier (null without one),
  // on the shards this session's id picks: every slot of the session's comes through them.
  const TierAccount host_account_;
  const TierAccount device_account_;
  // The bytes of the copies this session's promotions made, while cached (Info's).
  const std::shared_ptr<CopyTally> host_copy_bytes_ = std::make_shared<CopyTally>();
  const std::shared_ptr<CopyTally> device_copy_bytes_ = std::make_shared<CopyTally>();
  int64_t created_ms_;      // set once, before the session is shared (Import restores it)
  mutable absl::Mutex mu_;  // lock order 3 (server/common/lock_order.h)
  // Appends, Selects and ReadChunks waiting for mu_ (ForegroundLock): aging lets them in first.
  mutable std::atomic<int> foreground_ = 0;
  v1::SessionPolicy policy_ ABSL_GUARDED_BY(mu_);
  // Set under mu_, read without it too (demoted(), closed(): a stream's cached session is
  // checked on every message, and must not wait for aging holding mu_).
  std::atomic<bool> closed_ = false;
  uint64_t version_ ABSL_GUARDED_BY(mu_) = 1;    // counts changes a snapshot would show
  uint64_t persisted_ ABSL_GUARDED_BY(mu_) = 0;  // the version last stored by write-behind
  std::atomic<bool> demoted_ = false;   // closed because it moved to the remote tier (as closed_)
  std::atomic<bool> restored_ = false;  // MarkRestored
  // BacklogLocked() as of the last change of a layer's tokens or aged_tokens (a session made
  // by a fork or an import starts with every layer aged: 0).
  std::atomic<uint64_t> backlog_ = 0;
  int64_t last_access_ms_ ABSL_GUARDED_BY(mu_);
  std::vector<Layer> layers_ ABSL_GUARDED_BY(mu_);    // [num_layers]
  LayerNeeds needs_ ABSL_GUARDED_BY(mu_);             // LAYER_BUDGET_BY_NEED
  std::vector<Stream> streams_ ABSL_GUARDED_BY(mu_);  // [num_layers * num_kv_heads]
  // Gathered blocks' slots kept for the next Select, on the host tier and the device tier.
  GatherPool host_gathers_ ABSL_GUARDED_BY(mu_), device_gathers_ ABSL_GUARDED_BY(mu_);
  // The metadata's charge on the host tier: grown by an estimate before each change, set to
  // the measured bytes after it; nothing once closed.
  MetadataCharge charge_ ABSL_GUARDED_BY(mu_);
  // OpenStaging's area, or none: under a lock of its own, so that an append naming it does not
  // wait for aging's hold of mu_ twice.
  mutable absl::Mutex staging_mu_;  // lock order 18 (server/common/lock_order.h)
  std::shared_ptr<StagingArea> staging_ ABSL_GUARDED_BY(staging_mu_);
  absl::CondVar aged_;  // a layer was aged, or the session closed (appends waiting on backlog)
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_SESSION_H_
