// Serves a Registry's exposition at GET /metrics over civetweb, "ok" at GET /healthz (the
// process answers: liveness), and at GET /readyz "ready", or 503 "draining" while the daemon
// drains (readiness).
#ifndef KVTIER_SERVER_METRICS_HTTP_EXPORTER_H_
#define KVTIER_SERVER_METRICS_HTTP_EXPORTER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/metrics/registry.h"

struct mg_context;
struct mg_connection;

namespace kvtier::metrics {

class HttpExporter {
 public:
  // Listens on bind_address:port. INTERNAL (naming the address) when civetweb cannot bind.
  // `registry` must outlive the exporter; `ready` (none: always) says whether /readyz is 200.
  static absl::StatusOr<std::unique_ptr<HttpExporter>> Start(const std::string& bind_address,
                                                             int port, const Registry* registry,
                                                             std::function<bool()> ready = {});
  ~HttpExporter();  // stops serving; waits for in-flight requests

  HttpExporter(const HttpExporter&) = delete;
  HttpExporter& operator=(const HttpExporter&) = delete;

 private:
  HttpExporter(mg_context* ctx, const Registry* registry, std::function<bool()> ready)
      : ctx_(ctx), registry_(registry), ready_(std::move(ready)) {}
  static int HandleMetrics(::mg_connection* conn, void* self);
  static int HandleHealth(::mg_connection* conn, void* self);
  static int HandleReady(::mg_connection* conn, void* self);

  mg_context* ctx_;
  const Registry* registry_;
  const std::function<bool()> ready_;
};

}  // namespace kvtier::metrics

#endif  // KVTIER_SERVER_METRICS_HTTP_EXPORTER_H_
