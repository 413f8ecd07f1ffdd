// Starting a gRPC server with health checking and reflection, and waiting for SIGINT/SIGTERM.
#ifndef LORASTEP_RPC_SERVER_RUNNER_H_
#define LORASTEP_RPC_SERVER_RUNNER_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <map>
#include <set>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/prometheus_registry.h"
#include "rpc/call_authenticator.h"

namespace lorastep {

// Blocks SIGINT and SIGTERM in this thread (and threads started after it); call first in main.
void BlockShutdownSignals();
// Waits until SIGINT or SIGTERM arrives; returns which and from whom ("SIGTERM from pid 12"),
// for the shutdown's log line.
std::string WaitForShutdownSignal();
// Start-up (loading a model, starting and waiting for workers) takes minutes; a shutdown
// signal then ends the process at once (exit status 143), so nothing it started is left
// running: its local workers follow it through their parent-death signal. Construct right
// after BlockShutdownSignals; Serving() hands the signals over to WaitForShutdownSignal once
// the process serves (a signal in between stays pending for it).
class StartupSignalWatcher {
 public:
  explicit StartupSignalWatcher(std::string who);
  ~StartupSignalWatcher() { Serving(); }
  StartupSignalWatcher(const StartupSignalWatcher&) = delete;
  StartupSignalWatcher& operator=(const StartupSignalWatcher&) = delete;
  void Serving();

 private:
  std::atomic<bool> serving_{false};
  std::thread thread_;
};
// Called once a shutdown has begun: if the process is still running `deadline` from now
// (a call stuck in a device kernel or a collective), it logs that and exits with status 1.
void ExitAfter(std::chrono::seconds deadline, const std::string& who);
// Per-call costs a server should not pay; call first in a server's main.
//  - Buffers up to 32 MiB stay in malloc's heap between calls instead of being mapped and
//    unmapped each time (glibc's default for large blocks): a TrainStep's request and
//    response (about 1 MB for 64 x 512 tokens) were paid for in page faults on every call.
//    Memory freed by DeleteRun is still returned (malloc_trim).
//  - absl::Mutex's deadlock detection (on in Debian's abseil build, which gRPC's locks use)
//    is switched off: it kept a lock graph on every acquisition (GraphCycles in perf).
void TuneProcessForServing();

// Binds `host:port` (port 0 = any free port), registers the services, switches on
// grpc.health.v1 and reflection. `*bound_port` receives the port.
// Requests over `max_request_bytes` are refused by gRPC (RESOURCE_EXHAUSTED) before they
// are parsed.
struct CallObservers {
  // Every call counted by method and status code (lorastep_requests_total) and timed
  // (lorastep_request_duration_seconds).
  PrometheusRegistry* metrics = nullptr;
  // One logfmt line per call on stderr (ts, component, rank, method, code, duration_ms,
  // run_id, request_id, and the message of a failure): 0 = failed calls only, 1 = every
  // call but health checks and reflection, 2 = every call, each also with end_mono_us (the
  // host's monotonic clock, to line calls up across processes); -1 = none. The --v flag.
  int log_verbosity = -1;
  std::string component;  // "coordinator" | "worker"
  int rank = -1;          // a mesh worker's rank
  // Methods served raw ("/lorastep.v1.Trainer/TrainStep"): their messages reach interceptors
  // as grpc::ByteBuffer, whose run_id and request_id are read off the wire.
  std::set<std::string> raw_methods;
  // The services this server serves ("lorastep.v1.Worker"): a call of one of their methods
  // that never reached the service is answered as refused or unparsable, not UNIMPLEMENTED.
  std::set<std::string> services;
};

// Counts, times and logs one answered call as every gRPC server's interceptor does (by
// `observers`), for calls that reach a server another way (the worker's pipe from the
// coordinator that spawned it). `method`: "Worker/TrainStep". `end`: when the call was answered
// (its log line's end_mono_us); null: now.
void ObserveCall(const CallObservers& observers, const std::string& method, const absl::Status& status,
                 double seconds, const std::string& run_id, const std::string& request_id,
                 std::optional<std::chrono::steady_clock::time_point> end = std::nullopt);

// Whether `host` names this machine's loopback interface only (127.0.0.0/8, ::1, localhost).
bool IsLoopbackHost(const std::string& host);
// `credentials`: null = plaintext; TlsServerCredentials() for TLS.
// `authenticator`: checked on every call's headers before its message is read (see
// call_authenticator.h). It rides on the credentials: TLS, or on a loopback host gRPC's
// local credentials (plaintext on the wire, peers on this machine only). A plaintext
// non-loopback server (--insecure) cannot carry it; its services still check each call.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(
    const std::string& host, int port, const std::vector<grpc::Service*>& services,
    int* bound_port, int max_request_bytes = 1 << 30, const CallObservers& observers = {},
    std::shared_ptr<grpc::ServerCredentials> credentials = nullptr,
    std::shared_ptr<const CallAuthenticator> authenticator = nullptr);
// TLS server credentials from PEM files (certificate chain and private key); errors name the
// flag (tls_cert_file / tls_key_file).
// A PEM file named by the flag `flag`: NOT_FOUND when it cannot be read, INVALID_ARGUMENT
// when it holds no PEM block of `kind`; both name the flag and the path.
enum class PemKind { kCertificate, kPrivateKey };
absl::StatusOr<std::string> ReadPemFile(const std::string& path, const char* flag, PemKind kind);

// `client_ca_file`: mutual TLS, every caller must present a certificate signed by this CA
// (empty: no client certificate asked for).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TlsServerCredentials(const std::string& cert_file,
                                                                              const std::string& key_file,
                                                                              const std::string& client_ca_file = "");
// Channel credentials that verify the server with the CA in `ca_file` (PEM, named by the
// flag `flag` in errors); plaintext when `ca_file` is empty.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFromCa(const std::string& ca_file,
                                                                                  const char* flag);

// Writes the port atomically (temp file + rename) so a parent polling the file never reads
// half of it.
absl::Status WritePortFile(const std::string& path, int port);

}  // namespace lorastep

#endif  // LORASTEP_RPC_SERVER_RUNNER_H_
