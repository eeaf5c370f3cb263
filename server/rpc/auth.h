// Who a call is. Its credentials (a bearer token on any listener, else a TLS client
// certificate, else the Unix socket's SO_PEERCRED) are checked against the config's auth
// section (ServerOptions: unix_peers, tokens, cert_subjects, same_uid_by_metadata) and give a
// grant, a tenant and maybe the admin role. The x-kvtier-tenant header narrows a call to one
// tenant: the grant's own, or any for an admin grant, and a call that names a tenant acts as it
// only, without the admin role. The daemon's own uid (same_uid_by_metadata) is an admin grant of
// tenant "default". No gRPC type appears here, so that every case is testable without a server.
#ifndef KVTIER_SERVER_RPC_AUTH_H_
#define KVTIER_SERVER_RPC_AUTH_H_

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/config/config.h"
#include "server/rpc/unix_listener.h"

namespace kvtier {

// Metadata keys: the tenant a call acts as (absent: its credentials' own, "default" for the
// daemon's uid) and its bearer token.
inline constexpr char kTenantHeader[] = "x-kvtier-tenant";
inline constexpr char kAuthorizationHeader[] = "authorization";
// What the path of every kvtier call starts with (the rest is its method); other paths (the
// health check, reflection) need no credentials.
inline constexpr absl::string_view kKvTierPathPrefix = "/kvtier.v1.KvTier/";
// Longest authorization value looked at; a longer one is UNAUTHENTICATED before any hashing.
inline constexpr size_t kMaxAuthorization = 4096;

// What a call acts as, fixed once when it starts.
struct Caller {
  std::string tenant;
  bool admin = false;
  // The Unix-socket connection's credentials, taken with the rest when the call started;
  // nullopt for a call that came another way.
  std::optional<PeerCredentials> unix_peer;
};

// What a call brings. Empty header values count as absent.
struct CallCredentials {
  std::optional<absl::string_view> tenant_header;
  std::optional<absl::string_view> authorization;
  // The gRPC peer is TCP ("ipv4:", "ipv6:"); else `unix_peer` is its Unix-socket connection's
  // credentials (nullopt: none known).
  bool tcp = false;
  std::optional<PeerCredentials> unix_peer;
  // A TLS connection's verified client certificate: its subject, RFC 2253.
  std::optional<std::string> cert_subject;
};

// SHA-256 of `salt` followed by `token`, as a config entry's sha256 holds it; nullopt when
// OpenSSL fails (it could not allocate).
std::optional<std::array<uint8_t, 32>> TokenDigest(absl::string_view salt, absl::string_view token);

class Authenticator {
 public:
  Authenticator(const ServerOptions& options, uid_t daemon_uid);

  // INVALID_ARGUMENT for a header naming no valid tenant; UNAUTHENTICATED without valid
  // credentials (a token that matches no entry, a certificate whose subject is in no entry, a
  // TCP caller with neither, a uid named nowhere); PERMISSION_DENIED for a header naming a tenant
  // the credentials do not give. Every message names the header or the config field to look at,
  // never a token.
  absl::StatusOr<Caller> Identify(const CallCredentials& call) const;
  // Whether every call of a Unix-socket connection of `uid` is refused, whatever it sends:
  // no token could pass (none are configured), and the uid is in no entry (nor the daemon's
  // own, while same_uid_by_metadata is on).
  bool GrantsNothingTo(uid_t uid) const;

 private:
  absl::StatusOr<ServerOptions::Grant> FromToken(absl::string_view authorization) const;

  uid_t daemon_uid_;
  bool same_uid_by_metadata_;
  std::map<uint32_t, ServerOptions::Grant> unix_peers_;
  std::vector<ServerOptions::Token> tokens_;
  std::map<std::string, ServerOptions::Grant> cert_subjects_;
};

}  // namespace kvtier

#endif  // KVTIER_SERVER_RPC_AUTH_H_
