// The training core of one run, with no gRPC in it: a frozen base model (shareable between
// runs), an Adapter, AdamW state and counters. What worker/ wraps.
//
// Example:
//   ASSIGN_OR_RETURN(auto base, LoadBaseModel("/models/qwen", "cpu", ""));
//   ASSIGN_OR_RETURN(auto trainer, Trainer::Create(base, options));
//   ASSIGN_OR_RETURN(auto fb, trainer->ForwardBackward(datums, loss));   // accumulates
//   ASSIGN_OR_RETURN(auto step, trainer->OptimStep(adamw));              // applies, zeroes
//
// Every call validates its whole input before any work; an error changes nothing (no half
// applied step, accumulated gradients kept as before the call).
// Thread-safety: not thread-safe; callers order calls per run.
#ifndef LORASTEP_LIB_TRAINING_TRAINER_H_
#define LORASTEP_LIB_TRAINING_TRAINER_H_

#include <ATen/ATen.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/training/adamw.h"
#include "lib/model/adapter.h"
#include "lib/training/activation_memory.h"
#include "lib/training/batch.h"
#include "lib/training/grad_finalizer.h"
#include "lib/model/linear.h"
#include "lib/training/loss_config.h"
#include "lib/fault_points.h"
#include "lib/training/metrics.h"
#include "lib/training/stage_gather.h"
#include "lib/model/model_weights.h"

namespace lorastep {

struct BaseModel {
  std::string path;
  ModelConfig config;
  ModelWeights weights;  // frozen
  at::Device device = at::kCPU;
  at::ScalarType dtype = at::kFloat;
  ModelShard shard;  // the part of the model `weights` holds (whole by default)
};

// device: "cpu", "cuda", "cuda:1"; dtype: "" (config.json's), "float32", "bfloat16", "float16".
// With `sizes`/`coords` (a mesh) only this rank's shard is kept (ShardModelWeights).
absl::StatusOr<std::shared_ptr<const BaseModel>> LoadBaseModel(const std::string& folder,
                                                               const std::string& device,
                                                               const std::string& dtype,
                                                               const ParallelSizes& sizes = {},
                                                               const RankCoords& coords = {});

struct TrainerOptions {
  LoraConfig lora;
  GradOptions grad;
  uint64_t seed = 0;                          // LoRA init and dropout stream
  int64_t max_tokens_per_microbatch = 8192;   // tokens per forward/backward (padded ones too)
  // Datums packed back to back in each micro-batch (no padding; attention per sequence,
  // varlen kernels on CUDA); false: one padded row per datum.
  bool pack_sequences = true;
  int64_t logprob_chunk_tokens = 1024;        // tokens per chunk of the fp32 logits
  double peak_flops = 0;                      // for MFU; 0 = the CUDA device's (lib/device_peaks.h), none on CPU
  // SHA-256 of the trainable tensors after each step. LoRA adapters are small; a full
  // fine-tune's copy and hash of every weight costs a large share of a step, so it is off
  // there unless asked for (SaveState/ExportAdapter still report it).
  bool digest_full_finetune_steps = false;
  BatchLimits limits;
  // The mesh this run trains on (not owned; outlives the Trainer). Null = world size 1.
  // Every rank of the mesh makes the same calls in the same order.
  ProcessGroups* groups = nullptr;
  GradFinalizeOptions finalize;  // its faults: set by tests only (FinalizeFaultSource)
  // Benchmarks: a Kineto trace of the train step numbered `profile_train_step` (1-based,
  // counted per Trainer) is saved to `profile_trace_path` (CUDA build only).
  std::string profile_trace_path;
  int64_t profile_train_step = 0;
  // Activation memory one micro-batch may need (EstimateActivationBytes), checked before any
  // work: over it the call is RESOURCE_EXHAUSTED instead of an out-of-memory kill. 0 = 80%
  // of what is available at call time: host memory on CPU (cgroup limit included), device
  // memory on CUDA (free plus the caching allocator's unused blocks); negative = no check.
  int64_t max_activation_bytes = 0;
  ActivationRecompute activation_recompute = ActivationRecompute::kAuto;
  // Co-scheduling: how much staged optimizer state (AdamW::StagedBytes) a joint step holds
  // at once; more runs are staged, checked and committed in batches of at most this much
  // (a run over it alone). Each batch costs one device wait.
  int64_t joint_optimizer_stage_bytes = int64_t{2} << 30;
  // Testing builds only (null in production): "AdamWStage" and "AdamWCommit"
  // (lib/fault_points.h). Not owned; outlives the trainer.
  FaultPoints* faults = nullptr;
};

// Per-call overrides for how a batch is run.
struct BatchOptions {
  // Denominators of the whole batch when this call carries only part of it (else computed
  // from the datums of this call).
  const BatchTotals* totals = nullptr;
  int64_t max_tokens_per_microbatch = 0;  // 0 = TrainerOptions' value
  std::optional<ActivationRecompute> activation_recompute;  // unset: TrainerOptions' value
  // Asked before each micro-batch (in one process also between the layers of a micro-batch,
  // in forward and backward): true stops the call there with CANCELLED and nothing
  // applied (its caller went away or its deadline passed). On a mesh only with
  // `agree_on_cancel`: the ranks then all-reduce their answers before each micro-batch (in a
  // pipeline, before each stage receives the micro-batch's input) and stop together (a rank
  // stopping alone would leave its peers in a collective); otherwise a mesh call runs to its
  // end. Empty: never cancelled.
  std::function<bool()> cancelled;
  bool agree_on_cancel = false;
  // False: the caller takes no per-position log-probs (TrainStep), so a training call scores
  // only its loss-bearing positions (MicroBatchOptions::loss_positions_only) and
  // ForwardBackwardResult::logprobs stays empty.
  bool return_logprobs = true;
};

struct ForwardBackwardResult {
  std::vector<std::vector<float>> logprobs;  // per datum, per position
  Metrics metrics;
};

struct OptimStepResult {
  Metrics metrics;
  int64_t learner_version = 0;
  std::string adapter_sha256;  // digest of the updated trainable tensors ("" when skipped)
  // SHA-256 of this rank's copy of each replicated tensor family, for cross-rank comparison
  // (on a mesh): "trainable" (every trainable tensor of this rank: equal across the data
  // group) and, with tensor parallelism, "tensor_replicated" (equal across the stage).
  std::map<std::string, std::string> replica_digests;
};

// SnapshotState's copy of a run's training state (defined in trainer.cc).
struct TrainerStateSnapshot;

// The world's verdict on one step of a mesh call (a MIN all-reduce of every rank's "my part
// succeeded"): `local` on the rank that failed, ABORTED on the others, OK when all succeeded.
// Every rank of the mesh calls it at the same point of the call. `groups` null: `local`.
absl::Status AgreeOnMesh(ProcessGroups* groups, const at::Device& device, const absl::Status& local);

// Whether any member of `group` says yes (a MAX all-reduce of one flag): every member asks at
// the same point, so all stop there together (a cancelled call).
absl::StatusOr<bool> AnyMemberSaysYes(CommGroup& group, const at::Device& device, bool yes);

// The one outcome vote of a mesh call, cast exactly once on every path: Cast(local) votes and
// returns the mesh's verdict (AgreeOnMesh); a vote destroyed without having been cast casts
// "no", so a rank that returns early on an error of its own (a missing file, a non-finite
// value in its shard) still answers its peers at once instead of leaving them in the vote
// until the collective timeout. Every path of a call must reach the same single vote point
// or return early; nothing is applied before Cast has returned OK.
class MeshVote {
 public:
  MeshVote(ProcessGroups* groups, const at::Device& device) : groups_(groups), device_(device) {}
  ~MeshVote() {
    if (!cast_) (void)AgreeOnMesh(groups_, device_, absl::AbortedError("this rank failed the call before its vote"));
  }
  MeshVote(const MeshVote&) = delete;
  MeshVote& operator=(const MeshVote&) = delete;
  absl::Status Cast(const absl::Status& local) {
    cast_ = true;
    return AgreeOnMesh(groups_, device_, local);
  }

 private:
  ProcessGroups* groups_;
  at::Device device_;
  bool cast_ = false;
};

class Trainer;

// One run's TrainStep in a co-scheduled step (Trainer::JointTrainStep).
struct JointTrainCall {
  Trainer* trainer = nullptr;
  const std::vector<Datum>* datums = nullptr;
  const LossConfig* loss = nullptr;
  AdamWParams adamw;
  int64_t max_tokens_per_microbatch = 0;  // 0 = the trainer's
  const BatchTotals* totals = nullptr;    // the whole batch's denominators; null: of `datums`
  // Asked before each joint row the call still has parts in: true stops the call there, and
  // nothing of it applies (CANCELLED). Empty: never cancelled.
  std::function<bool()> cancelled;
};

// This process's peak resident memory in bytes (the peak_host_memory_bytes metric).
double PeakHostMemoryBytes();

// CANCELLED for a call stopped before micro-batch `micro_batch` (0-based) of `micro_batches`
// (`micro_batch` past the last: another rank stopped it); nothing of it applies.
absl::Status CancelledBeforeMicroBatch(size_t micro_batch, size_t micro_batches);
// CANCELLED for a call stopped inside micro-batch `micro_batch` (0-based), between its layers.
absl::Status CancelledInMicroBatch(size_t micro_batch, size_t micro_batches);

// One run's Forward in a co-scheduled step (Trainer::JointForward).
struct JointForwardCall {
  Trainer* trainer = nullptr;
  const std::vector<Datum>* datums = nullptr;
  // As JointTrainCall::cancelled: asked before each joint row holding the call's next micro-batch.
  std::function<bool()> cancelled;
};

class Trainer {
 public:
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(std::shared_ptr<const BaseModel> base,
                                                         const TrainerOptions& options);

  // Forward + backward over all datums in micro-batches; gradients accumulate until OptimStep.
  absl::StatusOr<ForwardBackwardResult> ForwardBackward(const std::vector<Datum>& datums,
                                                        const LossConfig& loss,
                                                        const BatchOptions& batch = {});
  // Log-probs only (old or reference log-probs), no gradients.
  // `batch`: only `cancelled` applies.
  absl::StatusOr<ForwardBackwardResult> Forward(const std::vector<Datum>& datums, const BatchOptions& batch = {});
  // Finalizes gradients, clips, steps AdamW, zeroes gradients, bumps the learner version.
  absl::StatusOr<OptimStepResult> OptimStep(const AdamWParams& params);
  // A whole rollout batch: ForwardBackward then OptimStep; metrics of both.
  // On any error nothing changes: gradients accumulated by earlier calls are kept as they were.
  absl::StatusOr<OptimStepResult> TrainStep(const std::vector<Datum>& datums,
                                            const LossConfig& loss, const AdamWParams& params,
                                            const BatchOptions& batch = {});

  // Several runs' TrainSteps on one base model as one forward/backward per micro-batch
  // (co-scheduling, issue 30; lib/training/co_schedule.cc): the frozen GEMMs run once over
  // every run's tokens (ForwardOptions::run_segments), each run's LoRA, loss (its own
  // denominators), gradients, clipping and AdamW stay its own, so each result equals the
  // run's TrainStep alone up to floating-point order. A refused call (bad batch or AdamW
  // parameters, a non-finite gradient) fails alone and changes nothing of its run; the
  // others commit. A call whose activations need recomputation runs alone (its TrainStep)
  // after the joint part. Trainers must be CoSchedulable and share one base; others are
  // refused by name. One result per call, in order.
  static std::vector<absl::StatusOr<OptimStepResult>> JointTrainStep(const std::vector<JointTrainCall>& calls);
  // Several runs' ForwardBackward calls on one base model, as JointTrainStep's joint rows
  // without its optimizer step: each run's gradients accumulate in its own buffers until its
  // OptimStep; each call's log-probs, loss and metrics are its run's ForwardBackward's alone
  // up to floating-point order; a refused, failed or cancelled call changes nothing of its run.
  static std::vector<absl::StatusOr<ForwardBackwardResult>> JointForwardBackward(
      const std::vector<JointTrainCall>& calls);
  // Several runs' Forward calls on one base model as few forward passes without gradients
  // (joint rows as JointTrainStep lays them out), each run's LoRA on its own rows and its own
  // head: each call's log-probs and metrics are those of its run's Forward alone up to
  // floating-point order. A refused or cancelled call fails alone; nothing changes any run.
  static std::vector<absl::StatusOr<ForwardBackwardResult>> JointForward(const std::vector<JointForwardCall>& calls);
  // Whether this run can take part in JointTrainStep: world size 1, LoRA on a dense model,
  // packed sequences.
  bool CoSchedulable() const;

  // Training state: trainable tensors, optimizer state, counters, dropout RNG; atomic.
  absl::Status SaveState(const std::string& folder,
                         const std::function<absl::Status(const std::string&)>& fault_point =
                             nullptr) const;
  // SaveState in two halves: the state copied to host memory now (collective on a mesh),
  // written to a folder later, from any thread, while training goes on. An autosave's disk
  // writes then hold neither the device nor the run. Ranks that do not write the gathered
  // state get a snapshot whose write does nothing.
  absl::StatusOr<std::shared_ptr<const TrainerStateSnapshot>> SnapshotState() const;
  static absl::Status WriteStateSnapshot(const TrainerStateSnapshot& snapshot, const std::string& folder,
                                         const std::function<absl::Status(const std::string&)>& fault_point =
                                             nullptr);
  // `vote`: the call's outcome vote on a mesh (cast here once the checkpoint is staged; an
  // early return leaves it to the caller's guard). Null: this trainer's own.
  absl::Status LoadState(const std::string& folder, MeshVote* vote = nullptr);
  // PEFT adapter folder (LoRA runs).
  // PEFT folder (lib/model/peft_io.h); `expand_experts`: shared-outer factors copied per expert.
  absl::Status ExportAdapter(const std::string& folder, bool expand_experts = false) const;
  // Loads a PEFT adapter folder (same rank, alpha, targets) into this run, world size 1: the
  // optimizer's master copy takes the imported values (so they survive the next step), its
  // moments restart, pending gradients are dropped. On error nothing changes.
  absl::Status ImportAdapter(const std::string& folder);
  // Keeps the trained values but starts the optimizer over: the master copy takes the
  // values, moments and the step count restart at zero (a run started "from weights only").
  void ResetOptimizer();

  int64_t learner_version() const { return optimizer_->steps_taken(); }
  int64_t pending_backward_calls() const { return pending_backward_calls_; }
  const Adapter& adapter() const { return *adapter_; }
  Adapter& mutable_adapter() { return *adapter_; }
  const BaseModel& base() const { return *base_; }
  std::string AdapterSha256() const;
  // SHA-256 of the whole (gathered) adapter: the same at every layout. Collective on a mesh.
  std::string FullAdapterSha256() const;

 private:
  Trainer(std::shared_ptr<const BaseModel> base, const TrainerOptions& options, Adapter adapter);
  // OptimStep's work. `restore_on_failure`: put back the local gradients a failed step
  // reduced on a mesh (TrainStep restores its own, earlier snapshot instead).
  // SaveState / SnapshotState: `copy` detaches the host tensors from the live ones.
  absl::StatusOr<std::shared_ptr<const TrainerStateSnapshot>> Snapshot(bool copy) const;
  // `digest` false: no adapter digest (adapter_sha256 empty, no time_digest_s); at world size
  // 1 only (a mesh's replica digests are part of its step).
  absl::StatusOr<OptimStepResult> StepOptimizer(const AdamWParams& params, bool restore_on_failure,
                                                bool digest = true);
  // TrainerOptions::faults' "AdamWStage": a staged update that the fault point fails becomes
  // the allocation failure it stands for.
  void AtStageFaultPoint(absl::StatusOr<AdamW::StagedStep>* staged);
  // recompute[i]: how much of micro-batch i's layer activations is recomputed; rule_kept_fits[i]:
  // whether its linear-attention rules keep their intermediates without layer recomputation
  // (CheckActivationBudget; absent: they run again in backward).
  absl::StatusOr<ForwardBackwardResult> RunMicroBatches(const std::vector<Datum>& datums,
                                                        const LossConfig* loss,
                                                        const BatchOptions& batch,
                                                        const std::vector<LayerRecompute>& recompute = {},
                                                        const std::vector<bool>& rule_kept_fits = {});
  // What a mutating call may change before it fails: accumulated gradients (after folding
  // autograd grads in) and the dropout stream. Restored so a failed call changes nothing.
  struct CallSnapshot {
    std::vector<at::Tensor> main_grads;  // empty when nothing was accumulated
    at::Tensor dropout_rng;
    int64_t pending_backward_calls = 0;
  };
  absl::StatusOr<CallSnapshot> Snapshot();
  void Restore(const CallSnapshot& snapshot);
  // ForwardBackward with the caller's own rank-local checks (`caller_checks`) voted on at
  // admission together with the batch's.
  absl::StatusOr<ForwardBackwardResult> AdmittedForwardBackward(const std::vector<Datum>& datums,
                                                                const LossConfig& loss, const BatchOptions& batch,
                                                                const absl::Status& caller_checks);
  void SyncDevice() const;
  // peak_cuda_memory_bytes:max since the last reset (CUDA only).
  void AddCudaPeakMemory(Metrics* metrics) const;
  // On a mesh: every rank votes with its outcome (a world-group MIN all-reduce) before it
  // commits, so either every rank applies a call or none does. World size 1: `local`.
  // Whether the call is to stop before its next micro-batch (BatchOptions::cancelled).
  absl::StatusOr<bool> CallCancelled(const BatchOptions& batch);
  absl::Status AgreeOnOutcome(const absl::Status& local);
  // The micro-batches of a call: packed (PackIntoMicroBatches) or padded per datum.
  std::vector<std::vector<size_t>> SplitMicroBatches(const std::vector<Datum>& datums, int64_t max_tokens) const;
  // RESOURCE_EXHAUSTED when a micro-batch of `datums` would need more activation memory than
  // this worker's budget (TrainerOptions::max_activation_bytes) even with what recomputation
  // allows; checked before any work. `recompute` (backward calls) receives, per micro-batch,
  // how much its layers recompute (TrainerOptions::activation_recompute; auto: the least that fits),
  // and `rule_kept_fits` whether, without layer recomputation, its linear-attention rules may
  // keep their intermediates for backward (EstimateActivationBytes' `rule_kept`) instead of
  // running again there: a local choice that changes no result, so the ranks need not agree.
  absl::Status CheckActivationBudget(const std::vector<Datum>& datums, const BatchOptions& batch, bool backward,
                                     std::vector<LayerRecompute>* recompute = nullptr,
                                     std::vector<bool>* rule_kept_fits = nullptr) const;
  // The activation memory one micro-batch may use (TrainerOptions::max_activation_bytes; 0
  // there: 80% of what the device or this process can still allocate); -1: no limit.
  int64_t ActivationBudgetBytes() const;
  // Co-scheduling's shared pass (JointTrainStep, JointForwardBackward, JointForward):
  // admission, then every joint row's forward and (training kinds) backward; FinishJointCall
  // undoes a training run whose pass failed or was cancelled (else counts its backward call);
  // AddJointMetrics adds a training run's figures.
  struct JointPass;
  enum class JointKind { kTrainStep, kForwardBackward, kForward };
  static JointPass RunJointPass(const std::vector<JointTrainCall>& calls, JointKind kind);
  static absl::Status FinishJointCall(const JointPass& pass, size_t run, const std::vector<JointTrainCall>& calls);
  static void AddJointMetrics(JointPass& pass, size_t run, Metrics* metrics);
  // JointTrainStep without the benchmarks' profile; JointProfiledTrainer counts the step for
  // each run and returns a run whose profile_train_step this is (null for none).
  static std::vector<absl::StatusOr<OptimStepResult>> JointTrainStepUnprofiled(const std::vector<JointTrainCall>& calls);
  static const Trainer* JointProfiledTrainer(const std::vector<JointTrainCall>& calls);
  // The optimizer steps of the joint pass's `runs` (positions in its admitted calls) as one
  // pass: every run's norm with one host wait, every staged update checked with one more,
  // each refusal undoing that run alone. World size 1 (co-scheduled runs only).
  static void StepJointOptimizers(JointPass& pass, const std::vector<size_t>& runs,
                                  const std::vector<JointTrainCall>& calls,
                                  std::vector<absl::StatusOr<OptimStepResult>>* results);
  // Co-scheduling: whether a call's run may join a step (its trainer and datums given, once
  // per step, the step's base model, CoSchedulable); `base` and `seen` carry the step's so far.
  static absl::Status JoinStep(const Trainer* trainer, const std::vector<Datum>* datums, const BaseModel** base,
                               std::set<const Trainer*>* seen);
  // Co-scheduling: (run, micro-batch) pairs, a run being a position in `trainers`.
  using JointPart = std::pair<size_t, size_t>;
  // The joint rows of a co-scheduled step: the runs' micro-batches (every run's first, then
  // every run's second, ...) one after another, a new row where the next would not fit the
  // activation budget or its run already has a part in the row (a micro-batch alone fits:
  // admission checked it). Fewer, longer rows launch fewer kernels and read the frozen
  // weights fewer times. Then the same number of rows evened out where the parts allow
  // (each row up to the mean row's tokens).
  static std::vector<std::vector<JointPart>> PackJointRows(const std::vector<Trainer*>& trainers,
                                                           const std::vector<const std::vector<Datum>*>& datums,
                                                           const std::vector<std::vector<std::vector<size_t>>>& splits,
                                                           bool backward);
  // Whether the MLP keeps its SwiGLU activation for backward (EstimateActivationBytes).
  bool MlpActivationKept() const;
  // On a mesh every rank recomputes a micro-batch as much as any rank would (the replay
  // repeats the layers' collectives): one world all-reduce (max) of the levels.
  absl::Status AgreeOnRecompute(std::vector<LayerRecompute>* recompute);
  std::map<std::string, std::string> ReplicaDigests(const std::string& trainable_sha256) const;
  // This pipeline stage's part of a call's micro-batches: Megatron's 1F1B (warm-up forwards,
  // one-forward-one-backward steady state with paired send/receive, cool-down backwards),
  // or all forwards for a forward-only call. `forward(i, input)` runs micro-batch i on this
  // stage (input: the received activation; undefined on the first stage) and returns the
  // stage output, or on the last stage the loss.
  absl::Status RunPipelineSchedule(int num_micro_batches, bool backward,
                                   const std::function<std::vector<int64_t>(int)>& activation_shape,
                                   const std::function<at::Tensor(int, const at::Tensor&)>& forward,
                                   const std::function<absl::Status(int)>& stop_before,
                                   double* t_forward, double* t_backward);
  // Whole tensors from this rank's slices (tensor ranks all-gather split parameters; a
  // collective every rank of the tensor group makes). `local` is in parameter order.
  absl::StatusOr<std::vector<at::Tensor>> GatherTensorSplits(const std::vector<at::Tensor>& local) const;
  // Pipeline stages' whole tensors in stage order, on stage 0 (of replica 0, tensor rank 0);
  // other ranks get their own list back. A point-to-point exchange over the pipeline group.
  absl::StatusOr<std::vector<NamedTensor>> GatherStages(std::vector<NamedTensor> local) const;
  // The whole adapter (every stage, whole tensors), complete on the writing rank.
  absl::StatusOr<std::vector<NamedTensor>> WholeAdapter() const;
  // The rank that writes gathered checkpoints and exports (tensor 0, stage 0, replica 0).
  bool WritesGatheredState() const;

  std::shared_ptr<const BaseModel> base_;
  TrainerOptions options_;
  std::unique_ptr<Adapter> adapter_;
  std::unique_ptr<AdamW> optimizer_;
  at::Generator dropout_generator_;
  int64_t train_steps_run_ = 0;  // TrainStep calls, for profile_train_step
  int64_t pending_backward_calls_ = 0;  // ForwardBackward calls since the last OptimStep
};

}  // namespace lorastep

#endif  // LORASTEP_LIB_TRAINING_TRAINER_H_
