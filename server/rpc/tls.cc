#include "server/rpc/tls.h"

#include <fcntl.h>
#include <openssl/bio.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "server/common/error.h"
#include "server/common/mutex.h"
#include "server/common/status_macros.h"

namespace kvtier {
namespace {

absl::Status Bad(const char* field, const std::string& path, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", Quoted(path), " ", why));
}

// The first PEM object of the kind `read` reads in `pem`, or null.
template <typename T, typename Read>
std::unique_ptr<T, void (*)(T*)> ParsePem(const std::string& pem, Read read, void (*free)(T*)) {
  std::unique_ptr<T, void (*)(T*)> out(nullptr, free);
  if (BIO* bio = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()))) {
    out.reset(read(bio, nullptr, nullptr, nullptr));
    BIO_free(bio);
  }
  return out;
}

// The configured files, each read once: what is checked is what is staged.
struct TlsBytes {
  std::string cert, key, ca;
};

TlsBytes ReadTls(const ServerOptions::Tls& tls) {
  auto read = [](const std::string& path) {
    if (path.empty()) return std::string();
    std::ifstream in(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  return {read(tls.cert_file), read(tls.key_file), read(tls.client_ca_file)};
}

absl::Status CheckTls(const ServerOptions::Tls& tls, const TlsBytes& b) {
  auto cert = ParsePem<X509>(b.cert, PEM_read_bio_X509, X509_free);
  if (cert == nullptr) return Bad("tls.cert_file", tls.cert_file, "holds no PEM certificate");
  auto key = ParsePem<EVP_PKEY>(b.key, PEM_read_bio_PrivateKey, EVP_PKEY_free);
  if (key == nullptr) return Bad("tls.key_file", tls.key_file, "holds no PEM private key");
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    return Bad("tls.key_file", tls.key_file, "is not the key of tls.cert_file's certificate");
  }
  if (!tls.client_ca_file.empty() &&
      ParsePem<X509>(b.ca, PEM_read_bio_X509, X509_free) == nullptr) {
    return Bad("tls.client_ca_file", tls.client_ca_file, "holds no PEM certificate");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckTlsFiles(const ServerOptions::Tls& tls) {
  if (tls.cert_file.empty()) return absl::OkStatus();
  return CheckTls(tls, ReadTls(tls));
}

absl::StatusOr<std::unique_ptr<TlsStage>> TlsStage::Create(const ServerOptions::Tls& tls) {
  const TlsBytes bytes = ReadTls(tls);
  RETURN_IF_ERROR(CheckTls(tls, bytes));
  char dir[] = "/tmp/kvtier-tls-XXXXXX";  // mkdtemp makes it 0700
  if (mkdtemp(dir) == nullptr) {
    return absl::InternalError(
        absl::StrCat("tls: cannot make a private directory in /tmp: ", std::strerror(errno)));
  }
  auto stage = std::unique_ptr<TlsStage>(new TlsStage(tls, dir));
  RETURN_IF_ERROR(stage->Write(bytes.cert, bytes.key, bytes.ca));
  return stage;
}

TlsStage::~TlsStage() {
  for (const char* name : {"cert.pem", "key.pem", "ca.pem", "next"}) unlink(Staged(name).c_str());
  rmdir(dir_.c_str());
}

absl::Status TlsStage::Write(const std::string& cert, const std::string& key,
                             const std::string& ca) {
  // The key first: the certificate it matches follows within microseconds, and the provider
  // reads both once a refresh_s.
  const std::pair<const std::string*, const char*> files[] = {
      {&key, "key.pem"}, {&cert, "cert.pem"}, {&ca, "ca.pem"}};
  for (const auto& [bytes, name] : files) {
    if (bytes->empty()) continue;
    // Written whole beside the copy, then renamed over it: the provider reads old or new.
    const std::string next = Staged("next");
    const int fd = open(next.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    const bool ok =
        fd >= 0 && write(fd, bytes->data(), bytes->size()) == static_cast<ssize_t>(bytes->size());
    if (fd >= 0) close(fd);
    if (!ok || rename(next.c_str(), Staged(name).c_str()) != 0) {
      return absl::InternalError(
          absl::StrCat("tls: cannot write ", Staged(name), ": ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

absl::Status TlsStage::Reload() {
  const TlsBytes bytes = ReadTls(tls_);
  RETURN_IF_ERROR(CheckTls(tls_, bytes));
  return Write(bytes.cert, bytes.key, bytes.ca);
}

std::shared_ptr<grpc::ServerCredentials> TlsStage::Credentials() const {
  const bool mtls = !tls_.client_ca_file.empty();
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      Staged("key.pem"), Staged("cert.pem"), mtls ? Staged("ca.pem") : "", tls_.refresh_s);
  grpc::experimental::TlsServerCredentialsOptions o(provider);
  o.watch_identity_key_cert_pairs();
  if (mtls) {
    o.watch_root_certs();
    o.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    o.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(o);
}

namespace {

// The first value of `key` in a call's metadata.
std::optional<absl::string_view> Value(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata, absl::string_view key) {
  auto it = metadata.find(grpc::string_ref(key.data(), key.size()));
  if (it == metadata.end()) return std::nullopt;
  return absl::string_view(it->second.data(), it->second.size());
}

// A kvtier call's credentials checked when its headers arrive (TcpCredentials).
class CredentialsFirst final : public grpc::AuthMetadataProcessor {
 public:
  CredentialsFirst(const Authenticator* auth, RefusedCall refused)
      : auth_(auth), refused_(std::move(refused)) {}

  // No I/O: inline on the gRPC thread that read the call's headers.
  bool IsBlocking() const override { return false; }

  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext* context,
                       OutputMetadata* /*consumed*/, OutputMetadata* /*response*/) override {
    KVTIER_TSAN_ACQUIRE(this);  // on a gRPC thread: what TcpCredentials made it with
    // kvtier's own calls only: the health check and reflection answer anyone, as over the
    // Unix socket.
    const absl::string_view path = Value(metadata, ":path").value_or("");
    if (!absl::StartsWith(path, kKvTierPathPrefix)) return grpc::Status::OK;
    CallCredentials call = CredentialsIn(metadata);
    call.tcp = true;
    if (context != nullptr) call.cert_subject = ClientCertSubject(*context);
    const absl::StatusOr<Caller> caller = auth_->Identify(call);
    if (caller.ok()) return grpc::Status::OK;
    if (refused_) refused_(path.substr(kKvTierPathPrefix.size()), caller.status());
    return grpc::Status(static_cast<grpc::StatusCode>(caller.status().code()),
                        std::string(caller.status().message()));
  }

 private:
  const Authenticator* const auth_;
  const RefusedCall refused_;
};

}  // namespace

std::shared_ptr<grpc::ServerCredentials> TcpCredentials(const TlsStage* stage,
                                                        const Authenticator* auth,
                                                        RefusedCall refused) {
  if (stage == nullptr) return grpc::InsecureServerCredentials();
  std::shared_ptr<grpc::ServerCredentials> credentials = stage->Credentials();
  if (auth != nullptr) {
    auto processor = std::make_shared<CredentialsFirst>(auth, std::move(refused));
    KVTIER_TSAN_RELEASE(processor.get());  // gRPC's threads reach it through its own code
    credentials->SetAuthMetadataProcessor(processor);
  }
  return credentials;
}

CallCredentials CredentialsIn(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) {
  CallCredentials call;
  call.tenant_header = Value(metadata, kTenantHeader);
  call.authorization = Value(metadata, kAuthorizationHeader);
  return call;
}

std::optional<std::string> ClientCertSubject(const grpc::AuthContext& auth) {
  if (!auth.IsPeerAuthenticated()) return std::nullopt;
  const std::vector<grpc::string_ref> subject = auth.FindPropertyValues("x509_subject");
  if (subject.empty()) return std::nullopt;
  return std::string(subject.front().data(), subject.front().size());
}

std::optional<std::string> ClientCertSubject(const grpc::CallbackServerContext& ctx) {
  const std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth == nullptr) return std::nullopt;
  return ClientCertSubject(*auth);
}

}  // namespace kvtier
