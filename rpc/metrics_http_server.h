// A minimal HTTP/1.1 endpoint for Prometheus scrapes: GET /metrics answers the registry's
// text exposition; any other path is 404, any other method 405. Each connection is answered
// on a thread of its own (at most kMaxConnections at once; more are closed at once), so an
// idle connection never delays a scrape; a connection gets 2 s in all to send its request,
// then is dropped; each is closed after its answer. Used by the coordinator and the worker
// (--metrics_port).
#ifndef LORASTEP_RPC_METRICS_HTTP_SERVER_H_
#define LORASTEP_RPC_METRICS_HTTP_SERVER_H_

#include <atomic>
#include <condition_variable>
#include <mutex>
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
  static constexpr int kMaxConnections = 16;

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
  std::mutex mu_;
  std::condition_variable idle_;
  int answering_ = 0;  // connections being answered, under mu_
};

}  // namespace lorastep

#endif  // LORASTEP_RPC_METRICS_HTTP_SERVER_H_
