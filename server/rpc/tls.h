// TLS for the TCP listeners: gRPC's TLS server credentials, mTLS when tls.client_ca_file is
// set. gRPC's provider re-reads its files every tls.refresh_s and takes whatever it finds, a
// half-written or broken key included (the listener then refuses every handshake), so it
// never reads the operator's files: it reads private copies (TlsStage) that are replaced,
// each by one rename, only by a SIGHUP whose files all parse and match (CheckTlsFiles).
#ifndef KVTIER_SERVER_RPC_TLS_H_
#define KVTIER_SERVER_RPC_TLS_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "server/config/config.h"
#include "server/rpc/auth.h"

namespace kvtier {

// OK when the certificate chain, the key (which must match the chain's first certificate)
// and the client CA parse as PEM; INVALID_ARGUMENT naming the tls.* field otherwise.
absl::Status CheckTlsFiles(const ServerOptions::Tls& tls);

// Private copies of the configured TLS files, in a directory of mode 0700 made for this
// process (files 0600) and removed with it.
class TlsStage {
 public:
  // Checks the configured files and copies them; INVALID_ARGUMENT naming the field, INTERNAL
  // when the copies cannot be written.
  static absl::StatusOr<std::unique_ptr<TlsStage>> Create(const ServerOptions::Tls& tls);
  ~TlsStage();
  TlsStage(const TlsStage&) = delete;
  TlsStage& operator=(const TlsStage&) = delete;

  // SIGHUP: checks the configured files again and, when all are good, replaces the copies
  // (the listener serves them within refresh_s); else changes nothing and says why.
  absl::Status Reload();
  // The credentials of the TCP listeners over the copies.
  std::shared_ptr<grpc::ServerCredentials> Credentials() const;

 private:
  TlsStage(ServerOptions::Tls tls, std::string dir) : tls_(std::move(tls)), dir_(std::move(dir)) {}
  // Replaces the copies with these bytes (checked), each by one rename.
  absl::Status Write(const std::string& cert, const std::string& key, const std::string& ca);
  std::string Staged(const char* name) const { return dir_ + "/" + name; }

  const ServerOptions::Tls tls_;  // the operator's paths
  const std::string dir_;
};

// A kvtier call refused by TcpCredentials' check: its method ("Select") and why.
using RefusedCall = std::function<void(absl::string_view method, const absl::Status& why)>;

// The credentials of the TCP listeners: `stage`'s TLS, or plaintext when it is null
// (tcp_plaintext, checked by Validate). Over TLS, `auth` checks each kvtier call's credentials
// (its bearer token, else its client certificate, and its x-kvtier-tenant header) as its
// headers arrive, before gRPC takes in its message (what was already in flight is dropped): a
// call Authenticator::Identify refuses ends there with Identify's code and words, the
// service's own answer, and `refused` is told (the service logs and counts it as a failed
// call). The one difference: while the daemon drains, such a call gets Identify's answer, not
// UNAVAILABLE. The service checks every call that passes again. The health check and
// reflection are not checked, as over the Unix socket; gRPC gives plaintext credentials no
// such check.
std::shared_ptr<grpc::ServerCredentials> TcpCredentials(const TlsStage* stage,
                                                        const Authenticator* auth,
                                                        RefusedCall refused);

// A call's credentials as its metadata gives them (its x-kvtier-tenant and authorization
// headers, views into `metadata`); the caller adds where it came from.
CallCredentials CredentialsIn(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata);

// The subject of a call's verified client certificate, RFC 2253 ("CN=alice,O=team-a"), or
// nullopt when the call has none (no TLS, or no certificate).
std::optional<std::string> ClientCertSubject(const grpc::CallbackServerContext& ctx);
std::optional<std::string> ClientCertSubject(const grpc::AuthContext& auth);

}  // namespace kvtier

#endif  // KVTIER_SERVER_RPC_TLS_H_
