// Authenticator: every kind of credential, with and without a tenant header, against the
// config's auth section. Digests are checked against SHA-256's published test vector.
#include "server/rpc/auth.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "server/rpc/unix_listener.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using testing::StatusIs;
using Code = absl::StatusCode;

constexpr uid_t kDaemonUid = 500;

std::string Hex(const std::array<uint8_t, 32>& d) {
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(d.data()), d.size()));
}

TEST(TokenDigest, IsSha256OfTheSaltThenTheToken) {
  // FIPS 180-2's example: SHA-256("abc").
  const auto d = TokenDigest("a", "bc");
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(Hex(*d), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Hex(*TokenDigest("ab", "c")), Hex(*d));
  EXPECT_EQ(Hex(*TokenDigest("", "")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

ServerOptions::Token Entry(const std::string& tenant, const std::string& salt,
                           const std::string& token, bool admin = false) {
  return {.grant = {tenant, admin}, .salt = salt, .sha256 = *TokenDigest(salt, token)};
}

ServerOptions Options(bool same_uid = true) {
  ServerOptions o;
  o.same_uid_by_metadata = same_uid;
  o.unix_peers[1000] = {"carol", false};
  o.unix_peers[1002] = {"ops", true};
  o.cert_subjects["CN=dave,O=team-d"] = {"dave", false};
  o.tokens = {Entry("alice", "saltsaltsalt0001", "alice-secret"),
              Entry("bob", "saltsaltsalt0002", "bob-secret"),
              Entry("root", "saltsaltsalt0003", "root-secret", /*admin=*/true)};
  return o;
}

CallCredentials Tcp(std::optional<absl::string_view> auth,
                    std::optional<absl::string_view> tenant = std::nullopt) {
  return {.tenant_header = tenant,
          .authorization = auth,
          .tcp = true,
          .unix_peer = std::nullopt,
          .cert_subject = std::nullopt};
}
CallCredentials Unix(uid_t uid, std::optional<absl::string_view> tenant = std::nullopt,
                     std::optional<absl::string_view> auth = std::nullopt) {
  return {.tenant_header = tenant,
          .authorization = auth,
          .unix_peer = PeerCredentials{.uid = uid, .gid = uid, .pid = 42},
          .cert_subject = std::nullopt};
}

void ExpectCaller(const absl::StatusOr<Caller>& c, const std::string& tenant, bool admin) {
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->tenant, tenant);
  EXPECT_EQ(c->admin, admin);
}

TEST(Authenticator, TcpCallersNeedABearerToken) {
  const Authenticator a(Options(), kDaemonUid);
  EXPECT_THAT(a.Identify(Tcp(std::nullopt)), StatusIs(Code::kUnauthenticated, "bearer token"));
  EXPECT_THAT(a.Identify(Tcp(std::nullopt, "alice")), StatusIs(Code::kUnauthenticated));
  ExpectCaller(a.Identify(Tcp("Bearer alice-secret")), "alice", false);
  ExpectCaller(a.Identify(Tcp("bearer bob-secret")), "bob", false);  // the scheme in any case
  ExpectCaller(a.Identify(Tcp("Bearer alice-secret", "alice")), "alice", false);
  EXPECT_THAT(a.Identify(Tcp("Bearer alice-secret", "bob")),
              StatusIs(Code::kPermissionDenied,
                       "x-kvtier-tenant: \"bob\" is not the tenant of "
                       "the bearer token (alice)"));
}

TEST(Authenticator, ABadTokenIsUnauthenticatedAndNamesNoSecret) {
  const Authenticator a(Options(), kDaemonUid);
  for (const char* bad : {"Bearer alice-secret ", "Bearer alice", "Bearer ", "Basic YWxpY2U=",
                          "alice-secret", "Bearer saltsaltsalt0001alice-secret"}) {
    absl::StatusOr<Caller> c = a.Identify(Tcp(bad));
    EXPECT_THAT(c, StatusIs(Code::kUnauthenticated, "authorization: ")) << bad;
    EXPECT_EQ(c.status().message().find("secret"), absl::string_view::npos) << c.status();
  }
  EXPECT_THAT(a.Identify(Tcp("Bearer " + std::string(kMaxAuthorization, 'x'))),
              StatusIs(Code::kUnauthenticated, "at most 4096 bytes"));
  // A bad token is not rescued by the socket: the daemon's own uid sending one is refused.
  EXPECT_THAT(a.Identify(Unix(kDaemonUid, std::nullopt, "Bearer wrong")),
              StatusIs(Code::kUnauthenticated, "matches no entry of auth.tokens"));
}

TEST(Authenticator, AnAdminNarrowsToAnyTenantAndIsThenThatTenantOnly) {
  const Authenticator a(Options(), kDaemonUid);
  ExpectCaller(a.Identify(Tcp("Bearer root-secret")), "root", true);
  ExpectCaller(a.Identify(Tcp("Bearer root-secret", "alice")), "alice", false);
  ExpectCaller(a.Identify(Unix(1002)), "ops", true);
  ExpectCaller(a.Identify(Unix(1002, "carol")), "carol", false);
}

TEST(Authenticator, UnixPeersAreTheirUidsGrants) {
  const Authenticator a(Options(), kDaemonUid);
  ExpectCaller(a.Identify(Unix(1000)), "carol", false);
  ExpectCaller(a.Identify(Unix(1000, "carol")), "carol", false);
  EXPECT_THAT(a.Identify(Unix(1000, "alice")),
              StatusIs(Code::kPermissionDenied, "is not the tenant of uid 1000 (carol)"));
  EXPECT_THAT(a.Identify(Unix(1001)), StatusIs(Code::kUnauthenticated, "uid 1001 (pid 42)"));
  // A token speaks for a uid named nowhere, and for a mapped one (the token's grant wins).
  ExpectCaller(a.Identify(Unix(1001, std::nullopt, "Bearer bob-secret")), "bob", false);
  ExpectCaller(a.Identify(Unix(1000, std::nullopt, "Bearer bob-secret")), "bob", false);
  EXPECT_THAT(a.Identify(CallCredentials{}), StatusIs(Code::kUnauthenticated, "credentials"));
}

TEST(Authenticator, TheDaemonsOwnUidNamesItsTenantUnlessTurnedOff) {
  const Authenticator on(Options(true), kDaemonUid);
  ExpectCaller(on.Identify(Unix(kDaemonUid)), "default", true);
  ExpectCaller(on.Identify(Unix(kDaemonUid, "anyone")), "anyone", false);
  ExpectCaller(on.Identify(Unix(kDaemonUid, "")), "default", true);  // empty: absent
  const Authenticator off(Options(false), kDaemonUid);
  EXPECT_THAT(off.Identify(Unix(kDaemonUid)), StatusIs(Code::kUnauthenticated, "uid 500"));
  ExpectCaller(off.Identify(Unix(kDaemonUid, std::nullopt, "Bearer alice-secret")), "alice", false);
}

TEST(Authenticator, AVerifiedCertificatesSubjectIsItsEntrysTenant) {
  const Authenticator a(Options(), kDaemonUid);
  CallCredentials call = Tcp(std::nullopt);
  call.cert_subject = "CN=dave,O=team-d";
  ExpectCaller(a.Identify(call), "dave", false);
  call.tenant_header = "alice";
  EXPECT_THAT(a.Identify(call), StatusIs(Code::kPermissionDenied,
                                         "is not the tenant of certificate \"CN=dave,O=team-d\""));
  call.tenant_header.reset();
  call.authorization = "Bearer bob-secret";  // a token, when sent, is what counts
  ExpectCaller(a.Identify(call), "bob", false);
  call.authorization.reset();
  call.cert_subject = "CN=dave,O=team-x";
  EXPECT_THAT(a.Identify(call),
              StatusIs(Code::kUnauthenticated, "\"CN=dave,O=team-x\" is in no entry"));
}

TEST(Authenticator, AMalformedTenantHeaderIsInvalidBeforeAnyCredentialCheck) {
  const Authenticator a(Options(), kDaemonUid);
  EXPECT_THAT(a.Identify(Tcp(std::nullopt, "a b")),
              StatusIs(Code::kInvalidArgument, "x-kvtier-tenant: \"a b\""));
  EXPECT_THAT(a.Identify(Unix(kDaemonUid, "x=1 level=error")),
              StatusIs(Code::kInvalidArgument, "x-kvtier-tenant"));
}

// A uid is granted nothing exactly when every call of its Unix-socket connections is refused,
// whatever the call sends: checked against Identify with each kind of header.
TEST(Authenticator, GrantsNothingToExactlyTheUidsIdentifyAlwaysRefuses) {
  ServerOptions no_tokens = Options();
  no_tokens.tokens.clear();
  ServerOptions strict = no_tokens;
  strict.same_uid_by_metadata = false;
  for (const auto& [options, label] :
       {std::pair{Options(), "tokens"}, std::pair{no_tokens, "no tokens"},
        std::pair{strict, "no tokens, same_uid_by_metadata off"}}) {
    const Authenticator a(options, kDaemonUid);
    for (const uid_t uid : {kDaemonUid, uid_t{1000}, uid_t{1002}, uid_t{1001}, uid_t{0}}) {
      bool ever = false;
      for (const auto& auth : {std::optional<absl::string_view>(),
                               std::optional<absl::string_view>("Bearer alice-secret")}) {
        for (const auto& tenant :
             {std::optional<absl::string_view>(), std::optional<absl::string_view>("carol")}) {
          ever = ever || a.Identify(Unix(uid, tenant, auth)).ok();
        }
      }
      EXPECT_EQ(a.GrantsNothingTo(uid), !ever) << label << ", uid " << uid;
    }
  }
  // The cases themselves: with tokens nobody; without, the uids in no entry.
  EXPECT_FALSE(Authenticator(Options(), kDaemonUid).GrantsNothingTo(1001));
  EXPECT_TRUE(Authenticator(no_tokens, kDaemonUid).GrantsNothingTo(1001));
  EXPECT_FALSE(Authenticator(no_tokens, kDaemonUid).GrantsNothingTo(kDaemonUid));
  EXPECT_TRUE(Authenticator(strict, kDaemonUid).GrantsNothingTo(kDaemonUid));
  EXPECT_FALSE(Authenticator(strict, kDaemonUid).GrantsNothingTo(1000));
}

// A connection's number is not the one a connection just closed had (the kernel would give
// that lowest free number again at once): a call still starting on the closed connection must
// not find the newer peer's credentials under it. Numbers come back only after a cycle.
TEST(UnixListener, ANewConnectionDoesNotTakeTheNumberOneJustClosedHad) {
  const std::string path = absl::StrCat("/tmp/kvtier-listener-test-", getpid());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<UnixListener> listener, UnixListener::Bind(path));
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int> got;
  listener->Serve([&](int fd, const PeerCredentials& cred) {
    EXPECT_EQ(cred.uid, getuid());
    close(fd);  // the connection ends before the next is accepted
    std::lock_guard lock(mu);
    got.push_back(fd);
    cv.notify_all();
  });
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  for (int i = 0; i < 3; ++i) {
    const int c = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_EQ(connect(c, reinterpret_cast<const sockaddr*>(&addr), sizeof addr), 0);
    std::unique_lock lock(mu);
    ASSERT_TRUE(
        cv.wait_for(lock, std::chrono::seconds(10), [&] { return got.size() > size_t(i); }));
    close(c);
  }
  listener->Stop();
  unlink(path.c_str());
  ASSERT_EQ(got.size(), 3u);
  EXPECT_NE(got[1], got[0]);
  EXPECT_NE(got[2], got[1]);
  EXPECT_NE(got[2], got[0]);
}

}  // namespace
}  // namespace kvtier
