#include "server/rpc/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/common/error.h"
#include "server/common/names.h"

namespace kvtier {

std::optional<std::array<uint8_t, 32>> TokenDigest(absl::string_view salt,
                                                   absl::string_view token) {
  std::array<uint8_t, 32> out{};
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  unsigned int n = 0;
  const bool ok = ctx != nullptr && EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr) == 1 &&
                  EVP_DigestUpdate(ctx, salt.data(), salt.size()) == 1 &&
                  EVP_DigestUpdate(ctx, token.data(), token.size()) == 1 &&
                  EVP_DigestFinal_ex(ctx, out.data(), &n) == 1 && n == out.size();
  EVP_MD_CTX_free(ctx);
  if (!ok) return std::nullopt;  // OpenSSL could not allocate: no match
  return out;
}

Authenticator::Authenticator(const ServerOptions& options, uid_t daemon_uid)
    : daemon_uid_(daemon_uid),
      same_uid_by_metadata_(options.same_uid_by_metadata),
      unix_peers_(options.unix_peers),
      tokens_(options.tokens),
      cert_subjects_(options.cert_subjects) {}

absl::StatusOr<ServerOptions::Grant> Authenticator::FromToken(
    absl::string_view authorization) const {
  // RFC 6750: the scheme is case-insensitive, one space, then the token.
  constexpr absl::string_view kScheme = "bearer ";
  if (authorization.size() > kMaxAuthorization ||
      !absl::StartsWithIgnoreCase(authorization, kScheme) ||
      authorization.size() == kScheme.size()) {
    return absl::UnauthenticatedError(
        absl::StrCat(kAuthorizationHeader, ": not a bearer token (\"Bearer <token>\", at most ",
                     kMaxAuthorization, " bytes)"));
  }
  const absl::string_view token = authorization.substr(kScheme.size());
  // Every entry is hashed and compared in constant time, so the time taken tells nothing
  // about how close a guess came or which entry it matched.
  const ServerOptions::Grant* found = nullptr;
  for (const ServerOptions::Token& t : tokens_) {
    const std::optional<std::array<uint8_t, 32>> digest = TokenDigest(t.salt, token);
    if (digest.has_value() &&
        CRYPTO_memcmp(digest->data(), t.sha256.data(), t.sha256.size()) == 0 && found == nullptr) {
      found = &t.grant;
    }
  }
  if (found == nullptr) {
    return absl::UnauthenticatedError(
        absl::StrCat(kAuthorizationHeader, ": the bearer token matches no entry of auth.tokens"));
  }
  return *found;
}

absl::StatusOr<Caller> Authenticator::Identify(const CallCredentials& call) const {
  const bool named = call.tenant_header.has_value() && !call.tenant_header->empty();
  const std::string header = named ? std::string(*call.tenant_header) : "";
  if (named && !IsTenantName(header)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kTenantHeader, ": ", Quoted(header), " ", kTenantRule));
  }
  ServerOptions::Grant grant;
  std::string who;  // the credentials, as a PERMISSION_DENIED message names them
  if (call.authorization.has_value() && !call.authorization->empty()) {
    absl::StatusOr<ServerOptions::Grant> g = FromToken(*call.authorization);
    if (!g.ok()) return g.status();
    grant = *std::move(g);
    who = "the bearer token";
  } else if (call.cert_subject.has_value()) {
    auto mapped = cert_subjects_.find(*call.cert_subject);
    if (mapped == cert_subjects_.end()) {
      return absl::UnauthenticatedError(absl::StrCat("the client certificate's subject ",
                                                     Quoted(*call.cert_subject),
                                                     " is in no entry of auth.cert_subjects"));
    }
    grant = mapped->second;
    who = absl::StrCat("certificate ", Quoted(*call.cert_subject));
  } else if (call.tcp) {
    return absl::UnauthenticatedError(
        absl::StrCat("a TCP caller needs credentials: a bearer token in the ", kAuthorizationHeader,
                     " metadata (\"Bearer <token>\", auth.tokens) or a client certificate "
                     "(auth.cert_subjects)"));
  } else if (!call.unix_peer.has_value()) {
    return absl::UnauthenticatedError(
        "the caller is neither a TCP caller nor a Unix-socket connection whose credentials "
        "are known");
  } else if (call.unix_peer->uid == daemon_uid_ && same_uid_by_metadata_) {
    // The documented exception: the daemon's own uid could read its memory anyway, so it is
    // an admin and names whichever tenant it acts as.
    return Caller{named ? header : std::string("default"), /*admin=*/!named, std::nullopt};
  } else {
    auto mapped = unix_peers_.find(call.unix_peer->uid);
    if (mapped == unix_peers_.end()) {
      return absl::UnauthenticatedError(
          absl::StrCat("uid ", call.unix_peer->uid, " (pid ", call.unix_peer->pid,
                       ") has no credentials here: the daemon's config names its Unix-socket "
                       "peers in auth.unix_peers, and bearer tokens in auth.tokens"));
    }
    grant = mapped->second;
    who = absl::StrCat("uid ", call.unix_peer->uid);
  }
  if (named && header != grant.tenant && !grant.admin) {
    return absl::PermissionDeniedError(absl::StrCat(kTenantHeader, ": ", Quoted(header),
                                                    " is not the tenant of ", who, " (",
                                                    grant.tenant, ")"));
  }
  // A header narrows the call to one tenant: an admin naming one acts as it, and as it only.
  return Caller{named ? header : grant.tenant, grant.admin && !named, std::nullopt};
}

bool Authenticator::GrantsNothingTo(uid_t uid) const {
  return tokens_.empty() && !(uid == daemon_uid_ && same_uid_by_metadata_) &&
         !unix_peers_.contains(uid);
}

}  // namespace kvtier
