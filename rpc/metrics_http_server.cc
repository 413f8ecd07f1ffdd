#include "rpc/metrics_http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>

#include <chrono>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "rpc/server_runner.h"

namespace lorastep {
namespace {

void SendAll(int fd, const std::string& data) {
  size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

std::string Response(const std::string& status, const std::string& type, const std::string& body) {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type, "\r\nContent-Length: ", body.size(),
                      "\r\nConnection: close\r\n\r\n", body);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(const std::string& host, int port,
                                                                             const PrometheusRegistry* registry,
                                                                             bool allow_remote) {
  if (!IsLoopbackHost(host) && !allow_remote) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics_host: '", host, "' is not a loopback address; lorastep has no authentication, so the "
        "metrics endpoint (which names every run) listens beyond this machine only with --metrics_allow_remote"));
  }
  if (port < 0 || port > 65535) return absl::InvalidArgumentError(absl::StrCat("metrics_port: ", port, " out of range"));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const std::string ip = host == "localhost" ? "127.0.0.1" : host;
  if (::inet_pton(AF_INET, ip.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("metrics_host: '", host, "' is not an IPv4 address"));
  }
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("metrics endpoint: socket: ", std::strerror(errno)));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 16) != 0) {
    const std::string err = std::strerror(errno);
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("metrics endpoint: cannot listen on ", host, ":", port, ": ", err));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer(fd, ntohs(addr.sin_port), registry));
  server->thread_ = std::thread([s = server.get()] { s->Serve(); });
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait(lock, [&] { return answering_ == 0; });  // each ends within its 2 s
  ::close(fd_);
}

void MetricsHttpServer::Serve() {
  while (!stop_) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, 200) <= 0) continue;  // wakes up to notice stop_
    const int client = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (answering_ >= kMaxConnections) {
        ::close(client);
        continue;
      }
      ++answering_;
    }
    std::thread([this, client] {
      Answer(client);
      ::close(client);
      std::lock_guard<std::mutex> lock(mu_);
      if (--answering_ == 0) idle_.notify_all();
    }).detach();
  }
}

void MetricsHttpServer::Answer(int client) {
  std::string request;
  char buf[2048];
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < 16384) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    pollfd p{client, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) return;  // too slow: dropped
    const ssize_t n = ::recv(client, buf, sizeof(buf), 0);
    if (n <= 0) return;
    request.append(buf, static_cast<size_t>(n));
  }
  const std::string line = request.substr(0, request.find("\r\n"));
  const size_t sp1 = line.find(' '), sp2 = line.find(' ', sp1 + 1);
  if (sp1 == std::string::npos || sp2 == std::string::npos) {
    SendAll(client, Response("400 Bad Request", "text/plain", "bad request line\n"));
    return;
  }
  const std::string method = line.substr(0, sp1), target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  const std::string path = target.substr(0, target.find('?'));
  if (method != "GET" && method != "HEAD") {
    SendAll(client, Response("405 Method Not Allowed", "text/plain", "only GET /metrics\n"));
  } else if (path != "/metrics") {
    SendAll(client, Response("404 Not Found", "text/plain", "only GET /metrics\n"));
  } else {
    std::string r = Response("200 OK", "text/plain; version=0.0.4; charset=utf-8", registry_->Render());
    if (method == "HEAD") r = r.substr(0, r.find("\r\n\r\n") + 4);
    SendAll(client, r);
  }
}

}  // namespace lorastep
