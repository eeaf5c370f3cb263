#include "server/rpc/tls.h"

#include <fcntl.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "server/common/error.h"
#include "server/common/status_macros.h"

namespace kvtier {
namespace {

absl::Status Bad(const char* field, const std::string& path, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", Quoted(path), " ", why));
}

// The file's first PEM object of the kind `read` reads, or null.
template <typename T, typename Read>
std::unique_ptr<T, void (*)(T*)> ReadPem(const std::string& path, Read read, void (*free)(T*)) {
  std::unique_ptr<T, void (*)(T*)> out(nullptr, free);
  if (FILE* f = std::fopen(path.c_str(), "r")) {
    out.reset(read(f, nullptr, nullptr, nullptr));
    std::fclose(f);
  }
  return out;
}

}  // namespace

absl::Status CheckTlsFiles(const ServerOptions::Tls& tls) {
  if (tls.cert_file.empty()) return absl::OkStatus();
  auto cert = ReadPem<X509>(tls.cert_file, PEM_read_X509, X509_free);
  if (cert == nullptr) return Bad("tls.cert_file", tls.cert_file, "holds no PEM certificate");
  auto key = ReadPem<EVP_PKEY>(tls.key_file, PEM_read_PrivateKey, EVP_PKEY_free);
  if (key == nullptr) return Bad("tls.key_file", tls.key_file, "holds no PEM private key");
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    return Bad("tls.key_file", tls.key_file, "is not the key of tls.cert_file's certificate");
  }
  if (!tls.client_ca_file.empty() &&
      ReadPem<X509>(tls.client_ca_file, PEM_read_X509, X509_free) == nullptr) {
    return Bad("tls.client_ca_file", tls.client_ca_file, "holds no PEM certificate");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TlsStage>> TlsStage::Create(const ServerOptions::Tls& tls) {
  RETURN_IF_ERROR(CheckTlsFiles(tls));
  char dir[] = "/tmp/kvtier-tls-XXXXXX";  // mkdtemp makes it 0700
  if (mkdtemp(dir) == nullptr) {
    return absl::InternalError(
        absl::StrCat("tls: cannot make a private directory in /tmp: ", std::strerror(errno)));
  }
  auto stage = std::unique_ptr<TlsStage>(new TlsStage(tls, dir));
  RETURN_IF_ERROR(stage->Copy());
  return stage;
}

TlsStage::~TlsStage() {
  for (const char* name : {"cert.pem", "key.pem", "ca.pem", "next"}) unlink(Staged(name).c_str());
  rmdir(dir_.c_str());
}

absl::Status TlsStage::Copy() {
  const std::pair<const std::string*, const char*> files[] = {
      {&tls_.cert_file, "cert.pem"}, {&tls_.key_file, "key.pem"}, {&tls_.client_ca_file, "ca.pem"}};
  for (const auto& [from, name] : files) {
    if (from->empty()) continue;
    std::ifstream in(*from, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    // Written whole beside the copy, then renamed over it: the provider reads old or new.
    const std::string next = Staged("next");
    const int fd = open(next.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    const bool ok =
        fd >= 0 && write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size());
    if (fd >= 0) close(fd);
    if (!ok || rename(next.c_str(), Staged(name).c_str()) != 0) {
      return absl::InternalError(
          absl::StrCat("tls: cannot write ", Staged(name), ": ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

absl::Status TlsStage::Reload() {
  RETURN_IF_ERROR(CheckTlsFiles(tls_));
  return Copy();
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

std::shared_ptr<grpc::ServerCredentials> TcpCredentials(const TlsStage* stage) {
  return stage == nullptr ? grpc::InsecureServerCredentials() : stage->Credentials();
}

std::optional<std::string> ClientCertSubject(const grpc::CallbackServerContext& ctx) {
  const std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return std::nullopt;
  const std::vector<grpc::string_ref> subject = auth->FindPropertyValues("x509_subject");
  if (subject.empty()) return std::nullopt;
  return std::string(subject.front().data(), subject.front().size());
}

}  // namespace kvtier
