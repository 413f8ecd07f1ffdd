// A minimal HTTP/1.1 endpoint for Prometheus scrapes: GET /metrics answers the registry's
// text exposition; any other path is 404, any other method 405. One connection at a time
// (a scrape is small and rare), each closed after its answer; a client that sends nothing
// is dropped after 2 s. Used by the coordinator and the worker (--metrics_port).
#ifndef LORASTEP_RPC_METRICS_HTTP_SERVER_H_
#define LORASTEP_RPC_METRICS_HTTP_SERVER_H_

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "lib/prometheus_registry.h"

namespace lorastep {

class MetricsHttpServer {
 public:
  // Listens on host:port (port 0: any free port). A host other than a loopback address is
  // refused unless `allow_remote` (lorastep has no authentication yet; the metrics name runs).
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& host, int port,
                                                                   const PrometheusRegistry* registry,
                                                                   bool allow_remote = false);
  ~MetricsHttpServer();
  int port() const { return port_; }

 private:
  MetricsHttpServer(int fd, int port, const PrometheusRegistry* registry)
      : fd_(fd), port_(port), registry_(registry) {}
  void Serve();
  void Answer(int client);

  int fd_;
  int port_;
  const PrometheusRegistry* registry_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace lorastep

#endif  // LORASTEP_RPC_METRICS_HTTP_SERVER_H_
