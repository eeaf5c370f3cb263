// The daemon's sessions: creation with limits, lookup with tenant checks, close, fork.
#ifndef KVTIER_SERVER_SESSION_SESSION_MANAGER_H_
#define KVTIER_SERVER_SESSION_SESSION_MANAGER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/config/config.h"
#include "server/session/session.h"

namespace kvtier {

class SessionManager {
 public:
  SessionManager(const ServerOptions& options, const SessionEnv& env)
      : options_(options), env_(env) {}
  ~SessionManager();

  // INVALID_ARGUMENT for the shape, the policy or a malformed session_id; ALREADY_EXISTS for
  // a taken id; RESOURCE_EXHAUSTED past max_sessions.
  absl::StatusOr<v1::CreateSessionResponse> Create(const std::string& tenant,
                                                   const v1::CreateSessionRequest& req);

  // NOT_FOUND for an unknown id; PERMISSION_DENIED for another tenant's session. An empty
  // tenant is the admin view and sees every session.
  absl::StatusOr<std::shared_ptr<Session>> Get(const std::string& tenant,
                                               const std::string& session_id) const;

  // Idempotent: false when there was no such session. PERMISSION_DENIED for another's.
  absl::StatusOr<bool> Close(const std::string& tenant, const std::string& session_id);

  // As Create, from an existing session's first `num_tokens` tokens.
  absl::StatusOr<v1::CreateSessionResponse> Fork(const std::string& tenant,
                                                 const v1::ForkSessionRequest& req);

  std::vector<std::shared_ptr<Session>> List() const;
  size_t size() const;

  // Closes every session (shutdown).
  void CloseAll();

 private:
  // Id syntax and uniqueness, then the daemon's max_sessions and `tenant`'s quota.
  absl::Status CheckNewId(const std::string& id, const std::string& tenant) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string NewId() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ServerOptions& options_;
  const SessionEnv env_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_SESSION_SESSION_MANAGER_H_
