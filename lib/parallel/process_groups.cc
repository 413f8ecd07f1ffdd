#include "lib/parallel/process_groups.h"

#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>

#if defined(LORASTEP_WITH_GLOO)
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if defined(LORASTEP_WITH_NCCL)
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"
#include "lib/status_macros.h"
#include "lib/torch_compat.h"

namespace lorastep {
namespace c10d_impl {

struct Handles {
  c10::intrusive_ptr<::c10d::Store> store;
  c10::intrusive_ptr<LORASTEP_C10D_BACKEND> backend;
};

}  // namespace c10d_impl

namespace {

::c10d::ReduceOp ToC10d(ReduceKind op) {
  switch (op) {
    case ReduceKind::kMax: return ::c10d::ReduceOp::MAX;
    case ReduceKind::kMin: return ::c10d::ReduceOp::MIN;
    case ReduceKind::kSum: break;
  }
  return ::c10d::ReduceOp::SUM;
}

bool LooksLikeTimeout(const std::string& what) {
  for (const char* word : {"imed out", "imeout", "timeout"}) {
    if (what.find(word) != std::string::npos) return true;
  }
  return false;
}

// Runs one c10d call and waits for it, turning exceptions and timeouts into a status.
template <typename Issue>
absl::Status RunWork(CommGroup* group, const char* op, std::chrono::milliseconds timeout,
                     Issue issue, absl::Status (CommGroup::*fail)(const char*, const std::string&, bool)) {
  try {
    c10::intrusive_ptr<::c10d::Work> work = issue();
    if (!work->wait(timeout)) return (group->*fail)(op, "did not complete", true);
    return absl::OkStatus();
  } catch (const std::exception& e) {
    const std::string what = e.what();
    return (group->*fail)(op, what.substr(0, what.find('\n')), LooksLikeTimeout(what));
  }
}

// Gloo (the CPU backend) has no bfloat16 kernels ("Invalid scalar type"): CPU collectives
// on bf16 tensors move them as fp32, which holds every bf16 value exactly (a sum is
// rounded to bf16 once, at the end).
bool GlooNeedsFp32(const at::Tensor& t) { return !t.is_cuda() && t.scalar_type() == at::kBFloat16; }

constexpr absl::string_view kFileStoreScheme = "file://";

// Gloo writes its peer sockets with writev, which raises SIGPIPE once the peer has gone; the
// default action would end this rank instead of failing its collective with EPIPE. Done once
// per process, and only where nothing else has set a disposition for the signal.
void IgnoreBrokenPipeSignal() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) != 0 || current.sa_handler != SIG_DFL) return;
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    sigaction(SIGPIPE, &ignore, nullptr);
  });
}

absl::StatusOr<std::pair<std::string, int>> SplitHostPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(address.substr(colon + 1), &port) || port <= 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous: '", address, "' is not host:port or file://PATH"));
  }
  return std::make_pair(address.substr(0, colon), port);
}

// A store address: file://PATH (an absolute path) or host:port.
absl::Status CheckStoreAddress(const std::string& address) {
  if (absl::StartsWith(address, kFileStoreScheme)) {
    if (address.size() > kFileStoreScheme.size() && address[kFileStoreScheme.size()] == '/') return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("rendezvous: '", address, "': file:// needs an absolute path"));
  }
  return SplitHostPort(address).status();
}

// A c10d Store over a StoreTransport (rank 0's RendezvousStoreHost). The host never blocks:
// get and wait poll until the keys exist or the store's timeout passes. Errors are thrown,
// as c10d's stores do; ProcessGroups catches them where it forms communicators.
class RemoteStore : public ::c10d::Store {
 public:
  RemoteStore(StoreTransport transport, std::chrono::milliseconds timeout) : transport_(std::move(transport)) {
    timeout_ = timeout;
  }
  // c10d 2.x: a thread-safe copy reaching the same store (not virtual in 1.13).
  c10::intrusive_ptr<::c10d::Store> clone() { return c10::make_intrusive<RemoteStore>(transport_, timeout_); }

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    Call({StoreOp::kSet, {key}, Text(value)});
  }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    return Bytes(Call({StoreOp::kCompareSet, {key}, Text(desired), Text(expected)}).value);
  }
  std::vector<uint8_t> get(const std::string& key) override {
    wait({key}, timeout_);
    StoreAnswer answer = Call({StoreOp::kGet, {key}});
    if (!answer.found) throw std::runtime_error("rendezvous store: key '" + key + "' was deleted while read");
    return Bytes(answer.value);
  }
  int64_t add(const std::string& key, int64_t value) override {
    StoreOp op{StoreOp::kAdd, {key}};
    op.delta = value;
    return Call(op).number;
  }
  bool deleteKey(const std::string& key) override { return Call({StoreOp::kDeleteKey, {key}}).found; }
  bool check(const std::vector<std::string>& keys) override { return Call({StoreOp::kCheck, keys}).found; }
  int64_t getNumKeys() override { return Call({StoreOp::kNumKeys}).number; }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    const auto start = std::chrono::steady_clock::now();
    auto pause = std::chrono::milliseconds(1);
    while (!Call({StoreOp::kCheck, keys}).found) {
      if (timeout.count() > 0 && std::chrono::steady_clock::now() - start >= timeout) {
        throw std::runtime_error(absl::StrCat("rendezvous store: timeout after ", timeout.count(),
                                              " ms waiting for key '", keys.empty() ? "" : keys[0], "'"));
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(20));
    }
  }

 private:
  static std::string Text(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }
  static std::vector<uint8_t> Bytes(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }
  StoreAnswer Call(const StoreOp& op) {
    // One operation gets the store's timeout (10 s when it has none): a rank that cannot
    // reach rank 0 fails its rendezvous rather than hanging.
    absl::StatusOr<StoreAnswer> answer = transport_(op, timeout_.count() > 0 ? timeout_ : std::chrono::seconds(10));
    if (!answer.ok()) throw std::runtime_error(absl::StrCat("rendezvous store: ", answer.status().ToString()));
    return *std::move(answer);
  }

  StoreTransport transport_;
};

// The order every rank forms its groups in.
constexpr GroupKind kFormOrder[] = {GroupKind::kTensor, GroupKind::kData, GroupKind::kPipeline,
                                    GroupKind::kStage, GroupKind::kModelParallel, GroupKind::kWorld,
                                    GroupKind::kEmbedding, GroupKind::kExpert, GroupKind::kExpertData,
                                    GroupKind::kExpertStage, GroupKind::kContext};

}  // namespace

CommGroup::CommGroup(GroupKind kind, int index, std::vector<int> ranks, int my_rank)
    : kind_(kind), index_(index), ranks_(std::move(ranks)) {
  for (size_t i = 0; i < ranks_.size(); ++i) {
    if (ranks_[i] == my_rank) group_rank_ = static_cast<int>(i);
  }
}

CommGroup::~CommGroup() = default;

std::string CommGroup::name() const {
  return absl::StrCat(GroupKindName(kind_), " group ", index_, " {", absl::StrJoin(ranks_, ","), "}");
}

absl::Status CommGroup::Check(const char* op) const {
  if (broken_ != nullptr && *broken_) {
    return absl::FailedPreconditionError(absl::StrCat(
        op, " on ", name(), ": communicators are not formed (none yet, or an earlier collective failed); "
        "the mesh must be rebuilt"));
  }
  return absl::OkStatus();
}

absl::Status CommGroup::Failed(const char* op, const std::string& what, bool timed_out) {
  if (broken_ != nullptr) *broken_ = true;
#if defined(LORASTEP_WITH_NCCL)
  // A timed-out NCCL communicator may hold kernels that never finish: abort it.
  if (handles_ != nullptr && handles_->backend) {
    if (auto* nccl = dynamic_cast<::c10d::ProcessGroupNCCL*>(handles_->backend.get())) {
      try {
        nccl->abort();
      } catch (...) {
      }
    }
  }
#endif
  const std::string msg = absl::StrCat(op, " on ", name(), " (this rank ", ranks_[group_rank_],
                                       "): ", timed_out ? "timed out after " : "failed: ",
                                       timed_out ? absl::StrCat(timeout_.count(), " ms (a peer died or never arrived): ", what) : what);
  return timed_out ? absl::DeadlineExceededError(msg) : absl::UnavailableError(msg);
}

absl::Status CommGroup::AllReduce(at::Tensor& tensor, ReduceKind op) {
  if (size() == 1) return absl::OkStatus();
  if (GlooNeedsFp32(tensor)) {
    at::Tensor wide = tensor.to(at::kFloat);
    LORASTEP_RETURN_IF_ERROR(AllReduce(wide, op));
    tensor.copy_(wide);
    return absl::OkStatus();
  }
  LORASTEP_RETURN_IF_ERROR(Check("allreduce"));
  std::vector<at::Tensor> ts{tensor};
  ::c10d::AllreduceOptions opts;
  opts.reduceOp = ToC10d(op);
  return RunWork(this, "allreduce", timeout_, [&] { return handles_->backend->allreduce(ts, opts); },
                 &CommGroup::Failed);
}

absl::Status CommGroup::AllReduceCoalesced(std::vector<at::Tensor>& tensors, ReduceKind op) {
  if (size() == 1 || tensors.empty()) return absl::OkStatus();
  std::vector<at::Tensor> flat_parts;
  for (const auto& t : tensors) flat_parts.push_back(t.reshape({-1}));
  at::Tensor flat = at::cat(flat_parts);
  LORASTEP_RETURN_IF_ERROR(AllReduce(flat, op));
  int64_t offset = 0;
  for (auto& t : tensors) {
    t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<at::Tensor>> CommGroup::AllGather(const at::Tensor& tensor) {
  if (size() == 1) return std::vector<at::Tensor>{tensor};
  if (GlooNeedsFp32(tensor)) {
    LORASTEP_ASSIGN_OR_RETURN(std::vector<at::Tensor> wide, AllGather(tensor.to(at::kFloat)));
    for (auto& t : wide) t = t.to(at::kBFloat16);
    return wide;
  }
  LORASTEP_RETURN_IF_ERROR(Check("allgather"));
  std::vector<at::Tensor> in{tensor.contiguous()};
  std::vector<std::vector<at::Tensor>> out(1);
  for (int i = 0; i < size(); ++i) out[0].push_back(at::empty_like(in[0]));
  LORASTEP_RETURN_IF_ERROR(RunWork(this, "allgather", timeout_,
                                   [&] { return handles_->backend->allgather(out, in); },
                                   &CommGroup::Failed));
  return out[0];
}

absl::Status CommGroup::Broadcast(at::Tensor& tensor, int root) {
  if (size() == 1) return absl::OkStatus();
  if (GlooNeedsFp32(tensor)) {
    at::Tensor wide = tensor.to(at::kFloat);
    LORASTEP_RETURN_IF_ERROR(Broadcast(wide, root));
    tensor.copy_(wide);
    return absl::OkStatus();
  }
  LORASTEP_RETURN_IF_ERROR(Check("broadcast"));
  std::vector<at::Tensor> ts{tensor};
  ::c10d::BroadcastOptions opts;
  opts.rootRank = root;
  return RunWork(this, "broadcast", timeout_, [&] { return handles_->backend->broadcast(ts, opts); },
                 &CommGroup::Failed);
}

absl::StatusOr<at::Tensor> CommGroup::AllToAll(const at::Tensor& input,
                                               const std::vector<int64_t>& input_splits,
                                               const std::vector<int64_t>& output_splits) {
  if (static_cast<int>(input_splits.size()) != size() || static_cast<int>(output_splits.size()) != size()) {
    return absl::InvalidArgumentError(absl::StrCat("alltoall on ", name(), ": ", input_splits.size(), " and ",
                                                   output_splits.size(), " splits for ", size(), " members"));
  }
  int64_t rows = 0;
  for (int64_t n : output_splits) rows += n;
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape[0] = rows;
  if (size() == 1) return input;
  if (GlooNeedsFp32(input)) {
    LORASTEP_ASSIGN_OR_RETURN(at::Tensor wide, AllToAll(input.to(at::kFloat), input_splits, output_splits));
    return wide.to(at::kBFloat16);
  }
  LORASTEP_RETURN_IF_ERROR(Check("alltoall"));
  at::Tensor in = input.contiguous();
  at::Tensor out = at::empty(shape, in.options());
  std::vector<int64_t> in_splits = input_splits, out_splits = output_splits;
  LORASTEP_RETURN_IF_ERROR(RunWork(
      this, "alltoall", timeout_,
      [&] { return handles_->backend->alltoall_base(out, in, out_splits, in_splits); },
      &CommGroup::Failed));
  return out;
}

absl::Status CommGroup::Send(const at::Tensor& tensor, int dst, int tag) {
  if (GlooNeedsFp32(tensor)) return Send(tensor.to(at::kFloat), dst, tag);
  LORASTEP_RETURN_IF_ERROR(Check("send"));
  std::vector<at::Tensor> ts{tensor.contiguous()};
  return RunWork(this, "send", timeout_, [&] { return handles_->backend->send(ts, dst, tag); },
                 &CommGroup::Failed);
}

absl::Status CommGroup::Recv(at::Tensor& tensor, int src, int tag) {
  if (GlooNeedsFp32(tensor)) {
    at::Tensor wide = at::empty(tensor.sizes(), tensor.options().dtype(at::kFloat));
    LORASTEP_RETURN_IF_ERROR(Recv(wide, src, tag));
    tensor.copy_(wide);
    return absl::OkStatus();
  }
  LORASTEP_RETURN_IF_ERROR(Check("recv"));
  at::Tensor buffer = tensor.is_contiguous() ? tensor : at::empty_like(tensor, at::MemoryFormat::Contiguous);
  std::vector<at::Tensor> ts{buffer};
  LORASTEP_RETURN_IF_ERROR(RunWork(this, "recv", timeout_,
                                   [&] { return handles_->backend->recv(ts, src, tag); },
                                   &CommGroup::Failed));
  if (!buffer.is_same(tensor)) tensor.copy_(buffer);
  return absl::OkStatus();
}

absl::Status CommGroup::SendRecv(const at::Tensor* send, int dst, int send_tag, at::Tensor* recv,
                                 int src, int recv_tag) {
  if (send == nullptr && recv == nullptr) return absl::OkStatus();
  if (recv == nullptr) return Send(*send, dst, send_tag);
  if (send == nullptr) return Recv(*recv, src, recv_tag);
  if (GlooNeedsFp32(*send) || GlooNeedsFp32(*recv)) {
    const at::Tensor wide_send = send->to(at::kFloat);
    at::Tensor wide_recv = at::empty(recv->sizes(), recv->options().dtype(at::kFloat));
    LORASTEP_RETURN_IF_ERROR(SendRecv(&wide_send, dst, send_tag, &wide_recv, src, recv_tag));
    recv->copy_(wide_recv);
    return absl::OkStatus();
  }
  LORASTEP_RETURN_IF_ERROR(Check("sendrecv"));
  std::vector<at::Tensor> out{send->contiguous()};
  at::Tensor buffer = recv->is_contiguous() ? *recv : at::empty_like(*recv, at::MemoryFormat::Contiguous);
  std::vector<at::Tensor> in{buffer};
  c10::intrusive_ptr<::c10d::Work> send_work, recv_work;
  try {
    send_work = handles_->backend->send(out, dst, send_tag);
    recv_work = handles_->backend->recv(in, src, recv_tag);
  } catch (const std::exception& e) {
    return Failed("sendrecv", e.what(), LooksLikeTimeout(e.what()));
  }
  LORASTEP_RETURN_IF_ERROR(RunWork(this, "sendrecv", timeout_, [&] { return send_work; }, &CommGroup::Failed));
  LORASTEP_RETURN_IF_ERROR(RunWork(this, "sendrecv", timeout_, [&] { return recv_work; }, &CommGroup::Failed));
  if (!buffer.is_same(*recv)) recv->copy_(buffer);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ProcessGroups>> ProcessGroups::Create(const ProcessGroupsOptions& options) {
  const int world = options.layout.world_size();
  if (options.rank < 0 || options.rank >= world) {
    return absl::InvalidArgumentError(absl::StrCat("rank: ", options.rank, " not in [0, ", world, ")"));
  }
  auto groups = std::unique_ptr<ProcessGroups>(new ProcessGroups(options));
  if (world > 1) {
    IgnoreBrokenPipeSignal();
    LORASTEP_RETURN_IF_ERROR(CheckStoreAddress(options.store_address));
    groups->store_address_ = options.store_address;
    // Rank 0 serves the store from the start, so that its port is taken (or the error
    // shown) now; the others connect when they form communicators.
    if (options.rank == 0 || !options.defer_communicators) {
      LORASTEP_RETURN_IF_ERROR(groups->ConnectStore());
    }
  }
  if (options.defer_communicators) {
    groups->generation_ = -1;
    groups->ResetGroups();  // nothing formed: collectives fail until Rebuild
    return groups;
  }
  LORASTEP_RETURN_IF_ERROR(groups->Build());
  return groups;
}

ProcessGroups::ProcessGroups(ProcessGroupsOptions options) : options_(std::move(options)) {}
ProcessGroups::~ProcessGroups() = default;

absl::Status ProcessGroups::ConnectStore() {
  if (absl::StartsWith(store_address_, kFileStoreScheme)) {
    try {
      auto handles = std::make_unique<c10d_impl::Handles>();
      // -1 workers: the file is never removed by the last store closed (a rank reopens it at
      // every Rebuild); the coordinator removes its folder.
      handles->store = c10::make_intrusive<::c10d::FileStore>(store_address_.substr(kFileStoreScheme.size()), -1);
      store_ = std::move(handles);
    } catch (const std::exception& e) {
      const std::string what = e.what();
      return absl::UnavailableError(absl::StrCat("rendezvous at ", store_address_, ": ", what.substr(0, what.find('\n'))));
    }
    return absl::OkStatus();
  }
  LORASTEP_ASSIGN_OR_RETURN(auto host_port, SplitHostPort(store_address_));
  const auto& [host, port] = host_port;
  if (options_.store_transport_for) {
    auto handles = std::make_unique<c10d_impl::Handles>();
    handles->store = c10::make_intrusive<RemoteStore>(options_.store_transport_for(store_address_), options_.timeout);
    store_ = std::move(handles);
    return absl::OkStatus();
  }
  try {
    ::c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<uint16_t>(port);
    store_options.isServer = options_.rank == 0;
    store_options.numWorkers = options_.layout.world_size();
    store_options.waitWorkers = false;
    store_options.timeout = options_.timeout;
    auto handles = std::make_unique<c10d_impl::Handles>();
    handles->store = c10::make_intrusive<::c10d::TCPStore>(host, store_options);
    store_ = std::move(handles);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    return absl::UnavailableError(absl::StrCat("rendezvous at ", host, ":", port, ": ", what.substr(0, what.find('\n'))));
  }
  return absl::OkStatus();
}

CommGroup& ProcessGroups::group(GroupKind kind) {
  // Without expert parallelism the expert-data and expert-stage groups are the data and
  // stage groups (same ranks): one communicator each, not two.
  if (options_.layout.sizes().ep == 1) {
    if (kind == GroupKind::kExpertData) kind = GroupKind::kData;
    if (kind == GroupKind::kExpertStage) kind = GroupKind::kStage;
  }
  return *groups_.at(kind);
}

std::string ProcessGroups::store_address() const { return store_address_; }

absl::Status ProcessGroups::MoveStore(const std::string& address) {
  if (address == store_address()) return absl::OkStatus();
  if (options_.rank == 0) {
    return absl::FailedPreconditionError(absl::StrCat("rendezvous: rank 0 serves the store at ", store_address(),
                                                      ", not at ", address));
  }
  LORASTEP_RETURN_IF_ERROR(CheckStoreAddress(address));
  store_address_ = address;
  broken_ = true;  // formed at the next Rebuild, through the new store
  return absl::OkStatus();
}

absl::Status ProcessGroups::Rebuild(int generation) {
  generation_ = generation;
  ResetGroups();  // the old communicators' sockets go before the store connection they used
  // A rank other than 0 reconnects: the store it knew may have died with rank 0, and a new
  // rank 0 process serves a fresh one at the same address.
  if (options_.layout.world_size() > 1 && options_.rank != 0) {
    broken_ = true;
    LORASTEP_RETURN_IF_ERROR(ConnectStore());
  }
  return Build();
}

void ProcessGroups::ResetGroups() {
  groups_.clear();
  const ParallelLayout& layout = options_.layout;
  for (GroupKind kind : kFormOrder) {
    const bool alias = layout.sizes().ep == 1 && (kind == GroupKind::kExpertData || kind == GroupKind::kExpertStage);
    if (alias) continue;  // group() answers with the data / stage group
    const int index = layout.GroupIndex(kind, options_.rank);
    auto group = std::make_unique<CommGroup>(kind, index, layout.Group(kind, options_.rank), options_.rank);
    group->timeout_ = options_.timeout;
    group->broken_ = &broken_;
    groups_[kind] = std::move(group);
  }
  broken_ = true;  // until every communicator is formed
}

absl::Status ProcessGroups::Build() {
  ResetGroups();
  const at::Device device(options_.device);
  for (GroupKind kind : kFormOrder) {  // every rank forms them in this order: no deadlock
    auto it = groups_.find(kind);
    if (it == groups_.end() || it->second->size() == 1) continue;
    CommGroup* group = it->second.get();
    // Each group rendezvous under its own key prefix; a new generation never meets the
    // sockets of a failed one.
    auto prefix = c10::make_intrusive<::c10d::PrefixStore>(
        absl::StrCat(options_.store_key_prefix, "gen", generation_, "/", GroupKindName(kind), "/", group->index_),
        store_->store);
    group->handles_ = std::make_unique<c10d_impl::Handles>();
    try {
      if (device.is_cuda()) {
#if defined(LORASTEP_WITH_NCCL)
        // Blocking wait: wait() honours the timeout and throws instead of hanging.
        setenv("TORCH_NCCL_BLOCKING_WAIT", "1", /*overwrite=*/0);
        auto opts = ::c10d::ProcessGroupNCCL::Options::create();
        opts->timeout = options_.timeout;
        group->handles_->backend = c10::make_intrusive<::c10d::ProcessGroupNCCL>(
            prefix, group->rank(), group->size(), opts);
#else
        return absl::UnimplementedError("device: CUDA collectives need a build with NCCL");
#endif
      } else {
#if defined(LORASTEP_WITH_GLOO)
        auto opts = ::c10d::ProcessGroupGloo::Options::create(options_.timeout);
        opts->devices.push_back(::c10d::ProcessGroupGloo::createDeviceForHostname(options_.gloo_host));
        group->handles_->backend = c10::make_intrusive<::c10d::ProcessGroupGloo>(
            prefix, group->rank(), group->size(), opts);
#else
        return absl::UnimplementedError("device: CPU collectives need a build with gloo");
#endif
      }
    } catch (const std::exception& e) {
      group->handles_.reset();
      const std::string what = e.what();
      return absl::DeadlineExceededError(absl::StrCat("creating ", group->name(), ": ",
                                                      what.substr(0, what.find('\n'))));
    }
  }
  broken_ = false;
  return absl::OkStatus();
}

bool CpuCollectivesAvailable() {
#if defined(LORASTEP_WITH_GLOO)
  return true;
#else
  return false;
#endif
}

}  // namespace lorastep
