#include "server/http_front_server.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <zstd.h>

#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "server/tinker_wire.h"

namespace lorastep {
namespace {

constexpr char kApiPrefix[] = "/api/v1/";

// One request on one connection, from its headers until MHD closes it.
struct Call {
  std::chrono::steady_clock::time_point arrived = std::chrono::steady_clock::now();
  std::string method = "Tinker/unknown";  // how it is counted: Tinker/<route without ids>
  std::mutex mu;
  bool started = false;     // handed to the front
  bool suspended = false;   // waiting for the front's answer
  bool delivered = false;   // its answer is queued on the connection
  bool closed = false;      // MHD is done with the connection
  MHD_Connection* connection = nullptr;
  bool has_answer = false;
  HttpAnswer answer;
  TinkerRequest request;
  Caller caller;
  AdmissionTicket ticket;
  std::string encoding;
};

absl::StatusOr<std::string> Zstd(const std::string& in, int64_t limit) {
  ZSTD_DStream* s = ZSTD_createDStream();
  std::string out;
  ZSTD_inBuffer src{in.data(), in.size(), 0};
  std::string chunk(ZSTD_DStreamOutSize(), '\0');
  size_t r = 1;
  while (src.pos < src.size || r != 0) {
    ZSTD_outBuffer dst{chunk.data(), chunk.size(), 0};
    r = ZSTD_decompressStream(s, &dst, &src);
    if (ZSTD_isError(r)) {
      ZSTD_freeDStream(s);
      return absl::InvalidArgumentError(absl::StrCat("body: not a zstd frame (", ZSTD_getErrorName(r), ")"));
    }
    out.append(chunk.data(), dst.pos);
    if (static_cast<int64_t>(out.size()) > limit) {
      ZSTD_freeDStream(s);
      return absl::ResourceExhaustedError(
          absl::StrCat("body: more than ", limit, " bytes once decompressed (--tinker_max_request_mb)"));
    }
    if (dst.pos == 0 && src.pos == src.size && r != 0) {
      ZSTD_freeDStream(s);
      return absl::InvalidArgumentError("body: truncated zstd frame");
    }
  }
  ZSTD_freeDStream(s);
  return out;
}

// The route without the ids in it, for counting: training_runs/s:train:0/checkpoints -> training_runs.
std::string RouteName(const std::string& route) {
  for (const char* prefix : {"training_runs", "samplers/", "archive_download/", "checkpoints"}) {
    if (absl::StartsWith(route, prefix)) return std::string(absl::StripSuffix(prefix, "/"));
  }
  return route.size() <= 64 && route.find_first_not_of("abcdefghijklmnopqrstuvwxyz_/") == std::string::npos ? route
                                                                                                       : "other";
}

MHD_Result QueueAnswer(MHD_Connection* connection, const HttpAnswer& a) {
  MHD_Response* response =
      MHD_create_response_from_buffer(a.body.size(), const_cast<char*>(a.body.data()), MHD_RESPMEM_MUST_COPY);
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, a.content_type.c_str());
  const MHD_Result r = MHD_queue_response(connection, a.status, response);
  MHD_destroy_response(response);
  return r;
}

MHD_Result CollectQuery(void* cls, MHD_ValueKind, const char* key, const char* value) {
  (*static_cast<std::map<std::string, std::string>*>(cls))[key] = value == nullptr ? "" : value;
  return MHD_YES;
}

const char* Header(MHD_Connection* c, const char* name) {
  const char* v = MHD_lookup_connection_value(c, MHD_HEADER_KIND, name);
  return v == nullptr ? "" : v;
}

}  // namespace

// The calls waiting for the front's answer as suspended connections (MHD may not stop while
// one is), and whether the server is stopping (then new requests are not handed on).
struct HttpFrontServer::Suspended {
  std::mutex mu;
  bool stopping = false;
  std::set<std::shared_ptr<Call>> calls;
};

struct HttpFrontCalls {
  static MHD_Result Access(void* cls, MHD_Connection* connection, const char* url, const char* method,
                           const char*, const char* upload_data, size_t* upload_data_size, void** con_cls) {
    auto* server = static_cast<HttpFrontServer*>(cls);
    if (*con_cls == nullptr) {  // headers only: everything that is checked before a body is read
      auto* holder = new std::shared_ptr<Call>(std::make_shared<Call>());
      *con_cls = holder;
      Call& call = **holder;
      std::string path = url;
      if (!absl::StartsWith(path, kApiPrefix)) {
        return Refuse(server, connection, call, absl::NotFoundError(absl::StrCat("not served: ", path)));
      }
      call.request.method = method;
      call.request.route = path.substr(std::strlen(kApiPrefix));
      call.method = "Tinker/" + RouteName(call.request.route);
      call.request.base_url = absl::StrCat(server->options_.tls_cert_pem.empty() ? "http://" : "https://",
                                           Header(connection, MHD_HTTP_HEADER_HOST));
      call.encoding = Header(connection, MHD_HTTP_HEADER_CONTENT_ENCODING);
      call.request.idempotency_key = Header(connection, "X-Idempotency-Key");
      MHD_get_connection_values(connection, MHD_GET_ARGUMENT_KIND, CollectQuery, &call.request.query);
      auto caller = server->front_->Authenticate(call.request.route, Header(connection, "X-API-Key"));
      if (!caller.ok()) return Refuse(server, connection, call, caller.status());
      call.caller = *caller;
      int64_t declared = 0;
      if (const char* length = MHD_lookup_connection_value(connection, MHD_HEADER_KIND,
                                                           MHD_HTTP_HEADER_CONTENT_LENGTH);
          length != nullptr && !absl::SimpleAtoi(length, &declared)) {
        declared = -1;
      }
      if (declared < 0 || declared > server->options_.max_body_bytes) {
        return Refuse(server, connection, call,
                      absl::InvalidArgumentError(absl::StrCat("body: ", declared, " bytes declared; at most ",
                                                              server->options_.max_body_bytes,
                                                              " are read (--tinker_max_request_mb)")));
      }
      auto ticket = server->front_->Admit(call.caller, declared);
      if (!ticket.ok()) return Refuse(server, connection, call, ticket.status());
      call.ticket = std::move(*ticket);
      call.request.body.reserve(declared);
      return MHD_YES;
    }
    std::shared_ptr<Call> call = *static_cast<std::shared_ptr<Call>*>(*con_cls);
    if (*upload_data_size > 0) {
      if (!call->has_answer) {
        if (static_cast<int64_t>(call->request.body.size() + *upload_data_size) > server->options_.max_body_bytes) {
          call->has_answer = true;
          call->answer = ErrorAnswer(absl::InvalidArgumentError(absl::StrCat(
              "body: more than ", server->options_.max_body_bytes, " bytes (--tinker_max_request_mb)")));
        } else {
          call->request.body.append(upload_data, *upload_data_size);
        }
      }
      *upload_data_size = 0;
      return MHD_YES;
    }
    std::unique_lock<std::mutex> lock(call->mu);
    if (call->has_answer) {
      call->delivered = true;
      return Answer(server, connection, *call, call->answer);
    }
    if (call->started) return MHD_YES;  // resumed spuriously: the answer is still to come
    call->started = true;
    call->connection = connection;
    {
      std::lock_guard<std::mutex> s(server->suspended_->mu);
      if (server->suspended_->stopping) {
        return Answer(server, connection, *call,
                      ErrorAnswer(absl::UnavailableError("the server is shutting down; retry elsewhere or later")));
      }
    }
    if (absl::EqualsIgnoreCase(call->encoding, "zstd")) {
      auto plain = Zstd(call->request.body, server->options_.max_body_bytes);
      if (!plain.ok()) return Answer(server, connection, *call, ErrorAnswer(plain.status()));
      call->request.body = std::move(*plain);
    } else if (!call->encoding.empty() && !absl::EqualsIgnoreCase(call->encoding, "identity")) {
      return Answer(server, connection, *call, ErrorAnswer(absl::InvalidArgumentError(absl::StrCat(
                                                   "Content-Encoding: '", call->encoding, "' is not supported (zstd is)"))));
    }
    lock.unlock();
    std::weak_ptr<Call> weak = call;
    server->front_->Handle(call->caller, std::move(call->request), std::move(call->ticket),
                           [weak, suspended = server->suspended_](HttpAnswer answer) {
                             if (std::shared_ptr<Call> c = weak.lock()) Deliver(*suspended, c, std::move(answer));
                           });
    lock.lock();
    if (call->has_answer) {
      call->delivered = true;
      return Answer(server, connection, *call, call->answer);
    }
    call->suspended = true;
    {
      std::lock_guard<std::mutex> s(server->suspended_->mu);
      server->suspended_->calls.insert(call);
    }
    MHD_suspend_connection(connection);
    return MHD_YES;
  }

  // Hands `answer` to a call (once); a suspended one is resumed to send it. Call's lock first,
  // then the suspended set's.
  static void Deliver(HttpFrontServer::Suspended& suspended, const std::shared_ptr<Call>& c, HttpAnswer answer) {
    std::lock_guard<std::mutex> l(c->mu);
    if (c->closed || c->has_answer) return;
    c->has_answer = true;
    c->answer = std::move(answer);
    if (!c->suspended) return;
    c->suspended = false;
    {
      std::lock_guard<std::mutex> s(suspended.mu);
      suspended.calls.erase(c);
    }
    MHD_resume_connection(c->connection);
  }

  static MHD_Result Refuse(HttpFrontServer* server, MHD_Connection* connection, Call& call, const absl::Status& why) {
    call.has_answer = true;
    call.answer = ErrorAnswer(why);
    return Answer(server, connection, call, call.answer);
  }

  static MHD_Result Answer(HttpFrontServer* server, MHD_Connection* connection, const Call& call, const HttpAnswer& a) {
    ObserveCall(server->options_.observers, call.method, StatusOfHttp(a.status, a.body),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - call.arrived).count(), "", "");
    return QueueAnswer(connection, a);
  }

  static void Completed(void*, MHD_Connection*, void** con_cls, MHD_RequestTerminationCode) {
    auto* holder = static_cast<std::shared_ptr<Call>*>(*con_cls);
    if (holder == nullptr) return;
    {
      std::lock_guard<std::mutex> lock((*holder)->mu);
      (*holder)->closed = true;
    }
    delete holder;
    *con_cls = nullptr;
  }
};

absl::StatusOr<std::unique_ptr<HttpFrontServer>> HttpFrontServer::Start(TinkerFront* front, HttpFrontOptions options) {
  const bool tls = !options.tls_cert_pem.empty();
  if (tls != !options.tls_key_pem.empty()) {
    return absl::InvalidArgumentError("tinker_port: TLS needs both --tls_cert_file and --tls_key_file");
  }
  if (tls && MHD_is_feature_supported(MHD_FEATURE_TLS) != MHD_YES) {
    return absl::InvalidArgumentError("tinker_port: this libmicrohttpd has no TLS; serve it on a loopback host");
  }
  sockaddr_in6 addr6{};
  sockaddr_in addr4{};
  sockaddr* addr = nullptr;
  unsigned int flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
  if (inet_pton(AF_INET, options.host.c_str(), &addr4.sin_addr) == 1) {
    addr4.sin_family = AF_INET;
    addr4.sin_port = htons(options.port);
    addr = reinterpret_cast<sockaddr*>(&addr4);
  } else if (inet_pton(AF_INET6, options.host.c_str(), &addr6.sin6_addr) == 1) {
    addr6.sin6_family = AF_INET6;
    addr6.sin6_port = htons(options.port);
    addr = reinterpret_cast<sockaddr*>(&addr6);
    flags |= MHD_USE_IPv6;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("host: '", options.host, "' is not a numeric address"));
  }
  if (tls) flags |= MHD_USE_TLS;
  // Each held poll is a socket: make room for the connection limit.
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max &&
      files.rlim_cur < rlim_t(options.max_connections) + 1024) {
    files.rlim_cur = std::min<rlim_t>(files.rlim_max, options.max_connections + 1024);
    setrlimit(RLIMIT_NOFILE, &files);
  }
  std::unique_ptr<HttpFrontServer> server(new HttpFrontServer(front, options));
  if (tls) {
    server->daemon_ = MHD_start_daemon(
        flags, options.port, nullptr, nullptr, &HttpFrontCalls::Access, server.get(), MHD_OPTION_SOCK_ADDR, addr,
        MHD_OPTION_THREAD_POOL_SIZE, static_cast<unsigned int>(options.threads), MHD_OPTION_CONNECTION_LIMIT,
        static_cast<unsigned int>(options.max_connections), MHD_OPTION_CONNECTION_TIMEOUT, 120u,
        MHD_OPTION_NOTIFY_COMPLETED, &HttpFrontCalls::Completed, nullptr, MHD_OPTION_HTTPS_MEM_KEY,
        server->options_.tls_key_pem.c_str(), MHD_OPTION_HTTPS_MEM_CERT, server->options_.tls_cert_pem.c_str(),
        MHD_OPTION_END);
  } else {
    server->daemon_ = MHD_start_daemon(
        flags, options.port, nullptr, nullptr, &HttpFrontCalls::Access, server.get(), MHD_OPTION_SOCK_ADDR, addr,
        MHD_OPTION_THREAD_POOL_SIZE, static_cast<unsigned int>(options.threads), MHD_OPTION_CONNECTION_LIMIT,
        static_cast<unsigned int>(options.max_connections), MHD_OPTION_CONNECTION_TIMEOUT, 120u,
        MHD_OPTION_NOTIFY_COMPLETED, &HttpFrontCalls::Completed, nullptr, MHD_OPTION_END);
  }
  if (server->daemon_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("tinker_port: cannot serve HTTP on ", options.host, ":", options.port));
  }
  const MHD_DaemonInfo* info = MHD_get_daemon_info(server->daemon_, MHD_DAEMON_INFO_BIND_PORT);
  server->port_ = info != nullptr ? info->port : options.port;
  return server;
}

HttpFrontServer::HttpFrontServer(TinkerFront* front, HttpFrontOptions options)
    : front_(front), options_(std::move(options)), suspended_(std::make_shared<Suspended>()) {}

HttpFrontServer::~HttpFrontServer() {
  if (daemon_ == nullptr) return;
  // libmicrohttpd may not stop while a connection is suspended: new requests are answered 503
  // from here, held polls are answered try_again, calls still running are answered 503, and
  // the resumed connections are given up to 5 s to send their answers.
  std::set<std::shared_ptr<Call>> waiting;
  {
    std::lock_guard<std::mutex> s(suspended_->mu);
    suspended_->stopping = true;
    waiting = suspended_->calls;
  }
  front_->futures().AnswerHeldPolls();
  std::set<std::shared_ptr<Call>> left;
  {
    std::lock_guard<std::mutex> s(suspended_->mu);
    left = suspended_->calls;
  }
  for (const std::shared_ptr<Call>& c : left) {
    HttpFrontCalls::Deliver(*suspended_, c, ErrorAnswer(absl::UnavailableError("the server is shutting down; retry")));
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (const std::shared_ptr<Call>& c : waiting) {
    while (std::chrono::steady_clock::now() < until) {
      {
        std::lock_guard<std::mutex> l(c->mu);
        if (c->delivered || c->closed) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  MHD_stop_daemon(daemon_);
}

}  // namespace lorastep
