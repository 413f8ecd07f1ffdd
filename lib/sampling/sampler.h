// The sampler's engine: requests of prompts as token ids, each with `num_samples`
// completions, sampled from a model (the base, or a run's LoRA adapter over it) through the
// same decoder forward the trainer runs, with keys and values kept in a KvBlockPool.
//
// Each Step() is one forward per adapter over the tokens the engine has ready: one decode
// token of every running sample, then prompt chunks (chunked prefill) up to the step's token
// budget, so a long prompt does not stall running decodes. A request's prompt is prefilled
// once; its samples share the prompt's full blocks and copy its last, partial one (prefix
// sharing). A request is admitted when the blocks it can need at most (its prompt, and each
// sample's own blocks up to max_tokens) fit beside those of the admitted ones, and for a
// model with linear-attention layers its sequences' recurrent states fit the states' share
// of the budget, so a step never runs out of memory; until then it waits, in arrival order,
// in a bounded queue.
//
// Reported per sampled token: its log-prob under the model at temperature 1 with nothing cut
// (what the trainer computes for it) and under the sampling distribution
// (lib/sampling/sampling_params.h).
//
// Tensor parallelism: the weights and adapters hold this rank's shard (`shard`), and every
// rank of the tensor group runs the same engine over the same requests in the same order;
// each step's forward runs the trainer's sharded layers and gathers the whole vocabulary's
// logits, so every rank draws the same tokens and its cache holds its own key/value heads.
#ifndef LORASTEP_LIB_SAMPLING_SAMPLER_H_
#define LORASTEP_LIB_SAMPLING_SAMPLER_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "lib/model/adapter.h"
#include "lib/model/model_config.h"
#include "lib/model/model_weights.h"
#include "lib/parallel/parallel_layout.h"
#include "lib/parallel/process_groups.h"
#include "lib/sampling/kv_blocks.h"
#include "lib/sampling/sampling_params.h"

namespace lorastep {

struct SampleRequest {
  std::vector<int64_t> prompt;
  int64_t num_samples = 1;
  SamplingParams params;
};

struct TopLogprob {
  int64_t token = 0;
  float logprob = 0;  // under the model, temperature 1
};

struct SampledSequence {
  std::vector<int64_t> tokens;
  std::vector<float> logprobs;           // under the model at temperature 1, nothing cut
  std::vector<float> sampling_logprobs;  // under the sampling distribution
  std::vector<std::vector<TopLogprob>> top_logprobs;  // per token, when asked
  std::string stop_reason;                            // "stop" or "length"
};

struct SampleResult {
  std::vector<SampledSequence> sequences;  // num_samples, in sample order
  std::vector<float> prompt_logprobs;      // when asked: token i + 1 given tokens 0..i
  std::vector<std::vector<TopLogprob>> prompt_top_logprobs;  // when asked: at token i + 1
  int64_t prefill_tokens = 0;              // prompt tokens run through the model (once per prompt)
  double time_to_first_token_s = 0;        // from Add to the samples' first tokens
  double time_per_output_token_s = 0;      // after the first token, per token of the longest sample
};

struct SamplerOptions {
  int64_t max_tokens_per_step = 2048;  // decode tokens plus prefill chunks in one step
  int64_t max_waiting = 1024;          // requests waiting for blocks; beyond, RESOURCE_EXHAUSTED
  // Models with linear-attention layers: how many sequences may hold a recurrent state at
  // once (its memory is budgeted beside the blocks: SplitSamplingBudget); 0: no limit.
  int64_t max_recurrent_sequences = 0;
};

class SamplerEngine {
 public:
  // `weights`, `pool` and `shard` outlive the engine; `pool` is its alone. `shard`: this
  // rank's part of a tensor-parallel model (null: the whole model).
  SamplerEngine(const ModelConfig& config, const ModelWeights& weights, KvBlockPool* pool, SamplerOptions options,
                const ModelShard* shard = nullptr);
  ~SamplerEngine();

  // Queues a request for `adapter`'s model (null: the base model; it must outlive the
  // request). INVALID_ARGUMENT naming the field for a bad request; RESOURCE_EXHAUSTED when it
  // could never fit the pool, or the queue is full. Nothing is queued on an error.
  absl::StatusOr<int64_t> Add(const Adapter* adapter, SampleRequest request);
  // Admits what fits and runs one step; does nothing when idle. With a sharded model every
  // rank of `tensor_group` steps together (same requests, same order).
  absl::Status Step(CommGroup* tensor_group = nullptr);
  bool Idle() const { return waiting_.empty() && running_.empty(); }
  // Request `id`'s result once it finished (then forgotten); nullopt before.
  std::optional<SampleResult> Take(int64_t id);
  // Drops request `id`, waiting, running or finished; its blocks are free at once.
  void Cancel(int64_t id);

  // What the last Step() ran: decode tokens (one per running sample) and prompt tokens.
  struct StepFigures {
    int64_t decode_tokens = 0, prefill_tokens = 0;
  };
  const StepFigures& last_step() const { return last_step_; }
  int64_t running_sequences() const;
  int64_t waiting_requests() const { return static_cast<int64_t>(waiting_.size()); }

 private:
  struct Request;
  struct Sample;
  absl::Status StepOnce(CommGroup* tensor_group);
  void Admit();
  // Blocks `r` can need at most.
  int64_t WorstCaseBlocks(const SampleRequest& r) const;
  // Recurrent states `r` can hold at once: its prompt's and each sample's copy while they
  // fork (none for a model without linear-attention layers).
  int64_t WorstCaseStates(const SampleRequest& r) const;
  // A token to draw for `sample` from row `row` of a forward's logits.
  struct Draw {
    Request* request;
    Sample* sample;
    int64_t row;
  };
  // A prompt log-prob to read: token `target` at row `row`.
  struct PromptLogprob {
    Request* request;
    int64_t row;
    int64_t target;
  };
  // The draws and prompt log-probs of one forward's logits [rows, V] (fp32, on the device),
  // computed together, one copy to the host; then each sample gets its token.
  void ApplyDraws(const at::Tensor& logits, const std::vector<Draw>& draws, const std::vector<PromptLogprob>& prompt_lps);
  // Appends a drawn token to `s` and checks its stops (a finished sample frees its blocks).
  void Append(Request& r, Sample& s, int64_t token, float logprob, float sampling_logprob, std::vector<TopLogprob> top);
  // After the prompt's last chunk: the samples, each with its blocks (the prompt's full
  // blocks shared, its partial one copied; a single sample takes the prompt's blocks).
  absl::Status Fork(Request& r);
  void Finish(Request& r);
  void Release(KvSequence& kv);

  const ModelConfig config_;
  const ModelWeights& weights_;
  KvBlockPool* pool_;
  const SamplerOptions options_;
  const ModelShard* shard_;
  int64_t next_id_ = 1;
  int64_t reserved_blocks_ = 0;  // the admitted requests' worst cases
  int64_t reserved_states_ = 0;
  std::deque<std::unique_ptr<Request>> waiting_;
  std::vector<std::unique_ptr<Request>> running_;
  std::map<int64_t, SampleResult> finished_;
  StepFigures last_step_;
};

}  // namespace lorastep

#endif  // LORASTEP_LIB_SAMPLING_SAMPLER_H_
