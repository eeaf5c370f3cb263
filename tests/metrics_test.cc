#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/time/clock.h"
#include "server/metrics/http_exporter.h"
#include "server/metrics/registry.h"
#include "tests/test_util.h"

namespace kvtier::metrics {
namespace {

using kvtier::testing::FreePort;
using kvtier::testing::HttpGet;

TEST(Registry, RendersTheExpositionFormatExactly) {
  Registry r;
  r.GetCounter("kvtier_rpc_total", "RPCs", {{"method", "Select"}, {"code", "OK"}}).Inc(3);
  r.GetCounter("kvtier_rpc_total", "RPCs", {{"method", "Append"}, {"code", "OK"}}).Inc();
  r.GetGauge("kvtier_sessions", "Live sessions").Set(2);
  Histogram& h = r.GetHistogram("kvtier_latency_seconds", "Latency", {0.5, 1}, {{"m", "x"}});
  h.Observe(0.25);
  h.Observe(0.5);  // on the bound: counted in le="0.5"
  h.Observe(4);
  EXPECT_EQ(r.Render(),
            "# HELP kvtier_latency_seconds Latency\n"
            "# TYPE kvtier_latency_seconds histogram\n"
            "kvtier_latency_seconds_count{m=\"x\"} 3\n"
            "kvtier_latency_seconds_sum{m=\"x\"} 4.75\n"
            "kvtier_latency_seconds_bucket{m=\"x\",le=\"0.5\"} 2\n"
            "kvtier_latency_seconds_bucket{m=\"x\",le=\"1\"} 2\n"
            "kvtier_latency_seconds_bucket{m=\"x\",le=\"+Inf\"} 3\n"
            "# HELP kvtier_rpc_total RPCs\n"
            "# TYPE kvtier_rpc_total counter\n"
            "kvtier_rpc_total{code=\"OK\",method=\"Append\"} 1\n"
            "kvtier_rpc_total{code=\"OK\",method=\"Select\"} 3\n"
            "# HELP kvtier_sessions Live sessions\n"
            "# TYPE kvtier_sessions gauge\n"
            "kvtier_sessions 2\n");
}

TEST(Registry, SameNameAndLabelsIsTheSameMetric) {
  Registry r;
  Counter& a = r.GetCounter("c_total", "h", {{"t", "1"}});
  Counter& b = r.GetCounter("c_total", "h", {{"t", "1"}});
  EXPECT_EQ(&a, &b);
  EXPECT_NE(&a, &r.GetCounter("c_total", "h", {{"t", "2"}}));
  a.IncreaseTo(10);
  a.IncreaseTo(4);  // never down
  EXPECT_EQ(b.value(), 10);
}

TEST(Registry, EscapesLabelValuesAndHelp) {
  Registry r;
  r.GetGauge("g", "line1\nline2 \\ end", {{"tenant", "we\"ird\\"}}).Set(1.5);
  EXPECT_EQ(r.Render(),
            "# HELP g line1\\nline2 \\\\ end\n# TYPE g gauge\ng{tenant=\"we\\\"ird\\\\\"} 1.5\n");
}

// Special values and bucket bounds as the exposition format writes them: le="0.0025", not
// the double's 17 digits, so that {le="0.0025"} matches in a real Prometheus.
TEST(Registry, SpecialValuesAndBoundsAsPrometheusWritesThem) {
  Registry r;
  r.GetGauge("nan", "n").Set(NAN);
  r.GetGauge("inf", "i").Set(INFINITY);
  r.GetGauge("ninf", "i").Set(-INFINITY);
  r.GetHistogram("lat_seconds", "l", LatencyBuckets()).Observe(0.002);
  const std::string out = r.Render();
  // NaN in any case, as Prometheus parses it (prometheus-cpp writes "Nan").
  EXPECT_NE(absl::AsciiStrToLower(out).find("\nnan nan\n"), std::string::npos) << out;
  EXPECT_NE(out.find("\ninf +Inf\n"), std::string::npos) << out;
  EXPECT_NE(out.find("\nninf -Inf\n"), std::string::npos) << out;
  for (const char* le : {"5e-05", "0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005", "0.01",
                         "0.025", "0.05", "0.1", "0.25", "0.5", "1", "2.5", "10"}) {
    EXPECT_NE(out.find(std::string("lat_seconds_bucket{le=\"") + le + "\"}"), std::string::npos)
        << le << "\n"
        << out;
  }
  EXPECT_NE(out.find("lat_seconds_bucket{le=\"0.0025\"} 1\n"), std::string::npos) << out;
  EXPECT_NE(out.find("lat_seconds_bucket{le=\"0.001\"} 0\n"), std::string::npos) << out;
}

TEST(Registry, ScrapeHooksRunBeforeRendering) {
  Registry r;
  int scrapes = 0;
  r.OnScrape([&] { r.GetGauge("scrapes", "n").Set(++scrapes); });
  EXPECT_NE(r.Render().find("scrapes 1\n"), std::string::npos);
  EXPECT_NE(r.Render().find("scrapes 2\n"), std::string::npos);
}

TEST(Registry, ConcurrentUpdatesAreNotLost) {
  Registry r;
  Counter& c = r.GetCounter("n_total", "n");
  Histogram& h = r.GetHistogram("h", "h", {1.0});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        c.Inc();
        h.Observe(0.5);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(c.value(), 40000);
  EXPECT_EQ(h.count(), 40000u);
  EXPECT_EQ(h.sum(), 20000);
}

// A histogram observes into atomics of its own and hands them to prometheus-cpp's at each
// scrape: scrapes while threads observe count every observation once, none twice.
TEST(Registry, AHistogramScrapedWhileObservedCountsEachObservationOnce) {
  Registry r;
  Histogram& h = r.GetHistogram("lat_seconds", "l", {0.5, 1});
  std::atomic<bool> done = false;
  std::thread scraper([&] {
    while (!done.load()) r.Render();
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20000; ++i) h.Observe(t == 0 ? 0.25 : t == 1 ? 0.75 : 2.0);
    });
  }
  for (auto& t : threads) t.join();
  done = true;
  scraper.join();
  const std::string out = r.Render();
  EXPECT_NE(out.find("lat_seconds_count 60000\n"), std::string::npos) << out;
  EXPECT_NE(out.find("lat_seconds_sum 60000\n"), std::string::npos) << out;
  EXPECT_NE(out.find("lat_seconds_bucket{le=\"0.5\"} 20000\n"), std::string::npos) << out;
  EXPECT_NE(out.find("lat_seconds_bucket{le=\"1\"} 40000\n"), std::string::npos) << out;
  EXPECT_NE(out.find("lat_seconds_bucket{le=\"+Inf\"} 60000\n"), std::string::npos) << out;
  EXPECT_EQ(h.CumulativeCounts(), (std::vector<uint64_t>{20000, 40000, 60000}));
  EXPECT_EQ(r.Render(), out);  // a scrape with nothing new changes nothing
}

TEST(HttpExporter, ServesMetricsAndHealth) {
  Registry r;
  r.GetCounter("kvtier_test_total", "t").Inc(7);
  int port = FreePort();
  ASSERT_OK_AND_ASSIGN(auto exporter, HttpExporter::Start("127.0.0.1", port, &r));
  std::string body = HttpGet(port, "/metrics");
  EXPECT_NE(body.find("200 OK"), std::string::npos) << body;
  EXPECT_NE(body.find("text/plain; version=0.0.4"), std::string::npos);
  EXPECT_NE(body.find("\r\n\r\n" + r.Render()), std::string::npos) << body;
  EXPECT_NE(HttpGet(port, "/healthz").find("\r\n\r\nok\n"), std::string::npos);
  EXPECT_NE(HttpGet(port, "/readyz").find("200 OK"), std::string::npos);  // no callback: ready
  EXPECT_THAT(HttpExporter::Start("127.0.0.1", port, &r),
              testing::StatusIs(absl::StatusCode::kInternal, "metrics_port"));
  // Clients that connect and send nothing (two once held both of its threads for 30 s each)
  // hold the health probe off for the request timeout at most, more of them than it has
  // threads included.
  std::vector<int> idle;
  for (int i = 0; i < 20; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    idle.push_back(fd);
  }
  absl::SleepFor(absl::Milliseconds(100));  // each taken by a thread
  const absl::Time start = absl::Now();
  EXPECT_NE(HttpGet(port, "/healthz").find("\r\n\r\nok\n"), std::string::npos);
  EXPECT_LT(absl::Now() - start, absl::Seconds(12)) << "the probe waited on idle connections";
  for (int fd : idle) close(fd);
}

// Readiness follows its callback (the daemon's: not draining); liveness does not.
TEST(HttpExporter, ReadyzFollowsItsCallbackAndHealthzStaysOk) {
  Registry r;
  std::atomic<bool> ready = true;
  const int port = FreePort();
  ASSERT_OK_AND_ASSIGN(auto exporter,
                       HttpExporter::Start("127.0.0.1", port, &r, [&] { return ready.load(); }));
  std::string body = HttpGet(port, "/readyz");
  EXPECT_NE(body.find("HTTP/1.1 200 OK"), std::string::npos) << body;
  EXPECT_NE(body.find("\r\n\r\nready\n"), std::string::npos) << body;
  ready = false;
  body = HttpGet(port, "/readyz");
  EXPECT_NE(body.find("HTTP/1.1 503 Service Unavailable"), std::string::npos) << body;
  EXPECT_NE(body.find("\r\n\r\ndraining\n"), std::string::npos) << body;
  EXPECT_NE(HttpGet(port, "/healthz").find("\r\n\r\nok\n"), std::string::npos);
}

}  // namespace
}  // namespace kvtier::metrics
