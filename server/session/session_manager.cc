#include "server/session/session_manager.h"

#include <unistd.h>

#include "absl/cleanup/cleanup.h"
#include "absl/hash/hash.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "server/common/error.h"
#include "server/common/log.h"
#include "server/common/mutex.h"
#include "server/common/names.h"
#include "server/common/status_macros.h"
#include "server/config/policy.h"
#include "server/config/shape.h"
#include "server/session/session_record.h"

namespace kvtier {

namespace {

std::string Hostname() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0) return "localhost";
  return name;
}

}  // namespace

SessionManager::SessionManager(const ServerOptions& options, const SessionEnv& env,
                               RemoteStore* remote)
    : options_(options),
      env_(env),
      remote_(remote),
      self_(absl::StrCat(options.instance, "@", Hostname())),
      snapshot_prefix_(absl::StrCat("kvtier:snapshot:", self_, ":")) {
  if (remote_ != nullptr) records_.emplace(remote_, self_);
}

SessionManager::~SessionManager() { CloseAll(); }

namespace {

bool IsSessionId(const std::string& id) { return IsName(id, "_.:-", 128); }

absl::Status CheckLabels(const google::protobuf::Map<std::string, std::string>& labels) {
  if (labels.size() > static_cast<size_t>(kMaxLabels)) {
    return InvalidField("labels",
                        absl::StrFormat("%d labels; at most %d", labels.size(), kMaxLabels));
  }
  for (const auto& [key, value] : labels) {
    if (key.empty() || key.size() > kMaxLabelKey) {
      return InvalidField("labels",
                          absl::StrFormat("key %s is not 1..%d bytes", Quoted(key), kMaxLabelKey));
    }
    if (value.size() > kMaxLabelValue) {
      return InvalidField("labels", absl::StrFormat("value of %s is %d bytes; at most %d",
                                                    Quoted(key), value.size(), kMaxLabelValue));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckIdFormat(const std::string& id) {
  if (IsSessionId(id)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("session_id: ", Quoted(id), " must be 1..128 of [A-Za-z0-9_.:-]"));
}

}  // namespace

absl::Status SessionManager::CheckNewId(const std::string& id, const std::string& tenant) const {
  RETURN_IF_ERROR(CheckIdFormat(id));
  // One on its way in from the remote tier counts too: its restore would put it over this one.
  if (sessions_.Find(id) != nullptr || restoring_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("session_id: \"", id, "\" already exists"));
  }
  return CheckRoom(id, tenant);
}

// A restore's, a close's or a demotion's hold on one id (gated_), which waits while another
// call holds it.
// Taken with no lock held: its holder does Redis I/O and may demote other sessions.
class SessionManager::IdGate {
 public:
  IdGate(SessionManager* m, const std::string& id) : m_(m), id_(id) {
    MutexLock lock(&m_->mu_);
    while (m_->gated_.contains(id_)) WaitOn(&m_->gate_cv_, &m_->mu_);
    m_->gated_.insert(id_);
  }
  ~IdGate() {
    {
      MutexLock lock(&m_->mu_);
      m_->gated_.erase(id_);
    }
    m_->gate_cv_.SignalAll();
  }
  IdGate(const IdGate&) = delete;
  IdGate& operator=(const IdGate&) = delete;

 private:
  SessionManager* const m_;
  const std::string id_;
};

absl::Status SessionManager::CheckRoom(const std::string& id, const std::string& tenant) const {
  // Each restore on its way in holds its place; a session on its way out (demoted, its
  // demotion not yet past the map) holds none: its restore may be the call asking. Counted
  // one by one only when the map's size alone says no room.
  if (sessions_.size() + restoring_.size() >= options_.max_sessions) {
    size_t held = restoring_.size();
    for (const std::shared_ptr<Session>& s : sessions_.All()) held += !s->demoted();
    if (held >= options_.max_sessions) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("session_id: \"%s\": the daemon holds max_sessions %d sessions", id,
                          options_.max_sessions));
    }
  }
  if (const uint32_t quota = options_.QuotaFor(tenant).max_sessions; quota != 0) {
    size_t held = 0;
    for (const auto& [id, of] : restoring_) held += of == tenant;
    for (const std::shared_ptr<Session>& s : sessions_.All()) {
      held += s->tenant() == tenant && !s->demoted();
    }
    if (held >= quota) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "quota: tenant \"%s\" max_sessions %d reached (session_id \"%s\")", tenant, quota, id));
    }
  }
  return absl::OkStatus();
}

std::string SessionManager::NewId() {
  static thread_local absl::BitGen gen;
  return absl::StrFormat("s-%d-%08x", next_id_++, absl::Uniform<uint32_t>(gen));
}

absl::StatusOr<v1::CreateSessionResponse> SessionManager::Create(
    const std::string& tenant, const v1::CreateSessionRequest& req) {
  ASSIGN_OR_RETURN(v1::ModelShape shape, ResolveShape(req.shape()));
  ASSIGN_OR_RETURN(v1::SessionPolicy policy,
                   ResolvePolicy(req.policy(), options_.default_policy, "policy"));
  // Cold chunks are quantized from fp16 (scales and zeros are fp16); a bf16 session keeps
  // its chunks as they came, and says so in the effective policy.
  if (shape.dtype() == v1::DTYPE_BF16) policy.set_lossless(true);
  std::string id;
  {
    MutexLock lock(&mu_);
    id = req.session_id().empty() ? NewId() : req.session_id();
  }
  RETURN_IF_ERROR(CheckIdFormat(id));  // before the id goes anywhere, the remote tier included
  RETURN_IF_ERROR(CheckLabels(req.labels()));
  // The id is claimed in the remote tier first: a session lying there keeps its id, and so
  // does one another daemon on that Redis holds.
  ASSIGN_OR_RETURN(const bool claimed, ClaimId(id));
  if (persisting()) {
    absl::StatusOr<bool> snapshot = remote_->Exists(SnapshotKey(id));
    if (snapshot.ok() && *snapshot) {
      if (claimed) ReleaseClaim(id);
      return absl::AlreadyExistsError(absl::StrCat(
          "session_id: ", Quoted(id), " already exists (this daemon's last snapshot)"));
    }
  }
  // The session's metadata is charged to the host tier and the tenant's quota before it is made.
  std::map<std::string, std::string> labels(req.labels().begin(), req.labels().end());
  MetadataCharge charge(env_.host->Account(tenant));
  absl::Status fits =
      WithRoom(id, [&] { return charge.Grow(Session::CreationBytes(shape, labels, id, tenant)); });
  if (fits.ok()) {
    MutexLock lock(&mu_);
    fits = CheckNewId(id, tenant);
    if (fits.ok()) {
      sessions_.Put(id, std::make_shared<Session>(id, tenant, shape, policy, std::move(labels),
                                                  env_, std::move(charge)));
    }
  }
  if (!fits.ok()) {
    if (claimed) ReleaseClaim(id);  // outside the map lock: Redis I/O
    return fits;
  }
  KVLOG(info, "session.create", "session={} tenant={} layers={} kv_heads={} head_dim={}", id,
        LogValue(tenant), shape.num_layers(), shape.num_kv_heads(), shape.head_dim());
  v1::CreateSessionResponse resp;
  resp.set_session_id(id);
  *resp.mutable_policy() = policy;
  return resp;
}

namespace {

absl::Status NotFound(const std::string& session_id) {
  return absl::NotFoundError(absl::StrCat("session_id: ", Quoted(session_id), " not found"));
}

// PERMISSION_DENIED unless `tenant` (empty: the admin view) may use a session of `owner`.
absl::Status CheckTenant(const std::string& tenant, const std::string& owner,
                         const std::string& session_id) {
  if (tenant.empty() || owner == tenant) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("session_id: \"", session_id, "\" belongs to another tenant"));
}

}  // namespace

SessionShards::Shard& SessionShards::ShardOf(const std::string& id) const {
  return shards_[absl::HashOf(id) % kShards];
}

std::shared_ptr<Session> SessionShards::Find(const std::string& id) const {
  const Shard& shard = ShardOf(id);
  MutexLock lock(&shard.mu);
  auto it = shard.sessions.find(id);
  return it != shard.sessions.end() ? it->second : nullptr;
}

void SessionShards::Put(const std::string& id, std::shared_ptr<Session> session) {
  Shard& shard = ShardOf(id);
  MutexLock lock(&shard.mu);
  auto [it, added] = shard.sessions.insert_or_assign(id, std::move(session));
  if (added) size_.fetch_add(1, std::memory_order_acq_rel);
}

std::shared_ptr<Session> SessionShards::Remove(const std::string& id, const Session* only) {
  Shard& shard = ShardOf(id);
  MutexLock lock(&shard.mu);
  auto it = shard.sessions.find(id);
  if (it == shard.sessions.end() || (only != nullptr && it->second.get() != only)) return nullptr;
  std::shared_ptr<Session> s = std::move(it->second);
  shard.sessions.erase(it);
  size_.fetch_sub(1, std::memory_order_acq_rel);
  return s;
}

std::vector<std::shared_ptr<Session>> SessionShards::All() const {
  std::vector<std::shared_ptr<Session>> out;
  out.reserve(size());
  for (const Shard& shard : shards_) {
    MutexLock lock(&shard.mu);
    for (const auto& [id, s] : shard.sessions) out.push_back(s);
  }
  return out;
}

std::vector<std::pair<std::string, std::shared_ptr<Session>>> SessionShards::TakeAll() {
  std::vector<std::pair<std::string, std::shared_ptr<Session>>> out;
  for (Shard& shard : shards_) {
    MutexLock lock(&shard.mu);
    for (auto& [id, s] : shard.sessions) out.emplace_back(id, std::move(s));
    size_.fetch_sub(shard.sessions.size(), std::memory_order_acq_rel);
    shard.sessions.clear();
  }
  return out;
}

std::shared_ptr<Session> SessionManager::Held(const std::string& session_id) const {
  std::shared_ptr<Session> s = sessions_.Find(session_id);
  return s != nullptr && !s->demoted() ? s : nullptr;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Get(const std::string& tenant,
                                                             const std::string& session_id) {
  std::shared_ptr<Session> s = Held(session_id);
  if (s == nullptr) {
    // No session has an id outside the format: nothing to look up, here or remotely.
    if (remote_ != nullptr && IsSessionId(session_id)) return Restore(tenant, session_id);
    return NotFound(session_id);
  }
  RETURN_IF_ERROR(CheckTenant(tenant, s->tenant(), session_id));
  return s;
}

absl::Status SessionManager::WithRoom(const std::string& keep,
                                      const std::function<absl::Status()>& fn) {
  for (;;) {
    absl::Status s = fn();
    if (ReasonOf(s) != ErrorReason::kHostTierFull || !DemoteIdle(keep)) return s;
  }
}

absl::Status SessionManager::Run(
    const std::string& tenant, const std::string& session_id,
    const std::function<absl::Status(const std::shared_ptr<Session>&)>& fn,
    std::shared_ptr<Session>* cached) {
  for (int attempt = 0;; ++attempt) {
    std::shared_ptr<Session> session;
    if (attempt == 0 && cached != nullptr && *cached != nullptr && (*cached)->id() == session_id &&
        !(*cached)->demoted()) {
      session = *cached;  // looked up, tenant checked, by an earlier message of this stream
    } else {
      ASSIGN_OR_RETURN(session, Get(tenant, session_id));
      if (cached != nullptr) *cached = session;
    }
    absl::Status s = WithRoom(session_id, [&] { return fn(session); });
    // Moved to the remote tier while this call waited: the next Get restores it.
    if (ReasonOf(s) != ErrorReason::kSessionMoved || attempt >= 16) return s;
  }
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Take(const std::string& tenant,
                                                              const std::string& session_id) {
  MutexLock lock(&mu_);
  std::shared_ptr<Session> s = sessions_.Find(session_id);
  if (s == nullptr) return nullptr;
  RETURN_IF_ERROR(CheckTenant(tenant, s->tenant(), session_id));
  return sessions_.Remove(session_id, s.get());
}

absl::StatusOr<bool> SessionManager::Close(const std::string& tenant,
                                           const std::string& session_id) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Take(tenant, session_id));
  if (s == nullptr && remote_ != nullptr) {
    IdGate gate(this, session_id);                  // no restore brings it here meanwhile
    ASSIGN_OR_RETURN(s, Take(tenant, session_id));  // restored while this call waited
    if (s == nullptr) {
      // A demoted session is closed where it lies; one another daemon holds is not ours.
      absl::StatusOr<std::optional<std::string>> bytes = records_->Get(session_id);
      if (bytes.status().code() == absl::StatusCode::kNotFound) return false;
      // A record that is not whole (a part lost: DATA_LOSS) is closed as one that fails its
      // checks is: it has no tenant to ask.
      if (!bytes.ok() && !absl::IsDataLoss(bytes.status())) return bytes.status();
      if (bytes.ok() && !*bytes) return false;
      auto record = bytes.ok() ? DecodeRecord(**bytes, RecordKey(session_id)) : bytes.status();
      if (record.ok()) RETURN_IF_ERROR(CheckTenant(tenant, record->tenant(), session_id));
      {
        MutexLock lock(&mu_);
        demoted_here_.erase(session_id);
      }
      return records_->Drop(session_id);
    }
  }
  if (s == nullptr) return false;
  s->Close();  // outside the manager lock: frees slots
  if (s->demoted()) {
    // A demotion that held the session as this close took it stored its record (Close waited
    // for it): the close removes that record too, as a demoted session's close does.
    if (auto dropped = records_->Drop(session_id); !dropped.ok()) {
      KVLOG(warn, "remote.drop", "session={} error={}", session_id,
            LogValue(dropped.status().message()));
    }
  } else {
    // A session restored from a record may be looked for by the daemon that demoted it: the
    // tombstone tells it the session was closed, not lost.
    ReleaseClaim(session_id, s->restored());
  }
  DropSnapshot(session_id);
  KVLOG(info, "session.close", "session={}", session_id);
  return true;
}

absl::StatusOr<v1::CreateSessionResponse> SessionManager::Fork(const std::string& tenant,
                                                               const v1::ForkSessionRequest& req) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> parent, Get(tenant, req.session_id()));
  std::string id;
  {
    MutexLock lock(&mu_);
    id = req.new_session_id().empty() ? NewId() : req.new_session_id();
    absl::Status s = CheckNewId(id, tenant);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("new_", s.message()));
    }
  }
  absl::StatusOr<bool> claimed = ClaimId(id);
  if (!claimed.ok()) {
    return absl::Status(claimed.status().code(), absl::StrCat("new_", claimed.status().message()));
  }
  absl::StatusOr<std::unique_ptr<Session>> child = parent->Fork(id, req.num_tokens());
  absl::Status fits = child.status();
  v1::CreateSessionResponse resp;
  if (child.ok()) {
    resp.set_session_id(id);
    *resp.mutable_policy() = (*child)->Info().policy();
    MutexLock lock(&mu_);
    fits = CheckNewId(id, tenant);  // taken meanwhile?
    if (fits.ok()) sessions_.Put(id, *std::move(child));
  }
  if (!fits.ok()) {
    if (*claimed) ReleaseClaim(id);
    return fits;
  }
  KVLOG(info, "session.fork", "session={} parent={} tokens={}", id, req.session_id(),
        req.num_tokens());
  return resp;
}

absl::StatusOr<v1::SessionRecord> SessionManager::Export(const std::string& tenant,
                                                         const std::string& session_id) {
  v1::SessionRecord record;
  RETURN_IF_ERROR(Run(tenant, session_id, [&](const std::shared_ptr<Session>& s) {
    ASSIGN_OR_RETURN(record, s->ExportRecord());
    return absl::OkStatus();
  }));
  return record;
}

absl::Status SessionManager::CheckNewSessionId(const std::string& tenant,
                                               const std::string& session_id) const {
  MutexLock lock(&mu_);
  return CheckNewId(session_id, tenant);
}

absl::StatusOr<v1::CreateSessionResponse> SessionManager::Import(const std::string& tenant,
                                                                 v1::SessionRecord record,
                                                                 const std::string& session_id) {
  const std::string id = session_id.empty() ? record.session_id() : session_id;
  RETURN_IF_ERROR(CheckNewSessionId(tenant, id));
  ASSIGN_OR_RETURN(const bool claimed, ClaimId(id));
  const std::string from = record.session_id();
  record.set_session_id(id);
  record.set_tenant(tenant);
  std::unique_ptr<Session> session;
  absl::Status made = WithRoom(id, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(session, Session::Import(record, env_));
    return absl::OkStatus();
  });
  v1::CreateSessionResponse resp;
  if (made.ok()) {
    resp.set_session_id(id);
    *resp.mutable_policy() = session->Info().policy();
    MutexLock lock(&mu_);
    made = CheckNewId(id, tenant);  // taken meanwhile?
    if (made.ok()) sessions_.Put(id, std::move(session));
  }
  if (!made.ok()) {
    if (claimed) ReleaseClaim(id);
    return made;
  }
  KVLOG(info, "session.import", "session={} from={} tenant={}", id, LogValue(from),
        LogValue(tenant));
  return resp;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Restore(const std::string& tenant,
                                                                 const std::string& session_id) {
  IdGate gate(this, session_id);
  std::shared_ptr<Session> held = Held(session_id);  // restored by another call meanwhile?
  if (held != nullptr) {
    RETURN_IF_ERROR(CheckTenant(tenant, held->tenant(), session_id));
    return held;
  }
  std::string key = RecordKey(session_id);
  const absl::Time start = absl::Now();
  // NOT_FOUND, naming it, when another daemon holds the id.
  absl::StatusOr<std::optional<std::string>> got = records_->Get(session_id);
  if (got.status().code() == absl::StatusCode::kNotFound) {  // taken over elsewhere
    MutexLock lock(&mu_);
    demoted_here_.erase(session_id);
  }
  // A record that is not whole (a part lost) is corrupt as one that fails its checks is.
  auto corrupt = [&](const absl::Status& why) {
    KVLOG(error, "remote.corrupt", "session={} key={} error={}", session_id, LogValue(key),
          LogValue(why.message()));
    MutexLock lock(&mu_);
    ++remote_counters_.corrupt;
    return why;
  };
  if (absl::IsDataLoss(got.status())) return corrupt(got.status());
  ASSIGN_OR_RETURN(std::optional<std::string> bytes, std::move(got));
  // Not demoted: this daemon's own write-behind snapshot, if it left one (a SIGKILL).
  const bool snapshot = !bytes && persisting();
  if (snapshot) {
    key = SnapshotKey(session_id);
    absl::StatusOr<std::optional<std::string>> snap = remote_->Get(key);
    if (absl::IsDataLoss(snap.status())) return corrupt(snap.status());
    ASSIGN_OR_RETURN(bytes, std::move(snap));
  }
  if (!bytes) return Vanished(session_id);
  auto record = DecodeRecord(*bytes, key);
  if (!record.ok()) return corrupt(record.status());
  RETURN_IF_ERROR(CheckTenant(tenant, record->tenant(), session_id));
  // A session restored is held here again: it counts against max_sessions and its tenant's
  // quota as a new one does, and its place is held until it is in (or the restore fails), so
  // that a create meanwhile cannot take it. Refused, it stays where it lies.
  {
    MutexLock lock(&mu_);
    if (absl::Status room = CheckRoom(session_id, record->tenant()); !room.ok()) {
      return absl::Status(room.code(), absl::StrCat(room.message(),
                                                    "; it stays in the remote "
                                                    "tier until there is room"));
    }
    restoring_.emplace(session_id, record->tenant());  // (the gate keeps it the only one)
  }
  absl::Cleanup unreserve = [&] {
    MutexLock lock(&mu_);
    restoring_.erase(session_id);
  };
  // A full host tier makes room by demoting idle sessions, then tries again.
  std::unique_ptr<Session> session;
  RETURN_IF_ERROR(WithRoom(session_id, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(session, Session::Import(*record, env_));
    return absl::OkStatus();
  }));
  // The id changes hands atomically: if another daemon took it meanwhile (or it was closed),
  // this import is thrown away and its slots go back.
  if (!snapshot) {
    // Once more when the reply did not come: Finish may have run (the record is gone, the id
    // this daemon's, and this import its only copy), and is idempotent.
    absl::Status finished = records_->Finish(session_id);
    if (absl::IsUnavailable(finished)) finished = records_->Finish(session_id);
    RETURN_IF_ERROR(finished);
  } else {
    RETURN_IF_ERROR(ClaimId(session_id).status());  // this daemon's own id, held again
  }
  std::shared_ptr<Session> restored = std::move(session);
  if (!snapshot) restored->MarkRestored();
  {
    MutexLock lock(&mu_);
    sessions_.Put(session_id, restored);
    restoring_.erase(session_id);  // counted in the map from here on
    std::move(unreserve).Cancel();
    demoted_here_.erase(session_id);
    ++remote_counters_.restores;
    remote_counters_.restored_bytes += bytes->size();
    remote_counters_.restore_seconds += absl::ToDoubleSeconds(absl::Now() - start);
  }
  if (snapshot) {  // it stays this daemon's persisted copy, which the session now equals
    restored->MarkPersisted(restored->version());
    KVLOG(info, "session.restore", "session={} bytes={} from=snapshot tokens={}", session_id,
          bytes->size(), restored->Info().num_tokens());
    return restored;
  }
  KVLOG(info, "session.restore", "session={} bytes={} ms={:.1f}", session_id, bytes->size(),
        absl::ToDoubleMilliseconds(absl::Now() - start));
  return restored;
}

absl::StatusOr<uint64_t> SessionManager::Demote(const std::string& tenant,
                                                const std::string& session_id, bool after_restore) {
  if (remote_ == nullptr) {  // nothing below the host tier: the session says so
    ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Get(tenant, session_id));
    return s->Evict(v1::TIER_HOST);
  }
  // Only a session held here moves: looking it up must never restore it (DemoteIdle runs
  // inside a restore, which holds its id's gate).
  std::shared_ptr<Session> s = Held(session_id);
  std::optional<IdGate> gate;
  if (s == nullptr && after_restore) {
    // On its way in, maybe: its record goes before it is held here, and a call between the
    // two would find it nowhere.
    gate.emplace(this, session_id);
    s = Held(session_id);
  }
  if (s == nullptr) {
    ASSIGN_OR_RETURN(bool there, remote_->Exists(RecordKey(session_id)));
    if (there) return 0;  // already in the remote tier
    return NotFound(session_id);
  }
  RETURN_IF_ERROR(CheckTenant(tenant, s->tenant(), session_id));
  absl::StatusOr<uint64_t> demoted = s->Demote([&](const v1::SessionRecord& r) -> absl::Status {
    ASSIGN_OR_RETURN(std::string record, EncodeRecord(r));
    return records_->Put(session_id, record);  // and the id let go
  });
  // Moved by another call while this one waited for it: where this one asked it to go.
  if (ReasonOf(demoted.status()) == ErrorReason::kSessionMoved) return 0;
  ASSIGN_OR_RETURN(uint64_t bytes, std::move(demoted));
  {
    MutexLock lock(&mu_);
    // A restore of the record may have put the id back already (another session object): it is
    // live here then, not demoted.
    if (sessions_.Remove(session_id, s.get()) != nullptr) demoted_here_.insert(session_id);
    ++remote_counters_.demotions;
    remote_counters_.demoted_bytes += bytes;
  }
  KVLOG(info, "session.demote", "session={} bytes={}", session_id, bytes);
  DropSnapshot(session_id);  // the record is the newer copy
  return bytes;
}

bool SessionManager::DemoteIdle(const std::string& keep) {
  if (remote_ == nullptr) return false;
  std::vector<std::pair<int64_t, std::shared_ptr<Session>>> idle;
  for (const std::shared_ptr<Session>& s : sessions_.All()) {
    if (s->id() != keep && !s->demoted()) idle.emplace_back(s->last_access_ms(), s);
  }
  std::sort(idle.begin(), idle.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [_, s] : idle) {
    if (s->live_leases() > 0) continue;  // leased chunks stay
    if (Demote("", s->id(), /*after_restore=*/false).ok()) return true;
  }
  return false;
}

SessionManager::RemoteCounters SessionManager::remote_counters() const {
  MutexLock lock(&mu_);
  return remote_counters_;
}

std::vector<std::shared_ptr<Session>> SessionManager::List() const {
  std::vector<std::shared_ptr<Session>> out = sessions_.All();
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a->id() < b->id(); });
  return out;
}

size_t SessionManager::size() const { return sessions_.size(); }

SessionManager::DrainCounts SessionManager::DemoteAll(absl::Time deadline) {
  DrainCounts n;
  if (remote_ == nullptr) return n;
  for (const std::shared_ptr<Session>& s : List()) {
    if (absl::Now() >= deadline) {
      ++n.left;
      continue;
    }
    absl::StatusOr<uint64_t> bytes = Demote("", s->id());
    if (bytes.ok()) {
      ++n.demoted;
      n.bytes += *bytes;
    } else {
      ++n.failed;
      KVLOG(warn, "session.drain_failed", "session={} error={}", s->id(),
            LogValue(bytes.status().message()));
    }
  }
  return n;
}

absl::Status SessionManager::Vanished(const std::string& session_id) {
  {
    MutexLock lock(&mu_);
    if (!demoted_here_.contains(session_id)) return NotFound(session_id);
  }
  absl::StatusOr<bool> closed = records_->ClosedLately(session_id);
  if (!closed.ok()) return closed.status();
  MutexLock lock(&mu_);
  if (*closed) {  // closed on another daemon: gone, as asked
    demoted_here_.erase(session_id);
    return NotFound(session_id);
  }
  ++remote_counters_.lost;
  return absl::DataLossError(absl::StrCat(
      "session_id: ", Quoted(session_id),
      " was demoted by this daemon and its record is gone from the remote tier (not taken by "
      "another daemon, not closed): Redis lost it"));
}

absl::StatusOr<bool> SessionManager::ClaimId(const std::string& id) {
  if (remote_ == nullptr) return false;
  absl::StatusOr<bool> fresh = records_->Claim(id);
  if (!fresh.ok() && fresh.status().code() == absl::StatusCode::kUnavailable) {
    // A Redis that is down delays only the calls that need it: a new session is still
    // created, its id checked against this daemon's sessions alone.
    KVLOG(warn, "remote.unchecked", "session={} error={}", id, LogValue(fresh.status().message()));
    return false;
  }
  return fresh;
}

void SessionManager::ReleaseClaim(const std::string& session_id, bool tombstone) {
  if (remote_ == nullptr) return;
  if (absl::Status released = records_->Release(session_id, tombstone); !released.ok()) {
    KVLOG(warn, "remote.release", "session={} error={}", session_id, LogValue(released.message()));
  }
}

void SessionManager::DropSnapshot(const std::string& session_id) {
  if (!persisting()) return;
  if (auto deleted = remote_->Delete(SnapshotKey(session_id)); !deleted.ok()) {
    KVLOG(warn, "remote.delete", "session={} key={} error={}", session_id,
          LogValue(SnapshotKey(session_id)), LogValue(deleted.status().message()));
  }
}

SessionManager::PersistCounts SessionManager::PersistChanged(const std::function<bool()>& stop) {
  PersistCounts n;
  if (!persisting()) return n;
  for (const std::shared_ptr<Session>& s : List()) {
    if (stop && stop()) break;  // a shutdown: its drain hands the sessions over itself
    std::optional<Session::Snapshot> snap = s->SnapshotIfChanged();
    if (!snap) continue;
    absl::StatusOr<std::string> bytes = EncodeRecord(snap->record);
    if (absl::Status put = bytes.ok() ? remote_->Put(SnapshotKey(s->id()), *bytes) : bytes.status();
        !put.ok()) {
      ++n.failed;
      KVLOG(warn, "session.persist_failed", "session={} error={}", s->id(),
            LogValue(put.message()));
      continue;
    }
    // Closed or demoted since the snapshot was taken: whoever closed it dropped the snapshot
    // before this put, or will after; either way none may outlive the session.
    if (s->closed()) DropSnapshot(s->id());
    s->MarkPersisted(snap->version);
    ++n.sessions;
    n.bytes += bytes->size();
  }
  return n;
}

void SessionManager::CloseAll() {
  std::vector<std::pair<std::string, std::shared_ptr<Session>>> all;
  {
    MutexLock lock(&mu_);
    all = sessions_.TakeAll();
  }
  for (auto& [id, s] : all) {
    s->Close();
    // Their ids go free for other daemons, unless a snapshot of this one's will bring them
    // back when this instance starts again.
    if (!persisting()) ReleaseClaim(id);
  }
}

}  // namespace kvtier
