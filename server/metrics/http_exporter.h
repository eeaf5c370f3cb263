// Serves a Registry's exposition at GET /metrics (and "ok" at GET /healthz) over civetweb.
#ifndef KVTIER_SERVER_METRICS_HTTP_EXPORTER_H_
#define KVTIER_SERVER_METRICS_HTTP_EXPORTER_H_

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
  // `registry` must outlive the exporter.
  static absl::StatusOr<std::unique_ptr<HttpExporter>> Start(const std::string& bind_address,
                                                             int port, const Registry* registry);
  ~HttpExporter();  // stops serving; waits for in-flight requests

  HttpExporter(const HttpExporter&) = delete;
  HttpExporter& operator=(const HttpExporter&) = delete;

 private:
  HttpExporter(mg_context* ctx, const Registry* registry) : ctx_(ctx), registry_(registry) {}
  static int HandleMetrics(::mg_connection* conn, void* self);
  static int HandleHealth(::mg_connection* conn, void* self);

  mg_context* ctx_;
  const Registry* registry_;
};

}  // namespace kvtier::metrics

#endif  // KVTIER_SERVER_METRICS_HTTP_EXPORTER_H_
