#include "rpc/server_runner.h"

#include <malloc.h>

#include "lib/log.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/support/server_interceptor.h>
#include <signal.h>
#include <unistd.h>
#include <stdio.h>

#include <chrono>
#include <thread>

#include <cstdio>
#include <ctime>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/message.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <map>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "lib/io/file_util.h"
#include "lib/status_macros.h"
#include "rpc/serial_executor.h"
#include "rpc/grpc_status.h"

namespace lorastep {
namespace {

sigset_t ShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

std::string NowIso8601() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const int ms = static_cast<int>(
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm tm;
  gmtime_r(&t, &tm);
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1,
                tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
  return buf;
}

// logfmt value: bare when plain, else quoted with \ and " escaped and newlines as \n.
std::string LogValue(const std::string& v) {
  const bool plain = !v.empty() && v.find_first_of(" \"=\\\n\t") == std::string::npos;
  if (plain) return v;
  std::string out = "\"";
  for (char c : v.substr(0, 512)) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out + "\"";
}

// A request's string field `name`, or that of its `mesh` header (worker calls).
std::string RequestField(const google::protobuf::Message* m, const std::string& name) {
  if (m == nullptr) return "";
  const google::protobuf::Descriptor* d = m->GetDescriptor();
  const google::protobuf::Reflection* r = m->GetReflection();
  if (const auto* f = d->FindFieldByName(name); f != nullptr && f->type() == google::protobuf::FieldDescriptor::TYPE_STRING &&
                                                !f->is_repeated()) {
    return r->GetString(*m, f);
  }
  if (const auto* mesh = d->FindFieldByName("mesh"); mesh != nullptr &&
                                                     mesh->type() == google::protobuf::FieldDescriptor::TYPE_MESSAGE &&
                                                     !mesh->is_repeated() && r->HasField(*m, mesh)) {
    return RequestField(&r->GetMessage(*m, mesh), name);
  }
  return "";
}

// The top-level string fields `names` of a serialized message of type `type` (a raw
// method's request), read off the wire without parsing the rest.
std::map<std::string, std::string> StringFieldsFromWire(const grpc::ByteBuffer& raw,
                                                        const google::protobuf::Descriptor* type,
                                                        const std::vector<std::string>& names) {
  std::map<int, std::string> wanted;
  for (const std::string& name : names) {
    if (const auto* f = type->FindFieldByName(name); f != nullptr) wanted[f->number()] = name;
  }
  std::map<std::string, std::string> out;
  grpc::ByteBuffer copy(raw);  // shares the slices; the reader needs a mutable buffer
  grpc::ProtoBufferReader reader(&copy);
  google::protobuf::io::CodedInputStream in(&reader);
  while (const uint32_t tag = in.ReadTag()) {
    const int number = google::protobuf::internal::WireFormatLite::GetTagFieldNumber(tag);
    const auto it = wanted.find(number);
    if (it != wanted.end() && google::protobuf::internal::WireFormatLite::GetTagWireType(tag) ==
                                  google::protobuf::internal::WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      uint32_t length = 0;
      if (!in.ReadVarint32(&length) || length > 4096 || !in.ReadString(&out[it->second], static_cast<int>(length))) break;
      continue;
    }
    if (!google::protobuf::internal::WireFormatLite::SkipField(&in, tag)) break;
  }
  return out;
}

}  // namespace

void ObserveCall(const CallObservers& observers, const std::string& method, const absl::Status& status,
                 double seconds, const std::string& run_id, const std::string& request_id,
                 std::optional<std::chrono::steady_clock::time_point> end) {
  const std::string code = absl::StatusCodeToString(status.code());
  if (PrometheusRegistry* metrics = observers.metrics) {
    metrics->Add("lorastep_requests_total", {{"method", method}, {"code", code}});
    metrics->Observe("lorastep_request_duration_seconds", {{"method", method}}, seconds);
  }
  const int v = observers.log_verbosity;
  const bool housekeeping = method.rfind("Health/", 0) == 0 || method.find("Reflection") != std::string::npos;
  if (v < 0 || (v == 0 && status.ok()) || (v == 1 && housekeeping && status.ok())) return;
  std::string line = absl::StrCat("ts=", NowIso8601(), " level=", status.ok() ? "info" : "warn",
                                  " component=", LogValue(observers.component));
  if (observers.rank >= 0) absl::StrAppend(&line, " rank=", observers.rank);
  absl::StrAppend(&line, " method=", method, " code=", code, " duration_ms=", absl::StrFormat("%.3f", seconds * 1e3));
  if (v >= 2) {  // the call's end on the host's monotonic clock, which every process here shares
    absl::StrAppend(&line, " end_mono_us=",
                    std::chrono::duration_cast<std::chrono::microseconds>(
                        end.value_or(std::chrono::steady_clock::now()).time_since_epoch()).count());
  }
  if (!run_id.empty()) absl::StrAppend(&line, " run_id=", LogValue(run_id));
  if (!request_id.empty()) absl::StrAppend(&line, " request_id=", LogValue(request_id));
  if (!status.ok()) absl::StrAppend(&line, " msg=", LogValue(std::string(status.message())));
  if (status.ok()) {
    LORASTEP_LOG(Info) << line;
  } else {
    LORASTEP_LOG(Warning) << line;
  }
}

namespace {

// Counts every call by method and status code, times it, and logs it, as the server sends
// the status: one place for all services of a binary.
class CallInterceptor final : public grpc::experimental::Interceptor {
 public:
  // `own`: a lorastep service, whose requests are protobuf messages (gRPC's health service
  // hands interceptors a raw byte buffer instead).
  // `raw_request`: the request type of a raw method (its message is a grpc::ByteBuffer).
  // `request_type`: the request type of a lorastep method this server serves (null: none).
  // `authenticator` (may be null) and `path`, `ctx`: to tell a refused caller from a request
  // that does not parse, which gRPC answers alike.
  CallInterceptor(std::string method, bool own, const google::protobuf::Descriptor* raw_request,
                  const google::protobuf::Descriptor* request_type, const CallObservers* observers,
                  const CallAuthenticator* authenticator, std::string path, grpc::ServerContextBase* ctx)
      : method_(std::move(method)), own_(own), raw_request_(raw_request), request_type_(request_type),
        observers_(observers), authenticator_(authenticator), path_(std::move(path)), ctx_(ctx),
        start_(std::chrono::steady_clock::now()) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (own_ && methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) &&
        observers_->log_verbosity >= 0 && methods->GetRecvMessage() != nullptr) {
      if (raw_request_ != nullptr) {
        auto fields = StringFieldsFromWire(*static_cast<const grpc::ByteBuffer*>(methods->GetRecvMessage()),
                                           raw_request_, {"run_id", "request_id"});
        run_id_ = fields["run_id"];
        request_id_ = fields["request_id"];
      } else {
        const auto* m = static_cast<const google::protobuf::Message*>(methods->GetRecvMessage());
        run_id_ = RequestField(m, "run_id");
        request_id_ = RequestField(m, "request_id");
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      grpc::Status status = methods->GetSendStatus();
      // gRPC answers a call whose message never reached the service with a bare
      // UNIMPLEMENTED: a caller the headers' check refused, or a request that does not parse
      // (malformed, or nested past protobuf's recursion limit). Each gets its own answer.
      if (request_type_ != nullptr && status.error_code() == grpc::StatusCode::UNIMPLEMENTED &&
          status.error_message().empty()) {
        absl::Status allowed = absl::OkStatus();
        if (authenticator_ != nullptr && ctx_ != nullptr) {
          auto it = ctx_->client_metadata().find("authorization");
          allowed = authenticator_->Check(
              path_, it == ctx_->client_metadata().end() ? "" : std::string(it->second.data(), it->second.size()));
        }
        // A caller that gives up (its deadline, a cancel) before its message is read ends the
        // same way, with nothing to tell it apart here: the message says both.
        status = !allowed.ok() ? grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(allowed.message()))
                               : grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                              absl::StrCat("request: no whole ", request_type_->full_name(),
                                                           " was read (the caller gave up before sending it, or it is "
                                                           "malformed or nested more deeply than protobuf allows)"));
        methods->ModifySendStatus(status);
      }
      // Counted and logged after the answer where the answering thread defers it.
      const auto end = std::chrono::steady_clock::now();
      const double seconds = std::chrono::duration<double>(end - start_).count();
      RunAfterAnswer([observers = observers_, method = method_, status = FromGrpcStatus(status), seconds,
                      run_id = run_id_, request_id = request_id_, end] {
        ObserveCall(*observers, method, status, seconds, run_id, request_id, end);
      });
    }
    methods->Proceed();
  }

 private:
  std::string method_;
  bool own_;
  const google::protobuf::Descriptor* raw_request_;
  const google::protobuf::Descriptor* request_type_;
  const CallObservers* observers_;
  const CallAuthenticator* authenticator_;
  std::string path_;
  grpc::ServerContextBase* ctx_;
  std::chrono::steady_clock::time_point start_;
  std::string run_id_, request_id_;
};

class CallInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  CallInterceptorFactory(CallObservers observers, std::shared_ptr<const CallAuthenticator> authenticator)
      : observers_(std::move(observers)), authenticator_(std::move(authenticator)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    // "/lorastep.v1.Trainer/TrainStep" -> "Trainer/TrainStep"
    std::string method = info->method() != nullptr ? info->method() : "unknown";
    const bool own = method.rfind("/lorastep.", 0) == 0;
    const google::protobuf::Descriptor* raw_request = nullptr;
    const google::protobuf::Descriptor* request_type = nullptr;
    if (own && method.rfind('/') > 0) {
      // "/lorastep.v1.Trainer/TrainStep" -> the method "lorastep.v1.Trainer.TrainStep"
      std::string full = method.substr(1);
      full[full.rfind('/')] = '.';
      const auto* m = google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(full);
      if (m != nullptr && observers_.services.count(m->service()->full_name())) request_type = m->input_type();
      if (observers_.raw_methods.count(method)) raw_request = request_type;
    }
    const bool logged_fields = !own || observers_.raw_methods.count(method) == 0 || raw_request != nullptr;
    const size_t slash = method.rfind('/');
    const size_t dot = method.rfind('.', slash);
    if (slash != std::string::npos && dot != std::string::npos) method = method.substr(dot + 1);
    return new CallInterceptor(method, own && logged_fields, raw_request, request_type, &observers_,
                               authenticator_.get(), info->method() != nullptr ? info->method() : "",
                               info->server_context());
  }

 private:
  CallObservers observers_;
  std::shared_ptr<const CallAuthenticator> authenticator_;
};

void DeclareRequestMetrics(PrometheusRegistry* metrics) {
  metrics->Declare("lorastep_requests_total", PrometheusRegistry::Type::kCounter,
                   "gRPC calls answered, by method and status code");
  metrics->Declare("lorastep_request_duration_seconds", PrometheusRegistry::Type::kHistogram,
                   "gRPC call duration from arrival to status, seconds", PrometheusRegistry::SecondsBuckets());
}

}  // namespace

void TuneProcessForServing() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);   // the largest glibc accepts on 64-bit
  mallopt(M_TRIM_THRESHOLD, 256 << 20);  // freed memory above this goes back to the OS
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
}

void BlockShutdownSignals() {
  sigset_t set = ShutdownSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

StartupSignalWatcher::StartupSignalWatcher(std::string who) {
  thread_ = std::thread([this, who = std::move(who)] {
    const sigset_t set = ShutdownSignals();
    const timespec poll{0, 50 * 1000 * 1000};
    siginfo_t info{};
    while (!serving_.load()) {
      if (sigtimedwait(&set, &info, &poll) < 0) continue;
      const char* name = info.si_signo == SIGTERM ? "SIGTERM" : info.si_signo == SIGINT ? "SIGINT" : "SIGHUP";
      LORASTEP_LOG(Warning) << who << ": " << name << " from pid " << info.si_pid << " during start-up; exiting";
      std::fflush(nullptr);
      _exit(128 + info.si_signo);
    }
  });
}

void StartupSignalWatcher::Serving() {
  serving_ = true;
  if (thread_.joinable()) thread_.join();
}

void ExitAfter(std::chrono::seconds deadline, const std::string& who) {
  std::thread([deadline, who] {
    std::this_thread::sleep_for(deadline);
    LORASTEP_LOG(Error) << who << ": still running " << deadline.count() << " s after the shutdown began; exiting";
    std::fflush(nullptr);
    _exit(1);
  }).detach();
}

std::string WaitForShutdownSignal() {
  sigset_t set = ShutdownSignals();
  siginfo_t info{};
  while (sigwaitinfo(&set, &info) < 0) {
  }
  const char* name = info.si_signo == SIGTERM ? "SIGTERM" : info.si_signo == SIGINT ? "SIGINT" : "SIGHUP";
  return absl::StrCat(name, " from pid ", info.si_pid);
}

bool IsLoopbackHost(const std::string& host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(
    const std::string& host, int port, const std::vector<grpc::Service*>& services,
    int* bound_port, int max_request_bytes, const CallObservers& observers,
    std::shared_ptr<grpc::ServerCredentials> credentials, std::shared_ptr<const CallAuthenticator> authenticator) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  if (authenticator != nullptr && !authenticator->empty()) {
    if (credentials == nullptr && IsLoopbackHost(host)) {
      credentials = grpc::experimental::LocalServerCredentials(LOCAL_TCP);
    }
    if (credentials != nullptr) credentials->SetAuthMetadataProcessor(MetadataProcessorFor(authenticator));
  }
  builder.AddListeningPort(absl::StrCat(host, ":", port),
                           credentials != nullptr ? credentials : grpc::InsecureServerCredentials(), bound_port);
  // Rollout batches: 64 x 512 tokens with four float fields is ~1 MB; the coordinator's
  // default limit is 64 MiB (--max_request_mb), a worker's 1 GiB (the coordinator's calls).
  builder.SetMaxReceiveMessageSize(max_request_bytes);
  builder.SetMaxSendMessageSize(1 << 30);
  for (grpc::Service* s : services) builder.RegisterService(s);
  if (observers.metrics != nullptr || observers.log_verbosity >= 0) {
    if (observers.metrics != nullptr) DeclareRequestMetrics(observers.metrics);
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(std::make_unique<CallInterceptorFactory>(observers, authenticator));
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *bound_port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", host, ":", port));
  }
  return server;
}

absl::StatusOr<std::string> ReadPemFile(const std::string& path, const char* flag, PemKind kind) {
  auto text = ReadFileToString(path);
  if (!text.ok()) return absl::NotFoundError(absl::StrCat(flag, ": cannot read '", path, "'"));
  const bool cert = kind == PemKind::kCertificate;
  if (text->find(cert ? "-----BEGIN CERTIFICATE-----" : "PRIVATE KEY-----") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", path, "' holds no PEM ", cert ? "certificate" : "private key"));
  }
  return text;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFromCa(const std::string& ca_file,
                                                                                  const char* flag) {
  if (ca_file.empty()) return grpc::InsecureChannelCredentials();
  absl::StatusOr<std::string> ca = ReadPemFile(ca_file, flag, PemKind::kCertificate);
  if (!ca.ok()) return ca.status();
  grpc::SslCredentialsOptions roots;
  roots.pem_root_certs = *ca;
  return grpc::SslCredentials(roots);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TlsServerCredentials(const std::string& cert_file,
                                                                              const std::string& key_file,
                                                                              const std::string& client_ca_file) {
  LORASTEP_ASSIGN_OR_RETURN(std::string cert, ReadPemFile(cert_file, "tls_cert_file", PemKind::kCertificate));
  LORASTEP_ASSIGN_OR_RETURN(std::string key, ReadPemFile(key_file, "tls_key_file", PemKind::kPrivateKey));
  grpc::SslServerCredentialsOptions options;
  options.pem_key_cert_pairs.push_back({key, cert});
  if (!client_ca_file.empty()) {  // mutual TLS: callers must present a certificate this CA signed
    LORASTEP_ASSIGN_OR_RETURN(options.pem_root_certs,
                              ReadPemFile(client_ca_file, "tls_client_ca_file", PemKind::kCertificate));
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

absl::Status WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  LORASTEP_RETURN_IF_ERROR(WriteStringToFile(tmp, absl::StrCat(port, "\n")));
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat(path, ": cannot write port file"));
  }
  return absl::OkStatus();
}

}  // namespace lorastep
