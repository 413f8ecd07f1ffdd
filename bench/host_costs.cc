// What a host charges for the hand-offs of one service call, without the service: the wake-up
// of a thread that blocked in poll() for a training step's length (190 ms) against one that
// polls, a thread reading 0.5 MB that another core has just written (plain copy or
// non-temporal stores), and 0.5 MB over loopback TCP and a Unix socket after the same idle.
// Medians of 12 rounds each; standalone (no gRPC, no LibTorch).
//   bazel run //bench:host_costs        (or: g++ -O2 -pthread bench/host_costs.cc)
#include <arpa/inet.h>
#include <emmintrin.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>
using Clock = std::chrono::steady_clock;
static int64_t Ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count(); }
static double Med(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
static void Pin(int cpu) { if (cpu < 0) return; cpu_set_t s; CPU_ZERO(&s); CPU_SET(cpu, &s); pthread_setaffinity_np(pthread_self(), sizeof(s), &s); }
static const int kIdleMs = 190, kReps = 12;

void NtCopy(char* dst, const char* src, size_t n) {
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m128i a = _mm_loadu_si128((const __m128i*)(src + i)), b = _mm_loadu_si128((const __m128i*)(src + i + 16)),
            c = _mm_loadu_si128((const __m128i*)(src + i + 32)), d = _mm_loadu_si128((const __m128i*)(src + i + 48));
    _mm_stream_si128((__m128i*)(dst + i), a); _mm_stream_si128((__m128i*)(dst + i + 16), b);
    _mm_stream_si128((__m128i*)(dst + i + 32), c); _mm_stream_si128((__m128i*)(dst + i + 48), d);
  }
  _mm_sfence();
  memcpy(dst + i, src + i, n - i);
}

// 1. wake: a thread blocked in poll (or spinning) on a socketpair; the writer writes 1 KB after idle.
void Wake(bool spin, int cpu_a, int cpu_b) {
  int sv[2]; socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
  std::atomic<int64_t> sent{0};
  std::vector<double> lat;
  std::thread reader([&] {
    Pin(cpu_a);
    char buf[4096];
    for (int r = 0; r < kReps; ++r) {
      if (spin) { while (recv(sv[0], buf, sizeof buf, MSG_DONTWAIT) <= 0) {} }
      else { pollfd p{sv[0], POLLIN, 0}; poll(&p, 1, -1); recv(sv[0], buf, sizeof buf, 0); }
      lat.push_back((Ns() - sent.load()) / 1e3);
    }
  });
  Pin(cpu_b);
  char msg[1024] = {};
  for (int r = 0; r < kReps; ++r) {
    std::this_thread::sleep_for(std::chrono::milliseconds(kIdleMs));
    sent = Ns(); send(sv[1], msg, sizeof msg, 0);
  }
  reader.join(); close(sv[0]); close(sv[1]);
  printf("wake %s (cpus %d,%d): median %.1f us\n", spin ? "spin" : "poll", cpu_a, cpu_b, Med(lat));
}

// 2. cross-core: writer copies 0.5 MB src->region (memcpy / nt) then flags; reader widens int32->int64.
void CrossCore(bool nt, int cpu_w, int cpu_r) {
  const size_t n = 512 << 10;
  std::vector<char> src(n, 1), region(n + 64);
  for (size_t i = 0; i < n; ++i) src[i] = (char)i;
  std::atomic<int> flag{0};
  std::vector<double> wr, rd;
  std::thread reader([&] {
    Pin(cpu_r);
    for (int r = 0; r < kReps; ++r) {
      while (flag.load() != 2 * r + 1) {}
      int64_t t0 = Ns();
      std::vector<int64_t> out(n / 4);
      const int32_t* p = (const int32_t*)region.data();
      for (size_t i = 0; i < n / 4; ++i) out[i] = p[i];
      rd.push_back((Ns() - t0) / 1e3);
      asm volatile("" ::"r"(out.data()) : "memory");
      flag = 2 * r + 2;
    }
  });
  Pin(cpu_w);
  for (int r = 0; r < kReps; ++r) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (size_t i = 0; i < n; i += 64) src[i]++;  // src in writer's cache, as gRPC's slices
    int64_t t0 = Ns();
    if (nt) NtCopy(region.data(), src.data(), n); else memcpy(region.data(), src.data(), n);
    wr.push_back((Ns() - t0) / 1e3);
    flag = 2 * r + 1;
    while (flag.load() != 2 * r + 2) {}
  }
  reader.join();
  printf("cross-core %s (w %d, r %d): copy %.1f us, reader widen %.1f us\n", nt ? "nt  " : "memcpy", cpu_w, cpu_r, Med(wr), Med(rd));
}

// 3. raw 0.5 MB over a stream socket after idle: from the sender's first byte to the reader having all.
// `buf_bytes` > 0 sets both sockets' SO_SNDBUF and SO_RCVBUF (else the kernel's autotuning);
// `spin`: the reader polls without blocking. Also the median count of recv calls per message
// (more than one: the data came in rounds, each waiting on the socket's buffer space).
void Transfer(bool tcp, int buf_bytes = 0, bool spin = false) {
  int ls = -1, a, b;
  if (tcp) {
    ls = socket(AF_INET, SOCK_STREAM, 0); sockaddr_in ad{}; ad.sin_family = AF_INET; ad.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(ls, (sockaddr*)&ad, sizeof ad); listen(ls, 1); socklen_t l = sizeof ad; getsockname(ls, (sockaddr*)&ad, &l);
    a = socket(AF_INET, SOCK_STREAM, 0);
    if (buf_bytes > 0) {  // before connect, so the window scale allows them
      setsockopt(a, SOL_SOCKET, SO_SNDBUF, &buf_bytes, sizeof buf_bytes);
      setsockopt(a, SOL_SOCKET, SO_RCVBUF, &buf_bytes, sizeof buf_bytes);
      setsockopt(ls, SOL_SOCKET, SO_RCVBUF, &buf_bytes, sizeof buf_bytes);
      setsockopt(ls, SOL_SOCKET, SO_SNDBUF, &buf_bytes, sizeof buf_bytes);
    }
    connect(a, (sockaddr*)&ad, sizeof ad); b = accept(ls, nullptr, nullptr);
    int one = 1; setsockopt(a, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  } else { int sv[2]; socketpair(AF_UNIX, SOCK_STREAM, 0, sv); a = sv[0]; b = sv[1]; }
  const size_t n = 512 << 10;
  std::vector<char> msg(n, 3), buf(1 << 20);
  std::atomic<int64_t> sent{0};
  std::vector<double> lat, recvs;
  std::thread reader([&] {
    for (int r = 0; r < kReps; ++r) {
      size_t got = 0;
      int calls = 0;
      while (got < n) {
        if (!spin) { pollfd p{b, POLLIN, 0}; poll(&p, 1, -1); }
        ssize_t k = recv(b, buf.data(), buf.size(), spin ? MSG_DONTWAIT : 0);
        if (k > 0) { got += k; ++calls; }
      }
      lat.push_back((Ns() - sent.load()) / 1e3);
      recvs.push_back(calls);
    }
  });
  for (int r = 0; r < kReps; ++r) {
    std::this_thread::sleep_for(std::chrono::milliseconds(kIdleMs));
    sent = Ns();
    size_t off = 0; while (off < n) { ssize_t k = send(a, msg.data() + off, n - off, 0); if (k > 0) off += k; }
  }
  reader.join();
  int sb = 0, rb = 0; socklen_t sl = sizeof sb;
  getsockopt(a, SOL_SOCKET, SO_SNDBUF, &sb, &sl); sl = sizeof rb; getsockopt(b, SOL_SOCKET, SO_RCVBUF, &rb, &sl);
  printf("transfer 0.5 MB %s after idle (buffers %s, reader %s): median %.1f us, %.0f recv calls; sndbuf %d rcvbuf %d\n",
         tcp ? "tcp " : "unix", buf_bytes > 0 ? "4 MB" : "auto", spin ? "polls" : "blocks", Med(lat), Med(recvs), sb, rb);
  close(a); close(b); if (ls >= 0) close(ls);
}

int main(int argc, char** argv) {
  int ncpu = std::thread::hardware_concurrency();
  int c1 = ncpu > 4 ? 2 : 0, c2 = ncpu > 4 ? 9 : 1;
  Wake(false, -1, -1); Wake(true, -1, -1); Wake(false, c1, c2); Wake(true, c1, c2);
  CrossCore(false, c1, c2); CrossCore(true, c1, c2); CrossCore(false, c1, c1 + 1); CrossCore(true, c1, c1 + 1);
  Transfer(true); Transfer(false);
  Transfer(true, 4 << 20); Transfer(true, 0, true); Transfer(true, 4 << 20, true);
}
