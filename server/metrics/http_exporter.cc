#include "server/metrics/http_exporter.h"

#include <civetweb.h>

#include <mutex>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvtier::metrics {
namespace {

void Reply(mg_connection* conn, const char* content_type, const std::string& body,
           const char* status = "200 OK") {
  mg_printf(conn,
            "HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
            "Connection: close\r\n\r\n",
            status, content_type, body.size());
  mg_write(conn, body.data(), body.size());
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpExporter>> HttpExporter::Start(const std::string& bind_address,
                                                                  int port,
                                                                  const Registry* registry,
                                                                  std::function<bool()> ready) {
  static std::once_flag init;
  std::call_once(init, [] { mg_init_library(0); });
  // An IPv6 literal in brackets, as civetweb reads a port's address.
  const bool v6 = absl::StrContains(bind_address, ':') && !absl::StartsWith(bind_address, "[");
  std::string ports =
      v6 ? absl::StrCat("[", bind_address, "]:", port) : absl::StrCat(bind_address, ":", port);
  // Threads enough, and a request's wait bounded, that a few clients connecting and sending
  // nothing never hold the health probe off (civetweb's own default waits 30 s per request).
  const char* options[] = {"listening_ports",    ports.c_str(), "num_threads", "16",
                           "request_timeout_ms", "5000",        nullptr};
  mg_callbacks callbacks{};
  callbacks.log_message = [](const mg_connection*, const char*) { return 1; };  // quiet
  mg_context* ctx = mg_start(&callbacks, nullptr, options);
  if (ctx == nullptr) {
    return absl::InternalError(
        absl::StrCat("metrics_port, metrics_bind: cannot serve HTTP on ", ports,
                     " (in use, not permitted, or not an address of this host)"));
  }
  auto exporter = std::unique_ptr<HttpExporter>(new HttpExporter(ctx, registry, std::move(ready)));
  mg_set_request_handler(ctx, "/metrics$", &HttpExporter::HandleMetrics, exporter.get());
  mg_set_request_handler(ctx, "/healthz$", &HttpExporter::HandleHealth, exporter.get());
  mg_set_request_handler(ctx, "/readyz$", &HttpExporter::HandleReady, exporter.get());
  return exporter;
}

HttpExporter::~HttpExporter() { mg_stop(ctx_); }

int HttpExporter::HandleMetrics(mg_connection* conn, void* self) {
  Reply(conn, "text/plain; version=0.0.4; charset=utf-8",
        static_cast<HttpExporter*>(self)->registry_->Render());
  return 200;
}

int HttpExporter::HandleHealth(mg_connection* conn, void*) {
  Reply(conn, "text/plain", "ok\n");
  return 200;
}

int HttpExporter::HandleReady(mg_connection* conn, void* self) {
  const auto& ready = static_cast<HttpExporter*>(self)->ready_;
  if (ready && !ready()) {
    Reply(conn, "text/plain", "draining\n", "503 Service Unavailable");
    return 503;
  }
  Reply(conn, "text/plain", "ready\n");
  return 200;
}

}  // namespace kvtier::metrics
