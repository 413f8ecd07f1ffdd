#include "rpc/server_runner.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/support/server_interceptor.h>
#include <signal.h>
#include <stdio.h>

#include <chrono>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "lib/io/file_util.h"
#include "lib/status_macros.h"

namespace lorastep {
namespace {

sigset_t ShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

// Counts every call by method and status code, and its duration, as the server sends the
// status: one place for all services of a binary.
class RequestMetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  RequestMetricsInterceptor(const std::string& method, PrometheusRegistry* metrics)
      : method_(method), metrics_(metrics), start_(std::chrono::steady_clock::now()) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      const std::string code = absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code()));
      metrics_->Add("lorastep_requests_total", {{"method", method_}, {"code", code}});
      metrics_->Observe("lorastep_request_duration_seconds", {{"method", method_}},
                        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
    }
    methods->Proceed();
  }

 private:
  std::string method_;
  PrometheusRegistry* metrics_;
  std::chrono::steady_clock::time_point start_;
};

class RequestMetricsFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RequestMetricsFactory(PrometheusRegistry* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    // "/lorastep.v1.Trainer/TrainStep" -> "Trainer/TrainStep"
    std::string method = info->method() != nullptr ? info->method() : "unknown";
    const size_t slash = method.rfind('/');
    const size_t dot = method.rfind('.', slash);
    if (slash != std::string::npos && dot != std::string::npos) method = method.substr(dot + 1);
    return new RequestMetricsInterceptor(method, metrics_);
  }

 private:
  PrometheusRegistry* metrics_;
};

}  // namespace

void DeclareRequestMetrics(PrometheusRegistry* metrics) {
  metrics->Declare("lorastep_requests_total", PrometheusRegistry::Type::kCounter,
                   "gRPC calls answered, by method and status code");
  metrics->Declare("lorastep_request_duration_seconds", PrometheusRegistry::Type::kHistogram,
                   "gRPC call duration from arrival to status, seconds", PrometheusRegistry::SecondsBuckets());
}

void BlockShutdownSignals() {
  sigset_t set = ShutdownSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

void WaitForShutdownSignal() {
  sigset_t set = ShutdownSignals();
  int sig = 0;
  sigwait(&set, &sig);
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(
    const std::string& host, int port, const std::vector<grpc::Service*>& services,
    int* bound_port, int max_request_bytes, PrometheusRegistry* metrics) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat(host, ":", port), grpc::InsecureServerCredentials(),
                           bound_port);
  // Rollout batches: 64 x 512 tokens with four float fields is ~1 MB; the coordinator's
  // default limit is 64 MiB (--max_request_mb), a worker's 1 GiB (the coordinator's calls).
  builder.SetMaxReceiveMessageSize(max_request_bytes);
  builder.SetMaxSendMessageSize(1 << 30);
  for (grpc::Service* s : services) builder.RegisterService(s);
  if (metrics != nullptr) {
    DeclareRequestMetrics(metrics);
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(std::make_unique<RequestMetricsFactory>(metrics));
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *bound_port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", host, ":", port));
  }
  return server;
}

absl::Status WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  LORASTEP_RETURN_IF_ERROR(WriteStringToFile(tmp, absl::StrCat(port, "\n")));
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat(path, ": cannot write port file"));
  }
  return absl::OkStatus();
}

std::map<std::string, std::string> ParseFlags(int argc, char** argv) {
  std::map<std::string, std::string> flags;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0) continue;
    arg = arg.substr(2);
    const auto eq = arg.find('=');
    if (eq != std::string::npos) {
      flags[arg.substr(0, eq)] = arg.substr(eq + 1);
    } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
      flags[arg] = argv[++i];
    } else {
      flags[arg] = "true";
    }
  }
  return flags;
}

}  // namespace lorastep
