#include "server/config/config.h"

#include <cmath>
#include <fstream>

#include "absl/strings/match.h"
#include "google/protobuf/text_format.h"
#include "server/config/policy.h"
#include "server/config/shape.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using testing::StatusIs;
using Code = absl::StatusCode;

TEST(Config, DefaultsValidate) {
  ASSERT_OK_AND_ASSIGN(ServerOptions o, Validate(v1::Config()));
  EXPECT_EQ(o.listen, "unix:/tmp/kvtier.sock");
  EXPECT_EQ(o.host_capacity, 4ull << 30);
  EXPECT_EQ(o.device_capacity, 1ull << 30);
  EXPECT_EQ(o.default_policy.sink_tokens(), 16u);
  EXPECT_EQ(o.default_policy.recent_window(), 64u);
  EXPECT_EQ(o.default_policy.chunk_tokens(), 16u);
  EXPECT_EQ(o.default_policy.cold_precision(), v1::PRECISION_INT4);
  EXPECT_EQ(o.RpcBufferBytes(), 512ull << 20);  // eight times the 64M max_message_size
}

// The RPC transport's bound follows max_message_size unless set.
TEST(Config, RpcBufferSizeIsEightMessagesUnlessSet) {
  ASSERT_OK_AND_ASSIGN(v1::Config small, ParseConfigText("max_message_size: \"4M\""));
  ASSERT_OK_AND_ASSIGN(ServerOptions o, Validate(small));
  EXPECT_EQ(o.RpcBufferBytes(), 32ull << 20);
  ASSERT_OK_AND_ASSIGN(v1::Config set,
                       ParseConfigText("max_message_size: \"4M\" max_rpc_buffer_size: \"8M\""));
  ASSERT_OK_AND_ASSIGN(ServerOptions s, Validate(set));
  EXPECT_EQ(s.RpcBufferBytes(), 8ull << 20);
}

// A field set to 0 where 0 means something is taken as set, not replaced by the default.
TEST(Config, ZeroWhereItMeansSomethingIsKept) {
  ASSERT_OK_AND_ASSIGN(v1::Config config,
                       ParseConfigText("drain_timeout_ms: 0 persist_interval_ms: 0"));
  ASSERT_OK_AND_ASSIGN(ServerOptions o, Validate(config));
  EXPECT_EQ(o.drain_timeout_ms, 0u);  // the default is 10 s
  EXPECT_EQ(o.persist_interval_ms, 0u);
  ASSERT_OK_AND_ASSIGN(ServerOptions d, Validate(v1::Config()));
  EXPECT_GT(d.drain_timeout_ms, 0u);
}

TEST(Config, PrintedDefaultParsesBackToTheSame) {
  std::string text;
  ASSERT_TRUE(google::protobuf::TextFormat::PrintToString(DefaultConfig(), &text));
  ASSERT_OK_AND_ASSIGN(v1::Config c, ParseConfigText(text));
  EXPECT_EQ(c.SerializeAsString(), DefaultConfig().SerializeAsString());
}

TEST(Config, ParseErrorsCarryLineAndColumn) {
  EXPECT_THAT(ParseConfigText("listen: \"unix:/x\"\nhost_capacty: \"1G\"\n"),
              StatusIs(Code::kInvalidArgument, "config 2:"));
  EXPECT_THAT(ParseConfigText("lease_ttl_ms: \"soon\""), StatusIs(Code::kInvalidArgument));
}

TEST(Config, AuthNamesUnixPeersAndTheOwnUidException) {
  ASSERT_OK_AND_ASSIGN(ServerOptions d, Validate(v1::Config()));
  EXPECT_TRUE(d.same_uid_by_metadata);  // the default keeps the single-uid sidecar working
  EXPECT_TRUE(d.unix_peers.empty());
  ASSERT_OK_AND_ASSIGN(v1::Config c,
                       ParseConfigText("auth { same_uid_by_metadata: \"off\" unix_peers { uid: "
                                       "1000 tenant: \"alice\" } unix_peers { uid: 1001 "
                                       "tenant: \"ops\" admin: true } }"));
  ASSERT_OK_AND_ASSIGN(ServerOptions o, Validate(c));
  EXPECT_FALSE(o.same_uid_by_metadata);
  using Grant = ServerOptions::Grant;
  EXPECT_EQ(o.unix_peers,
            (std::map<uint32_t, Grant>{{1000, Grant{"alice", false}}, {1001, Grant{"ops", true}}}));
}

// Segments are named files while the daemon's own uid is trusted by metadata (the default,
// which the conformance client and same-uid tools that open /dev/shm rely on), unnamed once
// that trust is off, and whatever segment_memory says when it says one.
TEST(Config, SegmentMemoryFollowsTheOwnUidExceptionUnlessNamed) {
  struct Case {
    std::string text;
    bool memfd;
  };
  const Case cases[] = {
      {"", false},
      {"segment_memory: \"auto\"", false},
      {"auth { same_uid_by_metadata: \"off\" }", true},
      {"segment_memory: \"named\" auth { same_uid_by_metadata: \"off\" }", false},
      {"segment_memory: \"memfd\"", true},
      {"segment_memory: \"memfd\" auth { same_uid_by_metadata: \"on\" }", true},
      // Descriptors travel over the Unix socket only: a TCP-only daemon keeps names.
      {"listen: \"127.0.0.1:5000\" tcp_plaintext: \"on\" auth { same_uid_by_metadata: \"off\" }",
       false},
  };
  for (const Case& c : cases) {
    ASSERT_OK_AND_ASSIGN(v1::Config config, ParseConfigText(c.text));
    ASSERT_OK_AND_ASSIGN(ServerOptions o, Validate(config));
    EXPECT_EQ(o.memfd_segments, c.memfd) << c.text;
  }
}

// A token entry keeps its salt and the digest's 32 bytes, decoded from the hex.
TEST(Config, AuthTokensKeepSaltAndDigestBytes) {
  ASSERT_OK_AND_ASSIGN(
      v1::Config c,
      ParseConfigText("auth { tokens { tenant: \"alice\" salt: \"0123456789abcdefXYZ\" sha256: "
                      "\"ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad\" "
                      "admin: true } }"));
  ASSERT_OK_AND_ASSIGN(ServerOptions o, Validate(c));
  ASSERT_EQ(o.tokens.size(), 1u);
  EXPECT_EQ(o.tokens[0].grant, (ServerOptions::Grant{"alice", true}));
  EXPECT_EQ(o.tokens[0].salt, "0123456789abcdefXYZ");
  EXPECT_EQ(o.tokens[0].sha256[0], 0xba);
  EXPECT_EQ(o.tokens[0].sha256[1], 0x78);
  EXPECT_EQ(o.tokens[0].sha256[31], 0xad);
}

TEST(Config, EveryBadFieldIsNamed) {
  struct Case {
    const char* text;
    const char* field;
  } cases[] = {
      {"listen: \"nowhere\"", "listen"},
      {"listen: \"unix:\"", "listen"},
      {"listen: \"localhost:70000\"", "listen"},
      {"tcp_listen: \"unix:/x\"", "tcp_listen"},
      {"instance: \"has space\"", "instance"},
      {"host_capacity: \"12Q\"", "host_capacity"},
      {"host_capacity: \"16777215T\"", "host_capacity: \"16777215T\" is above 1P"},
      {"device_capacity: \"2000T\"", "device_capacity"},
      {"device_capacity: \"lots\"", "device_capacity"},
      {"segment_size: \"100K\"", "segment_size"},
      {"segment_size: \"1000001\"", "segment_size"},
      {"max_message_size: \"3G\"", "max_message_size"},
      {"remote: \"http://x\"", "remote"},
      {"lease_ttl_ms: 700000", "lease_ttl_ms"},
      {"max_lease_ms: 90000000", "max_lease_ms"},
      {"metrics_port: 70000", "metrics_port"},
      {"log_level: \"loud\"", "log_level"},
      {"eviction_policy: \"fifo\"", "eviction_policy"},
      {"prefetch: \"maybe\"", "prefetch"},
      {"channel_colocate: \"always\"", "channel_colocate"},
      {"max_import_size: \"0\"", "max_import_size: \"0\" is outside [1, 1T]"},
      {"max_import_size: \"some\"", "max_import_size"},
      {"transfer_idle_timeout_ms: 500", "transfer_idle_timeout_ms: \"500\" is below 1000"},
      {"max_rpc_buffer_size: \"100M\"",
       "max_rpc_buffer_size: \"100M\" is outside [2 * max_message_size (134217728 bytes), 1T]"},
      {"max_message_size: \"16M\" max_rpc_buffer_size: \"16M\"", "max_rpc_buffer_size"},
      {"max_rpc_buffer_size: \"2T\"", "max_rpc_buffer_size"},
      {"max_rpc_buffer_size: \"much\"", "max_rpc_buffer_size"},
      {"max_connections_per_uid: 0", "max_connections_per_uid: \"0\" is outside [1, 4096]"},
      {"max_connections_per_uid: 4097", "max_connections_per_uid"},
      {"drain_to_remote: \"later\"", "drain_to_remote"},
      {"remote_connections: 65", "remote_connections"},
      {"remote_timeout_ms: 5", "remote_timeout_ms"},
      {"persist_interval_ms: 1000", "persist_interval_ms: \"1000\" needs a remote tier"},
      {"quotas { key: \"a b\" value { } }", "quotas[\"a b\"]"},
      {"quotas { key: \"alice\" value { host_bytes: \"lots\" } }", "quotas[\"alice\"].host_bytes"},
      {"quotas { key: \"*\" value { device_bytes: \"0\" } }",
       "quotas[\"*\"].device_bytes: \"0\" is 0, which is not a quota"},
      {"default_policy { chunk_tokens: 65 }", "default_policy.chunk_tokens"},
      {"default_policy { chunking: CHUNKING_BOUNDARY }", "default_policy.delimiter_token_ids"},
      {"default_policy { chunking: CHUNKING_BOUNDARY chunk_tokens: 40 delimiter_token_ids: 13 }",
       "default_policy.chunk_tokens"},
      {"default_policy { cold_precision: PRECISION_BF16 }", "default_policy.cold_precision"},
      {"auth { same_uid_by_metadata: \"yes\" }", "auth.same_uid_by_metadata"},
      {"auth { unix_peers { uid: 7 tenant: \"a b\" } }", "auth.unix_peers[0].tenant"},
      {"auth { unix_peers { uid: 7 } }", "auth.unix_peers[0].tenant"},
      {"auth { unix_peers { uid: 7 tenant: \"a\" } unix_peers { uid: 7 tenant: \"b\" } }",
       "auth.unix_peers[1].uid"},
      {"auth { tokens { tenant: \"a b\" } }", "auth.tokens[0].tenant"},
      {"auth { tokens { tenant: \"a\" salt: \"short\" } }", "auth.tokens[0].salt"},
      {"auth { tokens { tenant: \"a\" salt: \"0123456789abcdef/\" } }", "auth.tokens[0].salt"},
      {"auth { tokens { tenant: \"a\" salt: \"0123456789abcdef\" sha256: \"abc\" } }",
       "auth.tokens[0].sha256"},
      {"auth { tokens { tenant: \"a\" salt: \"0123456789abcdef\" sha256: "
       "\"BA7816BF8F01CFEA414140DE5DAE2223B00361A396177A9CB410FF61F20015AD\" } }",
       "auth.tokens[0].sha256"},
      {"auth { tokens { tenant: \"a\" salt: \"0123456789abcdef\" sha256: "
       "\"ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad\" } tokens { tenant: "
       "\"b\" salt: \"0123456789abcdef\" sha256: "
       "\"ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad\" } }",
       "auth.tokens[1].sha256"},
      {"tcp_listen: \"127.0.0.1:5000\"", "tcp_listen: \"127.0.0.1:5000\" is TCP, which needs tls"},
      {"listen: \"127.0.0.1:5000\"", "listen: \"127.0.0.1:5000\" is TCP"},
      {"tcp_plaintext: \"maybe\"", "tcp_plaintext"},
      {"segment_memory: \"files\"", "segment_memory: \"files\" is not one of auto, named, memfd"},
      {"listen: \"127.0.0.1:5000\" tcp_plaintext: \"on\" segment_memory: \"memfd\"",
       "segment_memory: \"memfd\" needs a Unix-socket listen"},
      {"tls { cert_file: \"/x\" }", "tls.key_file"},
      {"tls { client_ca_file: \"/x\" }", "tls.client_ca_file"},
      {"tls { cert_file: \"/a\" key_file: \"/b\" }", "tls.cert_file: \"/a\" is set, but no"},
      {"tcp_listen: \"127.0.0.1:5000\" tls { cert_file: \"/a\" key_file: \"/b\" refresh_s: 99 }",
       "tls.refresh_s"},
      {"auth { cert_subjects { subject: \"CN=a\" tenant: \"a\" } }", "auth.cert_subjects"},
      {"auth { cert_subjects { tenant: \"a\" } }", "auth.cert_subjects[0].subject"},
      {"auth { cert_subjects { subject: \"CN=a\" tenant: \"a b\" } }",
       "auth.cert_subjects[0].tenant"},
      // Set to 0 or "" is taken as set (it once took the default without a word), and checked.
      {"max_sessions: 0", "max_sessions: \"0\" must be at least 1"},
      {"lease_ttl_ms: 0", "lease_ttl_ms"},
      {"max_lease_ms: 0", "max_lease_ms"},
      {"eviction_half_life_ms: 0", "eviction_half_life_ms"},
      {"max_leases_per_tenant: 0", "max_leases_per_tenant"},
      {"remote_connections: 0", "remote_connections"},
      {"remote_timeout_ms: 0", "remote_timeout_ms"},
      {"listen: \"\"", "listen"},
      {"instance: \"\"", "instance"},
      {"host_capacity: \"\"", "host_capacity"},
      {"metrics_bind: \"\"", "metrics_bind"},
      {"log_level: \"\"", "log_level"},
  };
  for (const Case& c : cases) {
    ASSERT_OK_AND_ASSIGN(v1::Config config, ParseConfigText(c.text));
    auto r = Validate(config);
    EXPECT_FALSE(r.ok()) << c.text;
    EXPECT_THAT(std::string(r.status().message()), ::testing::StartsWith(c.field)) << c.text;
  }
}

TEST(Config, RemoteAddressIsChecked) {
  ASSERT_OK_AND_ASSIGN(v1::Config c, ParseConfigText("remote: \"redis://127.0.0.1:6379\""));
  ASSERT_OK_AND_ASSIGN(ServerOptions o, Validate(c));
  EXPECT_EQ(o.remote, "redis://127.0.0.1:6379");
  ASSERT_OK_AND_ASSIGN(c, ParseConfigText("remote: \"memcached://x\""));
  EXPECT_THAT(Validate(c), StatusIs(Code::kInvalidArgument, "remote"));
}

TEST(Config, QuotasParsePerTenantWithAWildcard) {
  ASSERT_OK_AND_ASSIGN(
      v1::Config c,
      ParseConfigText("quotas { key: \"alice\" value { host_bytes: \"64M\" max_sessions: 3 } }\n"
                      "quotas { key: \"*\" value { device_bytes: \"1G\" } }\n"));
  ASSERT_OK_AND_ASSIGN(ServerOptions o, Validate(c));
  EXPECT_EQ(o.QuotaFor("alice").host_bytes, 64u << 20);
  EXPECT_EQ(o.QuotaFor("alice").device_bytes, 0u);
  EXPECT_EQ(o.QuotaFor("alice").max_sessions, 3u);
  EXPECT_EQ(o.QuotaFor("bob").device_bytes, 1u << 30);
  EXPECT_EQ(o.QuotaFor("bob").host_bytes, 0u);
  ASSERT_OK_AND_ASSIGN(ServerOptions none, Validate(v1::Config()));
  EXPECT_EQ(none.QuotaFor("anyone").host_bytes, 0u);
}

// kvtierd --help: every flag of the Config message, with its default (as DefaultConfig has it)
// and a line saying what it does (its comment in config.proto); message fields as file-only.
TEST(CommandLine, HelpGivesEveryFlagItsDefaultAndMeaning) {
  const std::string help = Usage();
  const v1::Config defaults = DefaultConfig();
  const auto* desc = v1::Config::descriptor();
  for (int i = 0; i < desc->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = desc->field(i);
    if (f->type() == google::protobuf::FieldDescriptor::TYPE_MESSAGE) {
      EXPECT_NE(help.find(f->name()), std::string::npos) << f->name();
      continue;
    }
    std::string def;
    google::protobuf::TextFormat::PrintFieldValueToString(defaults, f, -1, &def);
    const std::string head = "  --" + f->name() + " (default " + def + ")\n";
    const size_t at = help.find(head);
    ASSERT_NE(at, std::string::npos) << head << help;
    const size_t next = help.find('\n', at + head.size());
    const std::string meaning = help.substr(at + head.size(), next - at - head.size());
    EXPECT_TRUE(absl::StartsWith(meaning, "      ") && meaning.size() > 12) << f->name();
  }
  ASSERT_OK_AND_ASSIGN(CommandLine version, ParseCommandLine({"--version"}));
  EXPECT_TRUE(version.version);
}

TEST(CommandLine, FlagsOverrideTheFile) {
  testing::TempDir dir;
  std::string path = dir.path() + "/kvtierd.conf";
  std::ofstream(path) << "host_capacity: \"2G\"\nlease_ttl_ms: 5000\ninstance: \"file\"\n";
  ASSERT_OK_AND_ASSIGN(CommandLine cl, ParseCommandLine({"--host_capacity", "512M", "--config",
                                                         path, "--metrics_port=9464"}));
  ASSERT_OK_AND_ASSIGN(ServerOptions o, Validate(cl.config));
  EXPECT_EQ(o.host_capacity, 512ull << 20);  // flag wins, wherever it stands
  EXPECT_EQ(o.lease_ttl_ms, 5000u);          // from the file
  EXPECT_EQ(o.instance, "file");
  EXPECT_EQ(o.metrics_port, 9464u);
}

TEST(CommandLine, Errors) {
  EXPECT_THAT(ParseCommandLine({"--no_such_flag", "1"}),
              StatusIs(Code::kInvalidArgument, "no_such_flag"));
  EXPECT_THAT(ParseCommandLine({"--lease_ttl_ms"}), StatusIs(Code::kInvalidArgument, "value"));
  EXPECT_THAT(ParseCommandLine({"--lease_ttl_ms", "-3"}),
              StatusIs(Code::kInvalidArgument, "lease_ttl_ms"));
  EXPECT_THAT(ParseCommandLine({"--config", "/nonexistent/kvtierd.conf"}),
              StatusIs(Code::kInvalidArgument, "/nonexistent/kvtierd.conf"));
  EXPECT_THAT(ParseCommandLine({"stray"}), StatusIs(Code::kInvalidArgument, "stray"));
  // An empty path (an unset variable) or a second file is an error, not no file or the last.
  EXPECT_THAT(ParseCommandLine({"--config", ""}),
              StatusIs(Code::kInvalidArgument, "config: \"\" names no file"));
  EXPECT_THAT(ParseCommandLine({"--config", "/a.conf", "--config=/b.conf"}),
              StatusIs(Code::kInvalidArgument, "is a second file, after \"/a.conf\""));
  ASSERT_OK_AND_ASSIGN(CommandLine cl, ParseCommandLine({"--print_default_config"}));
  EXPECT_TRUE(cl.print_default_config);
}

TEST(Policy, ZeroTakesTheDefaultAndResultIsChecked) {
  v1::SessionPolicy req;
  req.set_recent_window(128);
  ASSERT_OK_AND_ASSIGN(v1::SessionPolicy p, ResolvePolicy(req, BuiltinPolicy(), "policy"));
  EXPECT_EQ(p.recent_window(), 128u);
  EXPECT_EQ(p.sink_tokens(), 16u);
  EXPECT_EQ(p.default_budget(), 256u);
  EXPECT_EQ(p.ranking(), v1::RANKING_LSE_PEAK);
  req.set_ranking(v1::RANKING_MEAN);
  ASSERT_OK_AND_ASSIGN(p, ResolvePolicy(req, BuiltinPolicy(), "policy"));
  EXPECT_EQ(p.ranking(), v1::RANKING_MEAN);
  req.set_ranking(static_cast<v1::Ranking>(7));
  EXPECT_THAT(ResolvePolicy(req, BuiltinPolicy(), "policy"),
              StatusIs(Code::kInvalidArgument, "policy.ranking"));
  req.set_ranking(v1::RANKING_UNSPECIFIED);
  req.set_chunk_tokens(100);
  EXPECT_THAT(ResolvePolicy(req, BuiltinPolicy(), "policy"),
              StatusIs(Code::kInvalidArgument, "policy.chunk_tokens"));
}

TEST(ResolvePolicy, RefinementKnobsDefaultAndNameTheField) {
  ASSERT_OK_AND_ASSIGN(v1::SessionPolicy p, ResolvePolicy({}, BuiltinPolicy(), "policy"));
  EXPECT_EQ(p.refine_factor(), 8u);  // docs/QUALITY.md: rows from a pool of 8x the budget
  EXPECT_EQ(p.refine_score(), v1::REFINE_SCORE_MEAN_MASS);
  EXPECT_EQ(p.chunking(), v1::CHUNKING_SEMANTIC);
  v1::SessionPolicy want;
  want.set_refine_factor(64);
  want.set_refine_score(v1::REFINE_SCORE_MEAN_MASS);
  ASSERT_OK_AND_ASSIGN(p, ResolvePolicy(want, BuiltinPolicy(), "policy"));
  EXPECT_EQ(p.refine_factor(), 64u);
  EXPECT_EQ(p.refine_score(), v1::REFINE_SCORE_MEAN_MASS);
  want.set_refine_factor(65);
  EXPECT_THAT(ResolvePolicy(want, BuiltinPolicy(), "policy"),
              StatusIs(Code::kInvalidArgument, "policy.refine_factor: 65 is above 64"));
  want.set_refine_factor(4);
  want.set_refine_score(static_cast<v1::RefineScore>(7));
  EXPECT_THAT(ResolvePolicy(want, BuiltinPolicy(), "policy"),
              StatusIs(Code::kInvalidArgument, "policy.refine_score"));
  want.set_refine_score(v1::REFINE_SCORE_MAX);
  EXPECT_EQ(ResolvePolicy(want, BuiltinPolicy(), "policy")->mass_target(), 0.f);  // off
  for (float bad : {-0.1f, 1.5f, std::nanf("")}) {
    want.set_mass_target(bad);
    EXPECT_THAT(ResolvePolicy(want, BuiltinPolicy(), "policy"),
                StatusIs(Code::kInvalidArgument, "policy.mass_target"))
        << bad;
  }
  want.set_mass_target(0.9f);
  EXPECT_EQ(ResolvePolicy(want, BuiltinPolicy(), "policy")->mass_target(), 0.9f);
  // Layer budgets: equal by default; by need only with something that measures it.
  EXPECT_EQ(ResolvePolicy(want, BuiltinPolicy(), "policy")->layer_budget(), v1::LAYER_BUDGET_EQUAL);
  want.set_layer_budget(v1::LAYER_BUDGET_BY_NEED);
  EXPECT_EQ(ResolvePolicy(want, BuiltinPolicy(), "policy")->layer_budget(),
            v1::LAYER_BUDGET_BY_NEED);
  want.set_layer_budget(static_cast<v1::LayerBudget>(9));
  EXPECT_THAT(ResolvePolicy(want, BuiltinPolicy(), "policy"),
              StatusIs(Code::kInvalidArgument, "policy.layer_budget: 9 is not one of"));
  v1::SessionPolicy whole;
  whole.set_refine_factor(1);
  whole.set_layer_budget(v1::LAYER_BUDGET_BY_NEED);
  EXPECT_THAT(ResolvePolicy(whole, BuiltinPolicy(), "policy"),
              StatusIs(Code::kInvalidArgument,
                       "policy.layer_budget: LAYER_BUDGET_BY_NEED needs refinement"));
  whole.set_mass_target(0.95f);  // a mass target refines within the chunks
  EXPECT_OK(ResolvePolicy(whole, BuiltinPolicy(), "policy").status());
}

TEST(ResolveShape, ChecksEveryField) {
  auto shape = [](int l, int q, int kv, int d, v1::DType t = v1::DTYPE_FP16) {
    v1::ModelShape s;
    s.set_num_layers(l);
    s.set_num_q_heads(q);
    s.set_num_kv_heads(kv);
    s.set_head_dim(d);
    s.set_dtype(t);
    return s;
  };
  EXPECT_OK(ResolveShape(shape(30, 9, 3, 64)).status());
  EXPECT_EQ(ResolveShape(shape(1, 1, 1, 1, v1::DTYPE_UNSPECIFIED))->dtype(), v1::DTYPE_FP16);
  EXPECT_THAT(ResolveShape(shape(0, 9, 3, 64)), StatusIs(Code::kInvalidArgument, "num_layers"));
  EXPECT_THAT(ResolveShape(shape(2, 4, 3, 64)), StatusIs(Code::kInvalidArgument, "num_q_heads"));
  EXPECT_THAT(ResolveShape(shape(2, 0, 3, 64)), StatusIs(Code::kInvalidArgument, "num_q_heads"));
  EXPECT_THAT(ResolveShape(shape(2, 4, 0, 64)), StatusIs(Code::kInvalidArgument, "num_kv_heads"));
  EXPECT_THAT(ResolveShape(shape(2, 4, 2, 0)), StatusIs(Code::kInvalidArgument, "head_dim"));
  EXPECT_THAT(ResolveShape(shape(2, 4, 2, 513)), StatusIs(Code::kInvalidArgument, "head_dim"));
  EXPECT_OK(ResolveShape(shape(2, 4, 2, 512)).status());
  EXPECT_THAT(ResolveShape(shape(2, 4, 2, 64, v1::DTYPE_FP32)),
              StatusIs(Code::kInvalidArgument, "dtype"));
}

}  // namespace
}  // namespace kvtier
