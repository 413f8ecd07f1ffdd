#include "rpc/call_pipe.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "lib/log.h"

namespace lorastep {
namespace {

constexpr uint32_t kFrameMagic = 0x3150534c;  // "LSP1" read as little-endian
constexpr uint32_t kMaxMessageBytes = 64 << 10;
constexpr uint16_t kPayloadInRegion = 1;  // the frame's flags
// Smaller payloads go inline: the socket's copies of them cost less than holding a span.
constexpr uint64_t kRegionMinPayloadBytes = 16 << 10;
constexpr uint64_t kRegionAlignment = 64;

#pragma pack(push, 1)
struct FrameHeader {
  uint32_t magic;
  uint8_t kind;
  uint8_t method;
  uint16_t flags;
  uint32_t code;
  uint32_t message_bytes;
  uint64_t call_id;
  int64_t deadline_unix_us;
  uint64_t payload_bytes;
};
#pragma pack(pop)
static_assert(sizeof(FrameHeader) == 40, "the frame header is 40 bytes");

// Where a payload in the shared region lies: the whole inline payload of such a frame.
struct RegionSpan {
  uint64_t offset;
  uint64_t bytes;
};
static_assert(sizeof(RegionSpan) == 16, "a region span is 16 bytes");
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "frames are little-endian, as this host");

int64_t NowUnixUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Reads exactly `n` bytes; false at the end of the stream or on an error.
bool ReadFully(int fd, char* out, size_t n) {
  while (n > 0) {
    const ssize_t got = read(fd, out, n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    out += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

// Reads exactly `n` bytes, taking a descriptor passed with them (SCM_RIGHTS) into
// `*passed_fd` (one at most; more are closed); false at the end of the stream or on an error.
bool ReadFullyWithDescriptor(int fd, char* out, size_t n, int* passed_fd) {
  while (n > 0) {
    iovec iov{out, n};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t got = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int received;
        std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        if (*passed_fd < 0) {
          *passed_fd = received;
        } else {
          close(received);
        }
      }
    }
    out += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

// Waits until one of `fds` is ready or `wait` has passed, as poll does. Inside `window` it
// polls without blocking (until the window closes or `wait` passes); before the window it
// blocks until the window opens at the latest (0 then: the caller looks again).
int PollUntilAnswer(pollfd* fds, nfds_t count, std::chrono::nanoseconds wait, const AnswerWindows::Window& window) {
  using Steady = std::chrono::steady_clock;
  const Steady::time_point now = Steady::now();
  if (window.known && now >= window.opens && now < window.closes) {
    const Steady::time_point until = wait < window.closes - now ? now + wait : window.closes;
    int ready = 0;
    do {
      ready = poll(fds, count, 0);
    } while (ready == 0 && Steady::now() < until);
    return ready;
  }
  if (window.known && now < window.opens) wait = std::min<std::chrono::nanoseconds>(wait, window.opens - now);
  if (wait == std::chrono::nanoseconds::max()) return ppoll(fds, count, nullptr, nullptr);
  const int64_t ns = std::min<int64_t>(wait.count(), int64_t{INT_MAX} * 1'000'000'000);
  const timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  return ppoll(fds, count, &ts, nullptr);
}

// Lets one write take a whole step's frame (a 64 x 512 batch is about 0.5 MB): with the
// socket's default buffer (about 200 KB) the writer and the reader take turns waking each
// other several times a frame. The kernel caps it at net.core.wmem_max.
void WidenSendBuffer(int fd) {
  const int bytes = 8 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));  // best effort: only speed depends on it
}

}  // namespace

absl::Status WriteCallFrame(int fd, const CallFrame& frame) {
  const RegionSpan span{frame.region_offset, frame.region_bytes};
  size_t payload_bytes = frame.payload.size();
  for (absl::string_view piece : frame.payload_tail) payload_bytes += piece.size();
  if (frame.payload_in_region) payload_bytes = sizeof(span);
  FrameHeader header{kFrameMagic,
                     static_cast<uint8_t>(frame.kind),
                     frame.method,
                     frame.payload_in_region ? kPayloadInRegion : uint16_t{0},
                     static_cast<uint32_t>(frame.code),
                     static_cast<uint32_t>(std::min<size_t>(frame.message.size(), kMaxMessageBytes)),
                     frame.call_id,
                     frame.deadline_unix_us,
                     payload_bytes};
  std::vector<iovec> parts = {{&header, sizeof(header)},
                              {const_cast<char*>(frame.message.data()), header.message_bytes}};
  if (frame.payload_in_region) {
    parts.push_back({const_cast<RegionSpan*>(&span), sizeof(span)});
  } else {
    parts.push_back({const_cast<char*>(frame.payload.data()), frame.payload.size()});
    for (absl::string_view piece : frame.payload_tail) parts.push_back({const_cast<char*>(piece.data()), piece.size()});
  }
  iovec* next = parts.data();
  size_t left = parts.size();
  bool descriptor_sent = frame.passed_fd < 0;
  while (left > 0) {
    msghdr msg{};
    msg.msg_iov = next;
    msg.msg_iovlen = std::min<size_t>(left, IOV_MAX);
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
    if (!descriptor_sent) {  // with the frame's first bytes, so it arrives with its header
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &frame.passed_fd, sizeof(int));
    }
    const ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);  // a closed peer: EPIPE, not SIGPIPE
    if (sent < 0 && errno == EINTR) continue;
    if (sent < 0) return absl::UnavailableError(absl::StrCat("pipe write: ", std::strerror(errno)));
    descriptor_sent = true;
    size_t done = static_cast<size_t>(sent);
    while (left > 0 && done >= next->iov_len) {
      done -= next->iov_len;
      ++next;
      --left;
    }
    if (left > 0) {
      next->iov_base = static_cast<char*>(next->iov_base) + done;
      next->iov_len -= done;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<CallFrame> ReadCallFrame(int fd, uint64_t max_payload_bytes) {
  FrameHeader header;
  int passed_fd = -1;
  const bool read = ReadFullyWithDescriptor(fd, reinterpret_cast<char*>(&header), sizeof(header), &passed_fd);
  const auto kind = static_cast<CallFrameKind>(header.kind);
  if (passed_fd >= 0 && (!read || kind != CallFrameKind::kRegion)) close(std::exchange(passed_fd, -1));
  if (!read) return absl::UnavailableError("pipe closed");
  const bool in_region = (header.flags & kPayloadInRegion) != 0;
  if (header.magic != kFrameMagic || header.kind < 1 || header.kind > 4 || header.message_bytes > kMaxMessageBytes ||
      (header.flags & ~kPayloadInRegion) != 0 ||
      (in_region && (kind != CallFrameKind::kCall || header.payload_bytes != sizeof(RegionSpan)))) {
    if (passed_fd >= 0) close(passed_fd);
    return absl::DataLossError("pipe: a header that is not a call frame's");
  }
  if (header.payload_bytes > max_payload_bytes) {
    if (passed_fd >= 0) close(passed_fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("pipe: a payload of ", header.payload_bytes, " bytes is over the limit of ", max_payload_bytes));
  }
  CallFrame frame;
  frame.passed_fd = passed_fd;
  frame.kind = static_cast<CallFrameKind>(header.kind);
  frame.method = header.method;
  frame.code = static_cast<absl::StatusCode>(header.code);
  frame.call_id = header.call_id;
  frame.deadline_unix_us = header.deadline_unix_us;
  frame.message.resize(header.message_bytes);
  frame.payload.resize(header.payload_bytes);
  if (!ReadFully(fd, frame.message.data(), frame.message.size()) ||
      !ReadFully(fd, frame.payload.data(), frame.payload.size())) {
    if (frame.passed_fd >= 0) close(frame.passed_fd);
    return absl::UnavailableError("pipe closed within a frame");
  }
  if (in_region) {
    RegionSpan span;
    std::memcpy(&span, frame.payload.data(), sizeof(span));
    frame.payload.clear();
    frame.payload_in_region = true;
    frame.region_offset = span.offset;
    frame.region_bytes = span.bytes;
    if (span.bytes > max_payload_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("pipe: a payload of ", span.bytes, " bytes is over the limit of ", max_payload_bytes));
    }
  }
  return frame;
}

namespace {

// Copies `pieces` one after another to `out`; returns the end of what it wrote.
char* CopyPieces(const std::vector<absl::string_view>& pieces, char* out) {
  for (absl::string_view piece : pieces) {
    std::memcpy(out, piece.data(), piece.size());
    out += piece.size();
  }
  return out;
}

}  // namespace

// The caller's side of the shared region: a sealed memfd mapped for writing, and which of
// its spans hold the payloads of calls not answered yet, or staged tails not taken yet
// (keyed by holder: a call id, or a staged tail's id with kStagedHolder set). Thread-safe.
class CallPipeClient::Region {
 public:
  static constexpr uint64_t kStagedHolder = 1ull << 63;

  // Null where the region cannot be made (no memfd, no memory): calls then go inline.
  static std::shared_ptr<Region> Make(uint64_t bytes) {
    const int fd = memfd_create("lorastep-call-pipe", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return nullptr;
    void* data = MAP_FAILED;
    if (ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
      data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    }
    if (data == MAP_FAILED) {
      close(fd);
      return nullptr;
    }
    // Its size is fixed, so the callee cannot make this side's writes fault; where the kernel
    // knows the seal, nobody maps it writable again either.
#ifdef F_SEAL_FUTURE_WRITE
    fcntl(fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE);  // best effort: kernels before 5.1 refuse it
#endif
    fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
    return std::shared_ptr<Region>(new Region(fd, static_cast<char*>(data), bytes));
  }
  ~Region() {
    munmap(data_, bytes_);
    if (fd_ >= 0) close(fd_);
  }
  int fd() const { return fd_; }
  void CloseFd() { close(std::exchange(fd_, -1)); }  // once the callee has it
  char* data() const { return data_; }

  // A span of `bytes` for `holder` (first fit), or none when no free span fits.
  std::optional<uint64_t> Hold(uint64_t holder, uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t rounded = (bytes + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment;
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < rounded) continue;
      const uint64_t offset = it->first;
      const uint64_t left = it->second - rounded;
      free_.erase(it);
      if (left > 0) free_[offset + rounded] = left;
      held_[holder] = {offset, rounded};
      return offset;
    }
    return std::nullopt;
  }
  // `from`'s span is `to`'s now (a staged tail taken by a call).
  void Rekey(uint64_t from, uint64_t to) {
    std::lock_guard<std::mutex> lock(mu_);
    auto node = held_.extract(from);
    if (node.empty()) return;
    node.key() = to;
    held_.insert(std::move(node));
  }
  uint64_t NextStagedId() { return kStagedHolder | next_staged_.fetch_add(1); }
  // `holder` is done with its span (the callee has answered its call, the payload never went,
  // a staged tail was dropped): it is free again.
  void Release(uint64_t holder) {
    std::lock_guard<std::mutex> lock(mu_);
    auto held = held_.find(holder);
    if (held == held_.end()) return;
    auto [offset, bytes] = held->second;
    held_.erase(held);
    auto next = free_.lower_bound(offset);
    if (next != free_.end() && offset + bytes == next->first) {  // joins the span after it
      bytes += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {  // and the one before it
      auto before = std::prev(next);
      if (before->first + before->second == offset) {
        before->second += bytes;
        return;
      }
    }
    free_[offset] = bytes;
  }

 private:
  Region(int fd, char* data, uint64_t bytes) : fd_(fd), data_(data), bytes_(bytes) { free_[0] = bytes; }
  int fd_;
  char* const data_;
  const uint64_t bytes_;
  std::atomic<uint64_t> next_staged_{1};
  std::mutex mu_;
  std::map<uint64_t, uint64_t> free_;                       // under mu_: offset -> bytes
  std::map<uint64_t, std::pair<uint64_t, uint64_t>> held_;  // under mu_: holder -> (offset, bytes)
};

// Where a staged tail lies, and whether a call has taken it.
struct StagedTail::Place {
  std::shared_ptr<CallPipeClient::Region> region;
  uint64_t holder = 0;
  uint64_t offset = 0;      // the span's start; the tail begins `front` bytes in
  uint64_t front = 0;
  uint64_t tail_bytes = 0;
  std::atomic<bool> taken{false};
};

StagedTail::~StagedTail() {
  if (!place_->taken.exchange(true)) place_->region->Release(place_->holder);
}

CallPipeClient::CallPipeClient(int fd, std::string peer, uint64_t max_answer_bytes, uint64_t region_bytes)
    : fd_(fd), wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)), peer_(std::move(peer)),
      max_answer_bytes_(max_answer_bytes) {
  WidenSendBuffer(fd_);
  if (region_bytes == 0) return;
  region_ = Region::Make(region_bytes);
  if (region_ == nullptr) return;
  CallFrame offer;
  offer.kind = CallFrameKind::kRegion;
  offer.passed_fd = region_->fd();
  if (!WriteCallFrame(fd_, offer).ok()) region_.reset();  // a closed pipe fails every call anyway
  if (region_ != nullptr) region_->CloseFd();  // the callee holds its own; the mapping stays
}

CallPipeClient::~CallPipeClient() {
  std::unique_lock<std::mutex> lock(mu_);
  Close(absl::UnavailableError("the coordinator closed it"));
  shutdown(fd_, SHUT_RDWR);  // a reader in its wait sees the end of the stream
  Wake();
  changed_.wait(lock, [this] { return active_calls_ == 0; });
  lock.unlock();
  close(fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void CallPipeClient::Close(const absl::Status& why) {
  if (closed_) return;
  closed_ = true;
  closed_status_ = absl::UnavailableError(absl::StrCat("worker ", peer_, ": its pipe closed (", why.message(), ")"));
  for (auto& [id, p] : pending_) {
    p->status = closed_status_;
    p->done = true;
    p->handed.notify_one();
  }
  pending_.clear();
}

void CallPipeClient::HandOverReading() {
  if (!reading_ && !pending_.empty()) pending_.begin()->second->handed.notify_one();
}

void CallPipeClient::Wake() {
  const uint64_t one = 1;
  if (wake_fd_ >= 0) (void)!write(wake_fd_, &one, sizeof(one));
}

void CallPipeClient::ReadAnswer(std::unique_lock<std::mutex>& lock, std::chrono::system_clock::time_point deadline,
                                const AnswerWindows::Window& window) {
  lock.unlock();
  pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  std::chrono::nanoseconds wait = std::chrono::nanoseconds::max();  // how long to block
  if (deadline != std::chrono::system_clock::time_point::max()) {
    wait = std::max(std::chrono::nanoseconds(0), std::chrono::ceil<std::chrono::nanoseconds>(
                                                     deadline - std::chrono::system_clock::now()));
  }
  if (wake_fd_ < 0) wait = std::min<std::chrono::nanoseconds>(wait, std::chrono::milliseconds(100));  // look again often
  const int ready = PollUntilAnswer(fds, wake_fd_ >= 0 ? 2 : 1, wait, window);
  if (ready > 0 && (fds[1].revents & POLLIN)) {
    uint64_t count;
    (void)!read(wake_fd_, &count, sizeof(count));  // drained: the next wait blocks again
  }
  absl::StatusOr<CallFrame> frame = absl::UnavailableError("");
  const bool readable = ready > 0 && (fds[0].revents & (POLLIN | POLLHUP | POLLERR));
  if (readable) frame = ReadCallFrame(fd_, max_answer_bytes_);
  lock.lock();
  if (!readable) return;  // the deadline, a wake-up or EINTR: the caller looks again
  if (frame.ok() && frame->kind != CallFrameKind::kAnswer) {
    frame = absl::DataLossError("pipe: the callee sent a frame that is not an answer");
  }
  if (!frame.ok()) {
    shutdown(fd_, SHUT_RDWR);  // a stream out of step is not read again, nor written
    Close(frame.status());
    return;
  }
  if (region_ != nullptr) region_->Release(frame->call_id);  // the callee is done reading it
  auto it = pending_.find(frame->call_id);
  if (it == pending_.end()) return;  // its caller gave up (deadline, cancel)
  Pending& p = *it->second;
  p.status = frame->code == absl::StatusCode::kOk ? absl::OkStatus() : absl::Status(frame->code, frame->message);
  p.payload = std::move(frame->payload);
  p.done = true;
  p.handed.notify_one();
  pending_.erase(it);
}

void CallPipeClient::SendCancel(uint64_t call_id) {
  CallFrame cancel;
  cancel.kind = CallFrameKind::kCancel;
  cancel.call_id = call_id;
  std::lock_guard<std::mutex> lock(write_mu_);
  WriteCallFrame(fd_, cancel).IgnoreError();  // a closed pipe fails every call anyway
}

std::shared_ptr<const StagedTail> CallPipeClient::Stage(uint64_t front_bytes,
                                                       const std::vector<absl::string_view>& tail) {
  uint64_t tail_bytes = 0;
  for (absl::string_view piece : tail) tail_bytes += piece.size();
  if (region_ == nullptr || tail_bytes < kRegionMinPayloadBytes) return nullptr;
  auto place = std::make_shared<StagedTail::Place>();
  place->region = region_;
  place->holder = region_->NextStagedId();
  place->front = front_bytes;
  place->tail_bytes = tail_bytes;
  const std::optional<uint64_t> span = region_->Hold(place->holder, front_bytes + tail_bytes);
  if (!span) return nullptr;
  place->offset = *span;
  CopyPieces(tail, region_->data() + *span + front_bytes);
  return std::shared_ptr<const StagedTail>(new StagedTail(std::move(place)));
}

absl::StatusOr<std::string> CallPipeClient::Call(uint8_t method, std::string payload,
                                                 std::chrono::system_clock::time_point deadline,
                                                 std::vector<absl::string_view> payload_tail,
                                                 const StagedTail* staged, CancelToken* cancel) {
  auto pending = std::make_shared<Pending>();
  uint64_t id = 0;
  uint64_t payload_bytes = payload.size();
  for (absl::string_view piece : payload_tail) payload_bytes += piece.size();
  // A staged tail this call can take: the payload goes in front of it, and its span is the call's.
  StagedTail::Place* place = staged != nullptr ? staged->place_.get() : nullptr;
  if (place != nullptr && (place->region != region_ || payload.size() > place->front || place->taken.exchange(true))) {
    place = nullptr;
  }
  std::optional<uint64_t> span;  // where the payload goes in the shared region
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      if (place != nullptr) region_->Release(place->holder);
      return closed_status_;
    }
    id = next_id_++;
    pending_[id] = pending;
    ++active_calls_;
    if (place != nullptr) {
      region_->Rekey(place->holder, id);
      span = place->offset + place->front - payload.size();
      payload_tail.clear();  // already there
      payload_bytes = payload.size() + place->tail_bytes;
    } else if (region_ != nullptr && payload_bytes >= kRegionMinPayloadBytes) {
      span = region_->Hold(id, payload_bytes);
    }
  }
  CallFrame call;
  call.kind = CallFrameKind::kCall;
  call.method = method;
  call.call_id = id;
  call.deadline_unix_us = deadline == std::chrono::system_clock::time_point::max()
                              ? 0
                              : std::chrono::duration_cast<std::chrono::microseconds>(deadline.time_since_epoch()).count();
  if (span) {  // the span is this call's alone until the callee answers it
    CopyPieces(payload_tail, CopyPieces({payload}, region_->data() + *span));
    call.payload_in_region = true;
    call.region_offset = *span;
    call.region_bytes = payload_bytes;
  } else {
    call.payload = std::move(payload);
    call.payload_tail = std::move(payload_tail);
  }
  absl::Status sent;
  {
    std::lock_guard<std::mutex> lock(write_mu_);
    sent = WriteCallFrame(fd_, call);
  }
  // Cancellation ends the wait below as CancelAll would, for this call alone (registered
  // before mu_ is taken: a token cancelled already runs the callback at once).
  CancelToken::Registration on_cancel(cancel, [this, id] { Cancel(id); });
  std::unique_lock<std::mutex> lock(mu_);
  auto leave = [&](absl::StatusOr<std::string> result) {
    --active_calls_;
    HandOverReading();      // this caller may have been the reader
    changed_.notify_all();  // the destructor may be waiting
    return result;
  };
  if (!sent.ok() && !pending->done) {
    pending_.erase(id);
    if (region_ != nullptr) region_->Release(id);
    return leave(absl::UnavailableError(absl::StrCat("worker ", peer_, ": ", sent.message())));
  }
  const AnswerWindows::Clock::time_point sent_at = AnswerWindows::Clock::now();
  const AnswerWindows::Window window = poll_for_answers_ ? windows_.For(method, sent_at) : AnswerWindows::Window();
  // One waiting caller reads at a time; the others wait for it to hand their answers over.
  while (!pending->done) {
    if (std::chrono::system_clock::now() >= deadline) {
      pending_.erase(id);
      lock.unlock();
      SendCancel(id);
      lock.lock();
      return leave(absl::DeadlineExceededError(absl::StrCat("worker ", peer_, ": no answer before the call's deadline")));
    }
    if (!reading_) {  // the reader's turn: it reads on until its own answer came
      reading_ = true;
      ReadAnswer(lock, deadline, window);
      reading_ = false;
    } else if (deadline == std::chrono::system_clock::time_point::max()) {
      pending->handed.wait(lock);
    } else {
      pending->handed.wait_until(lock, deadline);
    }
  }
  if (!pending->status.ok()) return leave(pending->status);
  windows_.Record(method, AnswerWindows::Clock::now() - sent_at);
  return leave(std::move(pending->payload));
}

void CallPipeClient::Cancel(uint64_t id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) return;  // answered, or given up already
    it->second->status = absl::CancelledError(absl::StrCat("worker ", peer_, ": call cancelled (its caller went away)"));
    it->second->done = true;
    it->second->handed.notify_one();
    pending_.erase(it);
  }
  Wake();
  SendCancel(id);
}

void CallPipeClient::CancelAll() {
  std::vector<uint64_t> ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, p] : pending_) {
      p->status = absl::CancelledError(absl::StrCat("worker ", peer_, ": call cancelled"));
      p->done = true;
      p->handed.notify_one();
      ids.push_back(id);
    }
    pending_.clear();
  }
  Wake();  // the reader stops waiting for answers nobody waits for now
  for (uint64_t id : ids) SendCancel(id);
}

namespace {

// The callee's read-only mapping of the caller's region, alive while a payload points into it.
struct RegionMapping {
  RegionMapping(const char* data, size_t bytes) : data(data), bytes(bytes) {}
  ~RegionMapping() { munmap(const_cast<char*>(data), bytes); }
  const char* const data;
  const size_t bytes;
};

// Maps the region the caller passed, read-only, and closes its descriptor.
absl::StatusOr<std::shared_ptr<const RegionMapping>> MapRegion(int fd) {
  struct stat st;
  absl::Status failed;
  void* data = MAP_FAILED;
  if (fstat(fd, &st) != 0) {
    failed = absl::InternalError(absl::StrCat("fstat: ", std::strerror(errno)));
  } else if (st.st_size <= 0) {
    failed = absl::InvalidArgumentError("the region is empty");
  } else {
    data = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
    if (data == MAP_FAILED) failed = absl::ResourceExhaustedError(absl::StrCat("mmap: ", std::strerror(errno)));
  }
  close(fd);
  if (!failed.ok()) return failed;
  return std::make_shared<const RegionMapping>(static_cast<const char*>(data), static_cast<size_t>(st.st_size));
}

}  // namespace

// What the reader and every answer still to come share: the socket stays open until the
// last of them is done with it.
struct CallPipeServer::Shared {
  explicit Shared(int fd, bool poll_after_answer)
      : fd(fd), answered_fd(poll_after_answer ? eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC) : -1) {}
  ~Shared() {
    close(fd);
    if (answered_fd >= 0) close(answered_fd);
  }
  const int fd;
  const int answered_fd;  // an eventfd the answers count up (-1: the reader does not poll after them)
  std::mutex write_mu;
  std::mutex mu;
  bool closed = false;                                                 // under mu
  std::map<uint64_t, std::shared_ptr<std::atomic<bool>>> cancelled;  // calls not answered yet, under mu
};

namespace {

// Waits until `fd` has something to read (or is closed). Each time `answered_fd` (-1: none)
// counts an answer, polls `fd` without blocking for up to `poll_for` before blocking again.
void WaitForNextCall(int fd, int answered_fd, std::chrono::microseconds poll_for) {
  pollfd fds[2] = {{fd, POLLIN, 0}, {answered_fd, POLLIN, 0}};
  while (true) {
    const int ready = poll(fds, answered_fd >= 0 ? 2 : 1, -1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0 || fds[0].revents != 0) return;  // readable, closed, or poll failed: the read says which
    uint64_t count;
    (void)!read(answered_fd, &count, sizeof(count));
    const auto until = std::chrono::steady_clock::now() + poll_for;
    do {
      if (poll(fds, 1, 0) != 0) return;
    } while (std::chrono::steady_clock::now() < until);
  }
}

}  // namespace

CallPipeServer::CallPipeServer(int fd, uint64_t max_call_bytes, Handler handler,
                               std::chrono::microseconds poll_after_answer)
    : shared_(std::make_shared<Shared>(fd, poll_after_answer.count() > 0)) {
  WidenSendBuffer(fd);
  reader_ = std::thread([shared = shared_, max_call_bytes, handler = std::move(handler), poll_after_answer] {
    std::shared_ptr<const RegionMapping> region;
    while (true) {
      WaitForNextCall(shared->fd, shared->answered_fd, poll_after_answer);
      absl::StatusOr<CallFrame> frame = ReadCallFrame(shared->fd, max_call_bytes);
      if (!frame.ok() || frame->kind == CallFrameKind::kAnswer) break;
      if (frame->kind == CallFrameKind::kRegion) {
        if (region != nullptr || frame->passed_fd < 0) {
          if (frame->passed_fd >= 0) close(frame->passed_fd);
          break;  // one region a pipe, offered with its descriptor
        }
        absl::StatusOr<std::shared_ptr<const RegionMapping>> mapped = MapRegion(frame->passed_fd);
        if (!mapped.ok()) {
          LORASTEP_LOG(Error) << "call pipe: the caller's shared region could not be mapped ("
                              << mapped.status().message() << "); closing the pipe";
          break;
        }
        region = *std::move(mapped);
        continue;
      }
      CallPayload payload;
      if (frame->payload_in_region) {
        if (region == nullptr || frame->region_offset > region->bytes ||
            frame->region_bytes > region->bytes - frame->region_offset) {
          break;  // out of step with the caller
        }
        payload = CallPayload(absl::string_view(region->data + frame->region_offset, frame->region_bytes), region);
      } else {
        payload = CallPayload(std::move(frame->payload));
      }
      std::unique_lock<std::mutex> lock(shared->mu);
      if (frame->kind == CallFrameKind::kCancel) {
        if (auto it = shared->cancelled.find(frame->call_id); it != shared->cancelled.end()) *it->second = true;
        continue;
      }
      auto flag = std::make_shared<std::atomic<bool>>(false);
      shared->cancelled[frame->call_id] = flag;
      lock.unlock();
      const int64_t deadline = frame->deadline_unix_us;
      auto cancelled = [flag, deadline] { return flag->load() || (deadline != 0 && NowUnixUs() >= deadline); };
      Respond respond = [shared, id = frame->call_id](const absl::Status& status, std::string payload) {
        {
          std::lock_guard<std::mutex> lock(shared->mu);
          shared->cancelled.erase(id);
          if (shared->closed) return;
        }
        CallFrame answer;
        answer.kind = CallFrameKind::kAnswer;
        answer.call_id = id;
        answer.code = status.code();
        answer.message = std::string(status.message());
        if (status.ok()) answer.payload = std::move(payload);
        {
          std::lock_guard<std::mutex> lock(shared->write_mu);
          WriteCallFrame(shared->fd, answer).IgnoreError();  // the caller is gone: nobody to tell
        }
        const uint64_t one = 1;
        if (shared->answered_fd >= 0) (void)!write(shared->answered_fd, &one, sizeof(one));
      };
      handler(frame->method, std::move(payload), std::move(cancelled), std::move(respond));
    }
    // The caller closed the pipe (or broke its framing): nobody waits for the calls still running.
    shutdown(shared->fd, SHUT_RDWR);
    std::lock_guard<std::mutex> lock(shared->mu);
    shared->closed = true;
    for (auto& [id, flag] : shared->cancelled) *flag = true;
  });
}

CallPipeServer::~CallPipeServer() {
  shutdown(shared_->fd, SHUT_RDWR);
  reader_.join();
}

}  // namespace lorastep
