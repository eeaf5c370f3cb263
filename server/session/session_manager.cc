#include "server/common/mutex.h"
#include "server/session/session_manager.h"


#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/common/log.h"
#include "server/common/names.h"
#include "server/common/status_macros.h"
#include "server/config/policy.h"

namespace kvtier {

SessionManager::~SessionManager() { CloseAll(); }

absl::Status SessionManager::CheckNewId(const std::string& id, const std::string& tenant) const {
  if (!IsName(id, "_.:-", 128)) {
    return absl::InvalidArgumentError(
        absl::StrCat("session_id: \"", id, "\" must be 1..128 of [A-Za-z0-9_.:-]"));
  }
  if (sessions_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("session_id: \"", id, "\" already exists"));
  }
  if (sessions_.size() >= options_.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "session_id: \"%s\": the daemon holds max_sessions %d sessions", id,
        options_.max_sessions));
  }
  if (const uint32_t quota = options_.QuotaFor(tenant).max_sessions; quota != 0) {
    size_t held = 0;
    for (const auto& [_, s] : sessions_) held += s->tenant() == tenant;
    if (held >= quota) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "quota: tenant \"%s\" max_sessions %d reached (session_id \"%s\")", tenant, quota,
          id));
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
  MutexLock lock(&mu_);
  std::string id = req.session_id().empty() ? NewId() : req.session_id();
  RETURN_IF_ERROR(CheckNewId(id, tenant));
  std::map<std::string, std::string> labels(req.labels().begin(), req.labels().end());
  sessions_.emplace(id, std::make_shared<Session>(id, tenant, shape, policy, std::move(labels),
                                                  env_));
  KVLOG(info, "session.create", "session={} tenant={} layers={} kv_heads={} head_dim={}", id,
        tenant, shape.num_layers(), shape.num_kv_heads(), shape.head_dim());
  v1::CreateSessionResponse resp;
  resp.set_session_id(id);
  *resp.mutable_policy() = policy;
  return resp;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Get(
    const std::string& tenant, const std::string& session_id) const {
  MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("session_id: \"", session_id, "\" not found"));
  }
  if (!tenant.empty() && it->second->tenant() != tenant) {
    return absl::PermissionDeniedError(
        absl::StrCat("session_id: \"", session_id, "\" belongs to another tenant"));
  }
  return it->second;
}

absl::StatusOr<bool> SessionManager::Close(const std::string& tenant,
                                           const std::string& session_id) {
  std::shared_ptr<Session> s;
  {
    MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return false;
    if (!tenant.empty() && it->second->tenant() != tenant) {
      return absl::PermissionDeniedError(
          absl::StrCat("session_id: \"", session_id, "\" belongs to another tenant"));
    }
    s = std::move(it->second);
    sessions_.erase(it);
  }
  s->Close();  // outside the manager lock: frees slots
  KVLOG(info, "session.close", "session={}", session_id);
  return true;
}

absl::StatusOr<v1::CreateSessionResponse> SessionManager::Fork(
    const std::string& tenant, const v1::ForkSessionRequest& req) {
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
  ASSIGN_OR_RETURN(std::unique_ptr<Session> child, parent->Fork(id, req.num_tokens()));
  v1::CreateSessionResponse resp;
  resp.set_session_id(id);
  *resp.mutable_policy() = child->Info().policy();
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckNewId(id, tenant));  // taken meanwhile?
  sessions_.emplace(id, std::move(child));
  KVLOG(info, "session.fork", "session={} parent={} tokens={}", id, req.session_id(),
        req.num_tokens());
  return resp;
}

std::vector<std::shared_ptr<Session>> SessionManager::List() const {
  MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> out;
  out.reserve(sessions_.size());
  for (const auto& [id, s] : sessions_) out.push_back(s);
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a->id() < b->id(); });
  return out;
}

size_t SessionManager::size() const {
  MutexLock lock(&mu_);
  return sessions_.size();
}

void SessionManager::CloseAll() {
  absl::flat_hash_map<std::string, std::shared_ptr<Session>> all;
  {
    MutexLock lock(&mu_);
    all.swap(sessions_);
  }
  for (auto& [id, s] : all) s->Close();
}

}  // namespace kvtier
