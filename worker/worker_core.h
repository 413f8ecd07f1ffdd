// A worker's state, without gRPC: one frozen base model on one device and the runs
// (adapter + optimizer state) trained over it. Runs never touch each other: each owns its
// Trainer; the base weights are shared read-only.
//
// Thread-safety: all methods may be called from any thread; calls are serialized (one
// device, one call at a time).
#ifndef LORASTEP_WORKER_WORKER_CORE_H_
#define LORASTEP_WORKER_WORKER_CORE_H_

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "lib/fair_mutex.h"
#include "lib/fault_points.h"
#include "lib/io/background_writer.h"
#include "lib/io/state_store.h"
#include "lib/parallel/process_groups.h"
#include "lib/sampling/kv_blocks.h"
#include "lib/sampling/sampler.h"
#include "lib/training/trainer.h"
#include "worker/coschedule_window.h"

namespace lorastep {

struct WorkerOptions {
  std::string model_path;
  std::string device = "cpu";
  std::string dtype;  // "" = config.json's
  int64_t max_tokens_per_microbatch = 8192;
  bool pack_sequences = true;  // TrainerOptions::pack_sequences
  int64_t logprob_chunk_tokens = 1024;
  GradOptions grad;
  // Place in a mesh (world size 1 by default). The coordinator starts every rank with the
  // same sizes and rendezvous address; rank 0 serves the rendezvous store there.
  int rank = 0;
  ParallelSizes sizes;
  std::string rendezvous;  // host:port of rank 0's rendezvous store, or file://PATH on one host
  // How this rank reaches a host:port store (ProcessGroupsOptions::store_transport_for).
  std::function<StoreTransport(const std::string& address)> store_transport_for;
  std::string rendezvous_key_prefix;  // before every store key (RendezvousKeyPrefix of the secret)
  std::string gloo_host = "127.0.0.1";  // this host's address for CPU (gloo) meshes
  std::chrono::milliseconds collective_timeout{std::chrono::seconds(120)};
  GradFinalizeOptions finalize;  // its faults: set by the testing build only
  // Benchmarks: save a Kineto trace of each run's train step `profile_train_step` to
  // `profile_trace_path` (CUDA build). Set from LORASTEP_PROFILE_TRACE / _STEP.
  std::string profile_trace_path;
  int64_t profile_train_step = 0;
  // The state store's root: path fields are then lorastep://<run>/<name> references
  // (state_store.h); empty = plain paths on this worker's file system.
  std::string state_dir;
  // Activation-memory budget per micro-batch (TrainerOptions::max_activation_bytes).
  int64_t max_activation_bytes = 0;
  ActivationRecompute activation_recompute = ActivationRecompute::kAuto;  // --activation_recompute
  // Co-scheduling (Trainer::JointTrainStep): TrainSteps of different runs queued while the
  // device is busy run as one step. With more than one run on this worker, a call that finds
  // the device idle waits up to this long for other runs' calls first (a run alone never
  // waits). A co-scheduled call's cancellation is asked once, when the step takes it.
  // Zero turns co-scheduling off: every call runs alone, in arrival order.
  std::chrono::microseconds coschedule_window{0};
  // The sampler's key/value cache in bytes (--kv_cache_mb); 0: a tenth of the memory
  // available at the first Sample (the device's, or the host's on CPU), at most 4 GiB.
  int64_t kv_cache_bytes = 0;
  // Testing builds only (null in production): the core's fault points (lib/fault_points.h),
  // each passed as "<point>:<rank>" (e.g. "AdmitTrainStep:1": rank 1's own checks of a
  // TrainStep, before its vote), so one injector can serve every rank of a local mesh.
  std::shared_ptr<FaultPoints> faults;
};

// --max_activation_mb in bytes: negative turns the budget off (-1), 0 is the default (80%
// of the available host memory on CPU).
int64_t ActivationBytesFromMb(double mb);
// LORASTEP_PROFILE_TRACE [LORASTEP_PROFILE_STEP, default 2] (benchmarks): read from the
// environment, so a worker the coordinator starts inherits them (bench/step_bench.sh).
void ProfileFromEnvironment(WorkerOptions* options);

// What the coordinator sends with every call on a mesh (see worker.proto's MeshCall).
struct MeshCallInfo {
  int64_t expected_learner_version = -1;  // -1: not checked
  int64_t generation = 0;
  std::string rendezvous;  // "": the store this rank has
  bool agree_on_cancel = false;  // MeshCall.client_deadline
  // The same call with the learner version unchecked.
  MeshCallInfo Unchecked() const { return {-1, generation, rendezvous, agree_on_cancel}; }
};

class WorkerCore {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerCore>> Create(const WorkerOptions& options);
  // Ends the co-scheduling thread once the steps queued before are run.
  ~WorkerCore();

  const BaseModel& base() const { return *base_; }
  const WorkerOptions& options() const { return options_; }
  ProcessGroups* groups() const { return groups_.get(); }
  std::string state_store_id() const { return store_ != nullptr ? store_->id() : ""; }
  size_t num_runs() const;

  // `init_from` (optional): a PEFT adapter folder or a checkpoint to start from (see
  // CreateRunRequest); on any error no run is left behind. Returns the learner version.
  // On a mesh, loading `init_from` forms the communicators of `mesh.generation` first.
  absl::StatusOr<int64_t> CreateRun(const std::string& run_id, const LoraConfig& lora, uint64_t seed,
                                    const std::string& init_from = "", bool init_with_optimizer = false,
                                    const MeshCallInfo& mesh = {});
  // Frees the run (adapter, optimizer state). NOT_FOUND when unknown.
  absl::Status DeleteRun(const std::string& run_id);
  // `cancelled`: asked between micro-batches (BatchOptions::cancelled); empty: never.
  using Cancelled = std::function<bool()>;
  absl::StatusOr<ForwardBackwardResult> ForwardBackward(const std::string& run_id,
                                                        const std::vector<Datum>& datums,
                                                        const LossConfig& loss,
                                                        const BatchTotals* totals,  // null: of `datums`
                                                        std::optional<ActivationRecompute> recompute = std::nullopt,
                                                        const MeshCallInfo& mesh = {}, const Cancelled& cancelled = {});
  absl::StatusOr<ForwardBackwardResult> Forward(const std::string& run_id,
                                                const std::vector<Datum>& datums,
                                                const MeshCallInfo& mesh = {}, const Cancelled& cancelled = {});
  absl::StatusOr<OptimStepResult> OptimStep(const std::string& run_id, const AdamWParams& params,
                                            const MeshCallInfo& mesh = {});
  absl::StatusOr<OptimStepResult> TrainStep(const std::string& run_id,
                                            const std::vector<Datum>& datums,
                                            const LossConfig& loss, const AdamWParams& params,
                                            const BatchTotals* totals,  // null: of `datums`
                                            int64_t max_tokens,
                                            std::optional<ActivationRecompute> recompute = std::nullopt,
                                            const MeshCallInfo& mesh = {}, const Cancelled& cancelled = {});
  // Completions of `requests` from run `run_id`'s current adapter (`base_model`: the base
  // model alone, `run_id` unused) through the worker's one sampler engine: the sequences of
  // concurrent Sample calls decode together, each caller stepping the engine (under the
  // device lock, step by step) until its own requests are done. A data-parallel replica
  // (dp only) samples alone, without collectives; on tensor ranks (tp > 1) every rank of the
  // mesh gets the call (its replica's share of the prompts, maybe none), the ranks vote once
  // that all are ready, and each tensor group steps its engines together (the coordinator's
  // mesh order keeps other calls out). pp, cp or ep > 1: FAILED_PRECONDITION. `cancelled`:
  // asked between steps (on tensor ranks, voted on when `mesh.agree_on_cancel`); the call's
  // requests are then dropped, their blocks freed at once.
  struct SampleOutcome {
    std::vector<SampleResult> results;  // in request order
    int64_t learner_version = 0;
    int64_t engine_steps = 0;  // steps this caller ran
  };
  // `checkpoint` (a reference of the run, or a path): an adapter saved there (a PEFT folder
  // or a SaveState checkpoint, loaded into the run's LoRA config for this call) instead of
  // the run's current one; its learner version is reported.
  absl::StatusOr<SampleOutcome> Sample(const std::string& run_id, bool base_model, std::vector<SampleRequest> requests,
                                       const Cancelled& cancelled = {}, const std::string& checkpoint = "",
                                       const MeshCallInfo& mesh = {});
  // The sampler's figures: kv blocks in all and in use, sequences running, requests waiting.
  struct SamplerFigures {
    int64_t kv_blocks = 0, kv_blocks_used = 0, running_sequences = 0, waiting_requests = 0;
  };
  SamplerFigures SamplerState();
  struct PathResult {
    std::string adapter_sha256;
    int64_t learner_version = 0;
  };
  // A PEFT adapter's files (adapter_config.json, adapter_model.safetensors) stored at
  // `path` (a reference of `run_id`) once they load into a fresh adapter with the run's LoRA
  // config, as init_from loads one; nothing is stored otherwise. World size 1 only (like a
  // PEFT init_from). `learner_version` is the run's; `adapter_sha256` is empty.
  absl::StatusOr<PathResult> StoreAdapter(const std::string& run_id, const std::string& path,
                                          const std::string& adapter_config, const std::string& adapter_model,
                                          bool replace = false);
  // `background`: the state is copied to host memory here and the folder written afterwards
  // on the writer thread (adapter_sha256 is then empty); AwaitSaved tells how that ended.
  absl::StatusOr<PathResult> SaveState(const std::string& run_id, const std::string& path,
                                       const MeshCallInfo& mesh = {}, bool background = false);
  // Waits for the latest background SaveState of `path`: its outcome; without one, OK if a
  // folder is saved there, else NOT_FOUND. Does not wait for other calls.
  absl::Status AwaitSaved(const std::string& run_id, const std::string& path);
  // `weights_only`: the checkpoint's adapter, then a fresh optimizer (ResetOptimizer).
  absl::StatusOr<PathResult> LoadState(const std::string& run_id, const std::string& path,
                                       const MeshCallInfo& mesh = {}, bool weights_only = false);
  absl::StatusOr<PathResult> ExportAdapter(const std::string& run_id, const std::string& path,
                                           const MeshCallInfo& mesh = {}, bool expand_experts = false);
  // The state store's folders of a run / removing one (FAILED_PRECONDITION without a store).
  absl::StatusOr<std::vector<StoredFolder>> ListCheckpoints(const std::string& run_id) const;
  absl::Status DeleteCheckpoint(const std::string& run_id, const std::string& name);

 private:
  WorkerCore(WorkerOptions options, std::shared_ptr<const BaseModel> base)
      : options_(std::move(options)), base_(std::move(base)) {}
  absl::StatusOr<Trainer*> Find(const std::string& run_id);  // requires mu_
  // Before a call on a mesh: rebuilds communicators for a new generation, checks the
  // learner version. Requires mu_. Returns the run.
  absl::StatusOr<Trainer*> Prepare(const std::string& run_id, const MeshCallInfo& mesh);
  // Prepare for a call whose trainer votes at admission (the batch calls, OptimStep): when
  // this rank refuses (no such run, another learner version), it casts the same vote, so
  // every rank answers at once instead of waiting in a collective.
  absl::StatusOr<Trainer*> Admit(const std::string& run_id, const MeshCallInfo& mesh, const char* call);
  // Admission of a call that gathers the run's state to one rank (SaveState, ExportAdapter):
  // the path and the run are checked on every rank, then one vote, before any collective.
  // Returns the run's trainer and the path's folder. Requires mu_.
  struct GatherAdmitted {
    Trainer* trainer = nullptr;
    std::string folder;
  };
  absl::StatusOr<GatherAdmitted> AdmitGather(const std::string& run_id, const std::string& path,
                                             const MeshCallInfo& mesh, const char* call);
  // WorkerOptions::faults at "Admit<call>" for this rank: a fault in the rank's own checks
  // of `call` (OK without an injector).
  absl::Status AdmissionFault(const char* call);
  // WorkerOptions::faults with this rank's number added to each point; null without one.
  std::unique_ptr<FaultPoints> ranked_faults_;
  // Forms the communicators of the call's generation (through the store at its rendezvous)
  // unless they are formed and unbroken. Every rank gets the same generation with the same
  // call, so all form them together. Requires mu_.
  absl::Status FormGroups(const MeshCallInfo& mesh);
  // The folder a request's path field names. Writes (SaveState, ExportAdapter) must stay
  // under the run's own references.
  absl::StatusOr<std::string> ResolvePath(const std::string& run_id, const std::string& path, bool write) const;
  absl::StatusOr<const StateStore*> Store() const;
  // Loads `init_from` into a new run's trainer (CreateRun).
  // `vote`: the call's one vote, cast once the weights are checked and staged (at world
  // size 1 a MeshVote without groups decides alone).
  absl::Status InitRun(Trainer* trainer, const std::string& run_id, const std::string& init_from,
                       bool with_optimizer, MeshVote* vote) const;

  // A TrainStep waiting to be co-scheduled; its caller's thread waits for `done`.
  enum class CallKind { kTrainStep, kForwardBackward, kForward };
  struct QueuedStep {
    const std::string* run_id;
    CallKind kind;
    JointTrainCall call;  // trainer filled in at admission; a Forward has no loss
    MeshCallInfo mesh;    // the learner version the coordinator expects
    Cancelled cancelled;  // asked at admission (and between micro-batches when it runs alone)
    std::chrono::steady_clock::time_point queued;
    bool done = false;
    absl::StatusOr<OptimStepResult> result = absl::UnknownError("not run");           // TrainStep
    absl::StatusOr<ForwardBackwardResult> forward = absl::UnknownError("not run");  // the others
  };
  // Whether a TrainStep, ForwardBackward or Forward may wait to be co-scheduled (world size 1,
  // a window, a run that can and another on this worker that can, no activation_recompute of
  // its own).
  bool CoSchedules(const std::string& run_id, std::optional<ActivationRecompute> recompute);
  // Queues `step` and returns once the co-scheduling thread ran it.
  void AwaitCoscheduled(QueuedStep* step);
  // A TrainStep, ForwardBackward or Forward: co-scheduled with other runs' calls where this
  // run takes part (CoSchedules), else admitted and run alone under the core's lock by `alone`
  // with the call's BatchOptions.
  template <typename Result>
  absl::StatusOr<Result> RunBatchCall(CallKind kind, const char* name, const std::string& run_id, JointTrainCall call,
                                      std::optional<ActivationRecompute> recompute, const MeshCallInfo& mesh,
                                      const Cancelled& cancelled,
                                      absl::FunctionRef<absl::StatusOr<Result>(Trainer*, const BatchOptions&)> alone);
  // The co-scheduling thread (started by the first queued call, stopped by the destructor):
  // leads every co-scheduled step, so the device's per-thread state (cuDNN's attention plans
  // and cuBLAS's workspaces are cached per thread in LibTorch) is built once, not again on
  // whichever caller's thread would lead the next step.
  void CoscheduleLoop();
  // One step: waits out the window, takes the queued calls of distinct runs in arrival
  // order, admits them and runs the TrainSteps as one joint step and the Forwards as one
  // joint forward.
  void LeadCoscheduledStep();
  // The queued calls as the step's choice sees them (run, tenant, tokens). Requires queue_mu_.
  std::vector<WaitingCall> WaitingCalls() const;
  // The tenants active without a call queued, with their last call's tokens. Requires queue_mu_.
  std::map<std::string, int64_t> ExpectedTenants();
  // A step's taken calls of one kind (admitted, trainers set): alone, the run's own call;
  // several, one Trainer::JointTrainStep / JointForwardBackward / JointForward. Under the
  // device lock.
  void RunCoscheduled(CallKind kind, const std::vector<QueuedStep*>& steps);

  // The sampler's pool and engine, made at the first Sample. Requires sampler_mu_.
  absl::Status EnsureSampler();
  // What a Sample samples from: null (the base model), the run's adapter, or `checkpoint`'s
  // loaded into `saved` (this call's alone); `version` gets its learner version. Requires mu_.
  absl::StatusOr<const Adapter*> SamplingAdapter(const std::string& run_id, bool base_model,
                                                 const std::string& checkpoint, std::unique_ptr<Trainer>* saved,
                                                 int64_t* version);
  // Whether a Sample stops before its next step: its own caller's word alone, or on tensor
  // ranks the group's (any rank's yes) when the coordinator asked for a vote.
  absl::StatusOr<bool> SampleCancelled(const Cancelled& cancelled, CommGroup* tensor_group, bool agree_on_cancel);

  WorkerOptions options_;
  std::shared_ptr<const BaseModel> base_;
  std::mutex sampler_mu_;  // the engine and its pool; taken after mu_ when both are held
  std::unique_ptr<KvBlockPool> kv_pool_;
  std::unique_ptr<SamplerEngine> sampler_;
  std::unique_ptr<ProcessGroups> groups_;  // null at world size 1
  std::unique_ptr<StateStore> store_;      // null without --state_dir
  mutable FairMutex mu_;  // calls of all runs, admitted in arrival order
  std::mutex queue_mu_;   // the co-scheduling queue; never held while waiting for mu_
  std::condition_variable queue_cv_;  // the co-scheduling thread waits on it: a call queued, stopping
  std::condition_variable done_cv_;   // the callers wait on it: their steps done
  std::deque<QueuedStep*> queue_;
  std::once_flag scheduler_started_;
  std::thread scheduler_;  // CoscheduleLoop
  bool stopping_ = false;  // under queue_mu_: the destructor asks CoscheduleLoop to end
  // Every run's Trainer::CoSchedulable, so a call learns it without waiting for the device.
  std::map<std::string, bool> coschedulable_;
  // The runs a step's window waits for: those of the previous step, and runs created since.
  std::set<std::string> expected_runs_;
  // When each co-scheduled run's last step ended and how soon its next call followed: the
  // window holds for runs that answer in lock step (CoscheduleWindowClose).
  std::map<std::string, RunReturns> returns_;
  // Each co-scheduled run's last call's tokens: an expected tenant's share of the next step.
  std::map<std::string, int64_t> last_call_tokens_;
  bool last_step_heavy_ = false;  // the last step took a heavy tenant's calls (TakeForStep)
  // The last co-scheduled step's duration (co-scheduling thread only): it bounds how long the
  // window waits for expected runs (LeadCoscheduledStep).
  std::chrono::steady_clock::duration last_coscheduled_step_{0};
  // When the last co-scheduled step ended (co-scheduling thread only; none before the first).
  std::optional<std::chrono::steady_clock::time_point> last_coscheduled_end_;
  std::map<std::string, std::unique_ptr<Trainer>> runs_;
  // Background SaveStates. Last, so it is destroyed first: queued writes finish before the
  // core goes.
  BackgroundWriter writer_;
};

}  // namespace lorastep

#endif  // LORASTEP_WORKER_WORKER_CORE_H_
