// c10d communication groups of one rank of a ParallelLayout, with absl::Status errors and
// timeouts: ProcessGroupGloo on CPU (Debian's LibTorch), ProcessGroupNCCL on CUDA (torch
// 2.11). Rendezvous at the store the coordinator names to every worker: a FileStore on one
// host, or across hosts rank 0's RendezvousStoreHost through `store_transport_for` (behind
// the cluster secret), or without one c10d's TCPStore rank 0 serves (no authentication).
//
// Contract (as c10d's): every rank of a group must issue the same collectives on it in the
// same order; a collective returns when this rank's part is done (synchronous: the caller's
// stream/thread waits). The parallel engine guarantees the order by running one call at a
// time per worker, and the coordinator sends every call to all ranks in one mesh-wide order.
//
// Failure: a peer that dies or never arrives makes the collective fail on every rank that
// reached it within `timeout` (DEADLINE_EXCEEDED, or UNAVAILABLE for a lost connection),
// never a hang. After a failure the group's communicator is unusable (NCCL is aborted);
// every later collective on any group of this ProcessGroups fails fast with
// FAILED_PRECONDITION until Rebuild() makes new communicators under a new store prefix.
// Rebuild also reconnects a rank other than 0 to the store: after rank 0 died, a new
// rank 0 process serves a fresh store at the same address.
//
// Deferred (options.defer_communicators, what a worker uses): Create forms no communicator;
// the first Rebuild(g) does, at the generation the mesh is at. A process that replaces a
// dead rank thus joins the survivors' next generation rather than generation 0, whose store
// keys still name the dead process's sockets.
//
// Example:
//   ProcessGroupsOptions o{"127.0.0.1:29500", rank, layout, "cpu", absl::Seconds(60)};
//   ASSIGN_OR_RETURN(auto groups, ProcessGroups::Create(o));
//   RETURN_IF_ERROR(groups->group(GroupKind::kData).AllReduce(flat_grads));
//
// Thread-safety: not thread-safe; one thread issues collectives (the worker's executor).
#ifndef LORASTEP_LIB_PARALLEL_PROCESS_GROUPS_H_
#define LORASTEP_LIB_PARALLEL_PROCESS_GROUPS_H_

#include <ATen/ATen.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/parallel/parallel_layout.h"
#include "lib/parallel/rendezvous_store.h"

namespace lorastep {

namespace c10d_impl {
struct Handles;  // c10d objects; kept out of this header (c10d headers compile slowly)
}

enum class ReduceKind { kSum, kMax, kMin };

// One group of ranks this rank belongs to. Size 1: every collective is a local no-op.
class CommGroup {
 public:
  CommGroup(GroupKind kind, int index, std::vector<int> ranks, int my_rank);
  ~CommGroup();
  CommGroup(const CommGroup&) = delete;
  CommGroup& operator=(const CommGroup&) = delete;

  GroupKind kind() const { return kind_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  int rank() const { return group_rank_; }        // this rank's index in ranks()
  const std::vector<int>& ranks() const { return ranks_; }  // global ranks, ascending
  std::string name() const;  // "data group 1 {1,3}"

  // In place over the group. One collective per call.
  absl::Status AllReduce(at::Tensor& tensor, ReduceKind op = ReduceKind::kSum);
  // Several tensors of one dtype and device in one collective (flattened, reduced, copied
  // back); for many small tensors.
  absl::Status AllReduceCoalesced(std::vector<at::Tensor>& tensors, ReduceKind op = ReduceKind::kSum);
  // Every member's `tensor` (same shape everywhere), in group-rank order.
  absl::StatusOr<std::vector<at::Tensor>> AllGather(const at::Tensor& tensor);
  absl::Status Broadcast(at::Tensor& tensor, int root_group_rank);
  // Rows of `input` (dim 0) go to the members in group-rank order, input_splits[j] rows to
  // member j; returns the rows received, output_splits[j] from member j, in member order.
  // Every member passes the splits its peers expect (exchange the counts first).
  absl::StatusOr<at::Tensor> AllToAll(const at::Tensor& input, const std::vector<int64_t>& input_splits,
                                      const std::vector<int64_t>& output_splits);
  // Point to point (pipeline activations). `tensor` shape and dtype agreed by both sides.
  absl::Status Send(const at::Tensor& tensor, int dst_group_rank, int tag = 0);
  absl::Status Recv(at::Tensor& tensor, int src_group_rank, int tag = 0);
  // A send and a receive posted together, then both awaited (either may be null): two
  // neighbours exchanging at once cannot block each other (1F1B's steady state).
  absl::Status SendRecv(const at::Tensor* send, int dst_group_rank, int send_tag, at::Tensor* recv,
                        int src_group_rank, int recv_tag);

 private:
  friend class ProcessGroups;
  absl::Status Check(const char* op) const;
  absl::Status Failed(const char* op, const std::string& what, bool timed_out);

  GroupKind kind_;
  int index_;
  std::vector<int> ranks_;
  int group_rank_ = 0;
  std::chrono::milliseconds timeout_{0};
  std::unique_ptr<c10d_impl::Handles> handles_;  // null for size 1
  bool* broken_ = nullptr;                        // shared by all groups of a ProcessGroups
};

struct ProcessGroupsOptions {
  // Where the ranks meet: "host:port" of the store rank 0 serves (meshes across hosts), or
  // "file://PATH" of a c10d FileStore every rank opens (a mesh on one host: nothing listens).
  std::string store_address;
  // How a rank reaches the store at a "host:port" address (rank 0: its own host, in process).
  // Empty: c10d's TCPStore, which rank 0 serves to anyone who connects (tests, --insecure).
  std::function<StoreTransport(const std::string& address)> store_transport_for;
  // Put before every store key (the cluster secret's RendezvousKeyPrefix). May be empty.
  std::string store_key_prefix;
  int rank = 0;
  ParallelLayout layout;
  std::string device = "cpu";  // "cpu" -> gloo; "cuda[:N]" -> NCCL
  std::string gloo_host = "127.0.0.1";  // address gloo binds on this host (CPU meshes)
  // Every collective and the rendezvous must finish within this, or fail on every rank.
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
  // Form no communicator (and, rank != 0, do not connect to the store) until Rebuild.
  bool defer_communicators = false;
};

class ProcessGroups {
 public:
  // Connects to the store and builds every group containing this rank (all ranks build the
  // groups in the same kind order, so the rendezvous cannot deadlock). With world > 1 the
  // process ignores SIGPIPE from then on (unless it had set its own disposition): a peer that
  // has gone is an error of the collective, not the end of this rank.
  static absl::StatusOr<std::unique_ptr<ProcessGroups>> Create(const ProcessGroupsOptions& options);
  ~ProcessGroups();

  const ParallelLayout& layout() const { return options_.layout; }
  int rank() const { return options_.rank; }
  RankCoords coords() const { return options_.layout.Coords(options_.rank); }
  CommGroup& group(GroupKind kind);
  bool broken() const { return broken_; }
  int generation() const { return generation_; }  // -1: deferred, not formed yet

  // New communicators for every group under generation `generation` (all ranks call it with
  // the same value, after a failure). Groups of earlier generations are dropped.
  absl::Status Rebuild(int generation);
  // The store's address (see ProcessGroupsOptions). MoveStore points a rank other than 0 at
  // another one (rank 0 was replaced elsewhere), used from the next Rebuild; INVALID_ARGUMENT
  // if not host:port or file://PATH, FAILED_PRECONDITION on rank 0 (which serves its own).
  std::string store_address() const;
  absl::Status MoveStore(const std::string& address);

 private:
  explicit ProcessGroups(ProcessGroupsOptions options);
  absl::Status ConnectStore();  // to store_address_
  // The groups of this rank without communicators (group() answers; collectives fail
  // FAILED_PRECONDITION until Build forms them).
  void ResetGroups();
  absl::Status Build();

  ProcessGroupsOptions options_;
  std::unique_ptr<c10d_impl::Handles> store_;  // the remote store, TCPStore or FileStore
  std::map<GroupKind, std::unique_ptr<CommGroup>> groups_;
  int generation_ = 0;
  std::string store_address_;
  bool broken_ = false;
};

// Whether this build has CPU collectives (gloo). The CUDA build links NCCL only, so CPU
// meshes exist in the Debian build alone.
bool CpuCollectivesAvailable();

}  // namespace lorastep

#endif  // LORASTEP_LIB_PARALLEL_PROCESS_GROUPS_H_
